//! Seeded bugs: clippers that reproduce failure modes found in real DP libraries
//! (docs/detection.md). The oracle is worth its power to catch every one of them.

use crate::clippers::gram::{self, Factor, Factored};
use crate::clippers::{
    clip_coefficients, finish, noisy_update_by, Clipped, Clipper, CrossTerm, NoiseOrder, NoiseSpec,
    NormReport, Stepped, TiedGhostClipper,
};
use crate::error::{Error, Result};
use crate::options::ClipNorm;
use crate::trace::{Precision, Site, SiteKind, Trace};
use candle_core::{DType, Tensor};

/// What the audit must say about a mutant wherever it catches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpectedVerdict {
    /// Under-estimates norms: a privacy violation wherever an affected example is clipped.
    PrivacyViolation,
    /// Over-estimates only (safe): never a privacy violation, a utility distortion somewhere.
    NeverPrivacyViolation,
    /// Either direction depending on the data: flagged somewhere.
    Flagged,
}

/// What a seeded bug corrupts, and so what an audit has to judge to see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Corrupts {
    /// The per-example norms or coefficients: seen by every audit.
    Norms,
    /// The clipped sum, the divisor or the loss the step is of: seen when the step is judged.
    Step,
    /// Only the noise: seen when the step is judged under noise (σ > 0).
    Noise,
}

/// The seeded bugs, from one table: variant, name, the verdict the audit owes it, the coarsest
/// precision at which the bug is still a bug, what it corrupts, and the library behaviour it
/// reproduces. `ALL`, `name`, `parse`, `expected`, `visible_at`, `corrupts` and `reproduces`
/// are generated from it, so no list is kept in sync by hand and no mutant lacks an
/// expectation.
macro_rules! mutants {
    ($($variant:ident, $name:literal, $expected:ident, $coarsest:ident, $corrupts:ident, $reproduces:literal;)+) => {
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Mutant {
            $($variant,)+
        }

        impl Mutant {
            pub const ALL: &'static [Mutant] = &[$(Mutant::$variant,)+];

            pub fn name(self) -> &'static str {
                match self {
                    $(Mutant::$variant => $name,)+
                }
            }

            /// The library behaviour the mutant reproduces.
            pub fn reproduces(self) -> &'static str {
                match self {
                    $(Mutant::$variant => $reproduces,)+
                }
            }

            pub fn expected(self) -> ExpectedVerdict {
                match self {
                    $(Mutant::$variant => ExpectedVerdict::$expected,)+
                }
            }

            /// Whether the bug is a bug for a clipper computing in `precision`: a Gram taken in
            /// bf16 is exactly what a bf16 clipper does.
            pub fn visible_at(self, precision: Precision) -> bool {
                match self {
                    $(Mutant::$variant => precision <= Precision::$coarsest,)+
                }
            }

            /// What the bug corrupts: an audit that judges less cannot see it.
            pub fn corrupts(self) -> Corrupts {
                match self {
                    $(Mutant::$variant => Corrupts::$corrupts,)+
                }
            }

            pub fn parse(name: &str) -> Option<Self> {
                Mutant::ALL.iter().copied().find(|m| m.name() == name)
            }
        }
    };
}

// The two Gram mutants are bugs only for a clipper that claims more precision than they keep:
// at bf16 both are what a correct clipper does, and at f16 a bf16 Gram's extra rounding stays
// inside the f16 bound on the built-in suite (the kill matrix at f16 shows it), so neither is
// claimed visible there.
mutants! {
    DropCross, "drop-cross", Flagged, BF16, Norms,
        "tied sites summed as if disjoint (Opacus FSDP ghost class; JAX custom_vjp stacks)";
    LastWriter, "last-writer", Flagged, BF16, Norms,
        "per-sample norm overwritten by the last site computed in backward: embedding only (fastDP)";
    FirstWriter, "first-writer", Flagged, BF16, Norms,
        "only the first site computed in backward kept: LM head only";
    CauchySchwarz, "cauchy-schwarz", NeverPrivacyViolation, BF16, Norms,
        "sqrt(k·Σ‖G_j‖²) for a layer used k times (TF Privacy): safe, over-clips";
    NoRepeatMerge, "no-repeat-merge", Flagged, BF16, Norms,
        "embedding norm Σ_t‖e_t‖², ignoring repeated tokens";
    BiasFrobenius, "bias-frobenius", Flagged, BF16, Norms,
        "bias norm² as ‖ΔΔᵀ‖_F instead of Σ(ΔΔᵀ) (Opacus before PR 751)";
    SequenceCollapse, "sequence-collapse", Flagged, BF16, Norms,
        "non-sequence formula ‖Σ_t δ_t‖·‖Σ_t a_t‖ applied to sequences";
    BatchMeanLoss, "batch-mean-loss", PrivacyViolation, BF16, Norms,
        "norms of the batch-mean loss: 1/B too small";
    F16Gram, "f16-gram", Flagged, F32, Norms,
        "Gram matrices accumulated in f16";
    Bf16Gram, "bf16-gram", Flagged, F32, Norms,
        "Gram matrices accumulated in bf16";
    FlippedCross, "flipped-cross", Flagged, BF16, Norms,
        "cross term with the wrong sign";
    TiedNoisePerUse, "tied-noise-per-use", NeverPrivacyViolation, BF16, Noise,
        "noise added once per use of a shared weight: twice the variance on a tied embedding";
    NoTiedNoise, "no-tied-noise", PrivacyViolation, BF16, Noise,
        "no noise on the tied weight (FlashDP's GPT-2 example trains the tied head without it)";
    TiedHeadUnclipped, "tied-head-unclipped", Flagged, BF16, Step,
        "the tied head's output path summed unclipped (FlashDP's GPT-2 example)";
    DefaultClipNorm, "default-clip-norm", Flagged, BF16, Norms,
        "clipping at a default C = 1 while the noise uses the stated C (Opacus #664; fastDP's undefined C)";
    ActualBatchDivisor, "actual-batch-divisor", NeverPrivacyViolation, BF16, Step,
        "update divided by the batch's actual size, not the stated expected size (Opacus #571, #819)";
    MicrobatchOverwrite, "microbatch-overwrite", NeverPrivacyViolation, BF16, Step,
        "the second micro-batch's clipped sum overwrites the first's (Opacus ghost mode's two backwards; #707)";
    NoiseAfterDivision, "noise-after-division", NeverPrivacyViolation, BF16, Noise,
        "noise N(0, σ²C²) added after the division by the batch size";
    IgnoredTokenMean, "ignored-token-mean", Flagged, BF16, Norms,
        "each example's loss averaged over all T positions, ignored ones included (Opacus #792)";
}

/// How many draws of noise a parameter gets, by name.
type Draws<'a> = &'a dyn Fn(&str) -> usize;

/// A clipped sum per parameter from the coefficients.
type SumOf<'a> = &'a dyn Fn(&[f64]) -> Result<Vec<(String, Tensor)>>;

/// A clipper with one seeded bug; otherwise exact tied ghost clipping.
#[derive(Clone, Copy, Debug)]
pub struct MutantClipper(pub Mutant);

fn per_example(t: &Tensor) -> Result<Vec<f64>> {
    crate::trace::to_f64_vec(t)
}

fn dense(f: &Factor) -> Option<&Tensor> {
    match f {
        Factor::Dense(t) => Some(t),
        Factor::OneHot { .. } | Factor::Ones { .. } => None,
    }
}

fn to_half(f: &Factored, half: DType) -> Result<Factored> {
    let conv = |x: &Factor| -> Result<Factor> {
        Ok(match x {
            Factor::Dense(t) => Factor::Dense(t.to_dtype(half)?),
            other => other.clone(),
        })
    };
    Ok(Factored {
        left: conv(&f.left)?,
        right: conv(&f.right)?,
    })
}

impl MutantClipper {
    /// The dtype this mutant's Gram products are accumulated in.
    fn gram_dtype(&self, dtype: DType) -> DType {
        match self.0 {
            Mutant::F16Gram => DType::F16,
            Mutant::Bf16Gram => DType::BF16,
            Mutant::DropCross
            | Mutant::LastWriter
            | Mutant::FirstWriter
            | Mutant::CauchySchwarz
            | Mutant::NoRepeatMerge
            | Mutant::BiasFrobenius
            | Mutant::SequenceCollapse
            | Mutant::BatchMeanLoss
            | Mutant::FlippedCross
            | Mutant::TiedNoisePerUse
            | Mutant::NoTiedNoise
            | Mutant::TiedHeadUnclipped
            | Mutant::DefaultClipNorm
            | Mutant::ActualBatchDivisor
            | Mutant::MicrobatchOverwrite
            | Mutant::NoiseAfterDivision
            | Mutant::IgnoredTokenMean => dtype,
        }
    }

    fn inner(&self, a: &Factored, b: &Factored, dtype: DType) -> Result<Vec<f64>> {
        let gram_dtype = self.gram_dtype(dtype);
        if gram_dtype == dtype {
            gram::inner(a, b, dtype)
        } else {
            gram::inner(
                &to_half(a, gram_dtype)?,
                &to_half(b, gram_dtype)?,
                gram_dtype,
            )
        }
    }

    fn own(&self, kind: SiteKind, f: &Factored, dtype: DType) -> Result<Vec<f64>> {
        match self.0 {
            Mutant::NoRepeatMerge if kind == SiteKind::Embedding => {
                let r = dense(&f.right).expect("embedding right factor is dense");
                per_example(&r.sqr()?.sum((1, 2))?)
            }
            Mutant::BiasFrobenius if kind == SiteKind::Bias => {
                let g = gram::gram(&f.left, &f.left, dtype)?;
                per_example(&g.sqr()?.sum((1, 2))?.sqrt()?)
            }
            Mutant::SequenceCollapse if matches!(kind, SiteKind::Linear | SiteKind::Conv1d) => {
                let (l, r) = (
                    dense(&f.left).expect("dense"),
                    dense(&f.right).expect("dense"),
                );
                let ls = l.sum(1)?.sqr()?.sum(1)?;
                let rs = r.sum(1)?.sqr()?.sum(1)?;
                per_example(&(ls * rs)?)
            }
            // Every other site of those three, and every site of the rest: the exact own norm.
            Mutant::NoRepeatMerge
            | Mutant::BiasFrobenius
            | Mutant::SequenceCollapse
            | Mutant::DropCross
            | Mutant::LastWriter
            | Mutant::FirstWriter
            | Mutant::CauchySchwarz
            | Mutant::BatchMeanLoss
            | Mutant::F16Gram
            | Mutant::Bf16Gram
            | Mutant::FlippedCross
            | Mutant::TiedNoisePerUse
            | Mutant::NoTiedNoise
            | Mutant::TiedHeadUnclipped
            | Mutant::DefaultClipNorm
            | Mutant::ActualBatchDivisor
            | Mutant::MicrobatchOverwrite
            | Mutant::NoiseAfterDivision
            | Mutant::IgnoredTokenMean => self.inner(f, f, dtype),
        }
    }
}

impl Clipper for MutantClipper {
    fn name(&self) -> String {
        format!("mutant:{}", self.0.name())
    }

    fn norms(&self, trace: &Trace) -> Result<NormReport> {
        let dtype = trace.dtype();
        let factored: Vec<Factored> = trace
            .sites
            .iter()
            .map(Factored::of)
            .collect::<Result<_>>()?;
        let mut site_sq = trace
            .sites
            .iter()
            .zip(&factored)
            .map(|(s, f)| self.own(s.spec.kind, f, dtype))
            .collect::<Result<Vec<_>>>()?;
        let mut cross = Vec::new();
        for p in trace.params().into_iter().filter(|p| p.sites.len() > 1) {
            match self.0 {
                Mutant::DropCross => {}
                // Forward order is the reverse of backward: the embedding is the last writer.
                Mutant::LastWriter | Mutant::FirstWriter => {
                    let keep = if self.0 == Mutant::LastWriter {
                        p.sites[0]
                    } else {
                        *p.sites.last().unwrap()
                    };
                    for &j in p.sites.iter().filter(|&&j| j != keep) {
                        site_sq[j].iter_mut().for_each(|v| *v = 0.0);
                    }
                }
                Mutant::CauchySchwarz => {
                    let k = p.sites.len() as f64;
                    for &j in &p.sites {
                        site_sq[j].iter_mut().for_each(|v| *v *= k);
                    }
                }
                Mutant::NoRepeatMerge
                | Mutant::BiasFrobenius
                | Mutant::SequenceCollapse
                | Mutant::BatchMeanLoss
                | Mutant::F16Gram
                | Mutant::Bf16Gram
                | Mutant::FlippedCross
                | Mutant::TiedNoisePerUse
                | Mutant::NoTiedNoise
                | Mutant::TiedHeadUnclipped
                | Mutant::DefaultClipNorm
                | Mutant::ActualBatchDivisor
                | Mutant::MicrobatchOverwrite
                | Mutant::NoiseAfterDivision
                | Mutant::IgnoredTokenMean => {
                    for (a, &j) in p.sites.iter().enumerate() {
                        for &k in &p.sites[a + 1..] {
                            let mut values = self.inner(&factored[j], &factored[k], dtype)?;
                            if self.0 == Mutant::FlippedCross {
                                values.iter_mut().for_each(|v| *v = -*v);
                            }
                            cross.push(CrossTerm {
                                param: p.param.clone(),
                                sites: (j, k),
                                values,
                            });
                        }
                    }
                }
            }
        }
        let mut report = finish(site_sq, cross, trace.batch_size(), Vec::new());
        if self.0 == Mutant::BatchMeanLoss {
            let b = trace.batch_size() as f64;
            report.norms.iter_mut().for_each(|n| *n /= b);
        }
        Ok(report)
    }

    fn clip(&self, trace: &Trace, max_grad_norm: ClipNorm) -> Result<Clipped> {
        // This mutant's norms and coefficients, with the sum `sum` forms from the coefficients.
        let with_sum = |sum: SumOf<'_>| {
            let report = self.norms(trace)?;
            let coefficients = clip_coefficients(&report.norms, max_grad_norm);
            let clipped_sum = sum(&coefficients)?;
            Ok(Clipped {
                report,
                coefficients,
                clipped_sum,
            })
        };
        match self.0 {
            // Norms and sum of another loss: the per-example mean over all T positions.
            Mutant::IgnoredTokenMean => {
                TiedGhostClipper.clip(&mean_over_all_positions(trace)?, max_grad_norm)
            }
            Mutant::TiedHeadUnclipped => with_sum(&|c| head_path_unclipped(trace, c)),
            Mutant::DefaultClipNorm => {
                let one = ClipNorm::new(1.0).expect("1 is a valid clipping norm");
                TiedGhostClipper.clip(trace, one)
            }
            // Two micro-batches, the first half and the rest; only the last one's sum is kept.
            Mutant::MicrobatchOverwrite => with_sum(&|c| {
                let mut kept = c.to_vec();
                kept[..trace.batch_size() / 2].fill(0.0);
                crate::clippers::clipped_sum(trace, &kept)
            }),
            Mutant::DropCross
            | Mutant::LastWriter
            | Mutant::FirstWriter
            | Mutant::CauchySchwarz
            | Mutant::NoRepeatMerge
            | Mutant::BiasFrobenius
            | Mutant::SequenceCollapse
            | Mutant::BatchMeanLoss
            | Mutant::F16Gram
            | Mutant::Bf16Gram
            | Mutant::FlippedCross
            | Mutant::TiedNoisePerUse
            | Mutant::NoTiedNoise
            | Mutant::ActualBatchDivisor
            | Mutant::NoiseAfterDivision => with_sum(&|c| crate::clippers::clipped_sum(trace, c)),
        }
    }

    fn step(&self, trace: &Trace, max_grad_norm: ClipNorm, noise: &NoiseSpec) -> Result<Stepped> {
        let clipped = self.clip(trace, max_grad_norm)?;
        let params = trace.params();
        let uses = |param: &str| {
            params
                .iter()
                .find(|p| p.param == param)
                .map_or(1, |p| p.sites.len())
        };
        let once = |_: &str| 1;
        let (draws, order, divisor): (Draws<'_>, NoiseOrder, f64) = match self.0 {
            Mutant::TiedNoisePerUse => (&uses, NoiseOrder::BeforeDivision, noise.divisor),
            Mutant::NoTiedNoise => (
                &|p: &str| usize::from(uses(p) == 1),
                NoiseOrder::BeforeDivision,
                noise.divisor,
            ),
            Mutant::NoiseAfterDivision => (&once, NoiseOrder::AfterDivision, noise.divisor),
            Mutant::ActualBatchDivisor => {
                (&once, NoiseOrder::BeforeDivision, trace.batch_size() as f64)
            }
            Mutant::DropCross
            | Mutant::LastWriter
            | Mutant::FirstWriter
            | Mutant::CauchySchwarz
            | Mutant::NoRepeatMerge
            | Mutant::BiasFrobenius
            | Mutant::SequenceCollapse
            | Mutant::BatchMeanLoss
            | Mutant::F16Gram
            | Mutant::Bf16Gram
            | Mutant::FlippedCross
            | Mutant::TiedHeadUnclipped
            | Mutant::DefaultClipNorm
            | Mutant::MicrobatchOverwrite
            | Mutant::IgnoredTokenMean => (&once, NoiseOrder::BeforeDivision, noise.divisor),
        };
        let update = noisy_update_by(
            &clipped.clipped_sum,
            &NoiseSpec { divisor, ..*noise },
            draws,
            order,
        )?;
        Ok(Stepped { clipped, update })
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

/// The trace of each example's loss averaged over all T positions instead of its v_i labelled
/// ones: every backprop scaled by v_i / T. The LM head (the last site) has a zero backprop row
/// exactly where a position's label is ignored, which is how v_i is read.
fn mean_over_all_positions(trace: &Trace) -> Result<Trace> {
    let head = trace
        .sites
        .last()
        .ok_or_else(|| Error::input("the trace has no site"))?;
    let (b, t) = (head.backprops.dims()[0], head.backprops.dims()[1]);
    let rows = head
        .backprops
        .to_dtype(DType::F64)?
        .abs()?
        .max(2)?
        .to_vec2::<f64>()?;
    let scale: Vec<f64> = rows
        .iter()
        .map(|r| r.iter().filter(|&&x| x != 0.0).count() as f64 / t as f64)
        .collect();
    let scale = Tensor::from_vec(scale, (b, 1, 1), &trace.device())?.to_dtype(trace.dtype())?;
    let sites = trace
        .sites
        .iter()
        .map(|s| {
            Ok(Site {
                backprops: s.backprops.broadcast_mul(&scale)?,
                ..s.clone()
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Trace { sites })
}
