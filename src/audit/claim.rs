//! What a clipper claims on a case, in the form the judge reads: its norms, coefficients and
//! clipped sum, and, when the step is judged, the update of its own DP-SGD step.

use super::AuditOptions;
use crate::clippers::{Clipped, Clipper, NoiseSpec};
use crate::error::Result;
use crate::judge::{Claim, ClippingRule};
use crate::options::ClipNorm;
use crate::trace::Trace;
use candle_core::{DType, Tensor};
use ghost_oracle_reference::{Clipping, Floats, StepClaim};

/// Tensors per parameter as the judge reads them: row-major values on the host, f64 kept f64 and
/// every other dtype as f32 (exact for bf16 and f16), so a 1 B-parameter f32 sum stays 4.9 GB;
/// each tensor is dropped as soon as it is copied.
pub fn values_of(tensors: Vec<(String, Tensor)>) -> Result<Vec<(String, Floats)>> {
    tensors
        .into_iter()
        .map(|(p, t)| {
            let t = t.flatten_all()?;
            let values = match t.dtype() {
                DType::F64 => Floats::from(t.to_vec1::<f64>()?),
                _ => Floats::from(t.to_dtype(DType::F32)?.to_vec1::<f32>()?),
            };
            Ok((p, values))
        })
        .collect()
}

/// A clipper's output as the judge reads it: f64 values, no tensors. Each clipped-sum tensor
/// is dropped as soon as it is converted, so a large model's sum is never held twice.
pub fn claim_of(clipped: Clipped) -> Result<Claim> {
    let Clipped {
        report,
        coefficients,
        clipped_sum,
    } = clipped;
    let clipped_sum = values_of(clipped_sum)?;
    Ok(Claim {
        norms: report.norms,
        coefficients,
        clipped_sum: Some(clipped_sum),
        clipping: ClippingRule::default(),
    })
}

/// The divisor the audit's step states: a Poisson-sampled batch's expected size, which DP-SGD
/// divides by whatever size was drawn. The audit's batches are taken as draws one below their
/// expectation, as half of all draws are below it, so that a step dividing by the size it drew
/// differs from one dividing by the stated size.
pub fn expected_batch_size(drawn: usize) -> f64 {
    drawn as f64 + 1.0
}

/// What a clipper produced on a trace at one C.
pub(super) struct Produced {
    pub clipped: Clipped,
    /// Its step's update, when the step is judged.
    pub update: Option<Vec<(String, Tensor)>>,
    /// The divisor its step was told.
    pub divisor: f64,
}

/// The clipper's clip of `trace` at `c`, or, when the step is judged, its own DP-SGD step: its
/// clipped sum, seeded noise N(0, σ²C²) and the division by the stated divisor, judged as a
/// library's step is.
pub(super) fn produce(
    clipper: &dyn Clipper,
    trace: &Trace,
    c: ClipNorm,
    opts: &AuditOptions,
    noise_seed: u64,
) -> Result<Produced> {
    let divisor = expected_batch_size(trace.batch_size());
    let (clipped, update) = if opts.judge_step {
        let noise = NoiseSpec {
            std: opts.noise_multiplier.get() * c.get(),
            divisor,
            seed: noise_seed,
        };
        let s = clipper.step(trace, c, &noise)?;
        (s.clipped, Some(s.update))
    } else {
        (clipper.clip(trace, c)?, None)
    };
    Ok(Produced {
        clipped,
        update,
        divisor,
    })
}

/// The step the audit judges: the clipped sum (when it moved here from the claim), the update
/// and the divisor, under flat clipping without a stabilizer.
pub(super) fn step_claim(
    clipped_sum: Option<Vec<(String, Floats)>>,
    update: Vec<(String, Tensor)>,
    divisor: f64,
) -> Result<StepClaim> {
    Ok(StepClaim {
        clipped_sum,
        update: Some(values_of(update)?),
        batch_divisor: Some(divisor),
        clip_stabilizer: 0.0,
        clipping: Clipping::Flat,
    })
}
