//! Deviations in the DP-SGD step: the clipping norm, the clipped sum, the noise and the divisor.

use crate::clippers::gram::{self, Factored};
use crate::clippers::{clipped_sum, NoiseOrder, NoiseSpec};
use crate::error::Result;
use crate::options::ClipNorm;
use crate::trace::Trace;
use candle_core::Tensor;

/// The clipping norm the coefficients use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClipAt {
    /// The stated C, which the noise uses too.
    Stated,
    /// A default C = 1, whatever C the noise uses.
    One,
}

/// The sum the coefficients weigh.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sum {
    /// Σ_i c_i g_i.
    Clipped,
    /// Σ_i c_i g_i with the last site of every shared parameter (a tied embedding's LM-head
    /// use) summed with weight 1.
    HeadPathUnclipped,
    /// Two micro-batches, the first half of the batch and the rest; only the last one's sum
    /// kept.
    LastMicrobatch,
}

/// How many draws of noise a parameter gets, and where they are added.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Noise {
    /// One draw per parameter before the division: DP-SGD.
    OncePerParameter,
    /// One draw per use of a parameter.
    OncePerUse,
    /// None on a parameter used more than once.
    NoneOnShared,
    /// One draw per parameter, added after the division.
    AfterDivision,
    /// One draw per parameter before the division, at σ divided by the number of accumulation
    /// steps ([`ACCUMULATION_STEPS`], the micro-batches of [`Sum::LastMicrobatch`]): a noise
    /// multiplier rescaled when the logical batch was split, although the accumulated sum is
    /// noised once.
    MultiplierOverAccumulation,
}

/// The accumulation steps a logical batch is split into by the step mutants: two halves.
pub const ACCUMULATION_STEPS: usize = 2;

/// What the noisy sum is divided by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Divisor {
    /// The stated divisor (the expected batch size).
    Stated,
    /// The size of the batch actually drawn.
    DrawnBatchSize,
}

impl ClipAt {
    pub(super) fn of(self, stated: ClipNorm) -> ClipNorm {
        match self {
            ClipAt::Stated => stated,
            ClipAt::One => ClipNorm::new(1.0).expect("1 is a valid clipping norm"),
        }
    }
}

impl Sum {
    /// The sum per parameter, from the coefficients.
    pub(super) fn of(self, trace: &Trace, coefficients: &[f64]) -> Result<Vec<(String, Tensor)>> {
        match self {
            Sum::Clipped => clipped_sum(trace, coefficients),
            Sum::HeadPathUnclipped => head_path_unclipped(trace, coefficients),
            Sum::LastMicrobatch => {
                let mut kept = coefficients.to_vec();
                kept[..trace.batch_size() / ACCUMULATION_STEPS].fill(0.0);
                clipped_sum(trace, &kept)
            }
        }
    }
}

impl Noise {
    /// The draws a parameter used `uses` times gets.
    pub(super) fn draws(self, uses: usize) -> usize {
        match self {
            Noise::OncePerParameter | Noise::AfterDivision | Noise::MultiplierOverAccumulation => 1,
            Noise::OncePerUse => uses,
            Noise::NoneOnShared => usize::from(uses == 1),
        }
    }

    pub(super) fn order(self) -> NoiseOrder {
        match self {
            Noise::OncePerParameter
            | Noise::OncePerUse
            | Noise::NoneOnShared
            | Noise::MultiplierOverAccumulation => NoiseOrder::BeforeDivision,
            Noise::AfterDivision => NoiseOrder::AfterDivision,
        }
    }
}

impl Noise {
    /// The standard deviation of one draw, from the stated σC.
    pub(super) fn std(self, stated: f64) -> f64 {
        match self {
            Noise::OncePerParameter
            | Noise::OncePerUse
            | Noise::NoneOnShared
            | Noise::AfterDivision => stated,
            Noise::MultiplierOverAccumulation => stated / ACCUMULATION_STEPS as f64,
        }
    }
}

impl Divisor {
    pub(super) fn of(self, trace: &Trace, noise: &NoiseSpec) -> f64 {
        match self {
            Divisor::Stated => noise.divisor,
            Divisor::DrawnBatchSize => trace.batch_size() as f64,
        }
    }
}

/// Σ_i c_i g_i with the last site of every shared parameter (a tied embedding's LM-head use)
/// summed with weight 1: its gradient path left out of the clipping.
fn head_path_unclipped(trace: &Trace, coefficients: &[f64]) -> Result<Vec<(String, Tensor)>> {
    let weights = |w: &[f64]| -> Result<Tensor> {
        Ok(Tensor::from_vec(w.to_vec(), w.len(), &trace.device())?.to_dtype(trace.dtype())?)
    };
    let clipped = weights(coefficients)?;
    let unclipped = weights(&vec![1.0; coefficients.len()])?;
    trace
        .params()
        .into_iter()
        .map(|p| {
            let mut acc: Option<Tensor> = None;
            for (k, &j) in p.sites.iter().enumerate() {
                let head = p.sites.len() > 1 && k + 1 == p.sites.len();
                let w = if head { &unclipped } else { &clipped };
                let s = gram::weighted_sum(&Factored::of(&trace.sites[j])?, w)?;
                acc = Some(match acc {
                    None => s,
                    Some(a) => (a + s)?,
                });
            }
            Ok((p.param, acc.expect("a parameter has at least one site")))
        })
        .collect()
}
