//! Deviations in the loss whose per-example gradients are clipped.

use crate::error::{Error, Result};
use crate::trace::{Site, Trace};
use candle_core::{DType, Tensor};
use std::borrow::Cow;

/// The loss whose per-example gradients are clipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loss {
    /// The loss the trace is of.
    Stated,
    /// Each example's loss averaged over all T positions, ignored ones included.
    MeanOverAllPositions,
}

impl Loss {
    /// The trace of this loss, from the trace of the stated one.
    pub(super) fn trace(self, trace: &Trace) -> Result<Cow<'_, Trace>> {
        Ok(match self {
            Loss::Stated => Cow::Borrowed(trace),
            Loss::MeanOverAllPositions => Cow::Owned(mean_over_all_positions(trace)?),
        })
    }
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
