//! Auditing a clipper outside Rust from its trace file: the truth from the trace itself (the
//! reference's brute-force materialization in f64), the claimed norms from the file.

use super::{worst_case, ClipperAudit};
use crate::error::Result;
use crate::judge::{Claim, Judge, Precision};
use ghost_oracle_reference::{self as reference, Dtype};
use std::path::Path;

/// The precision of a stored safetensors dtype.
pub fn precision_of_stored(d: Dtype) -> Precision {
    match d {
        Dtype::F64 => Precision::F64,
        Dtype::F16 => Precision::F16,
        Dtype::BF16 => Precision::BF16,
        _ => Precision::F32,
    }
}

/// Audits the norms claimed in a trace file. `precision` overrides the unit roundoff the bound
/// assumes (default: the precision the factors are stored in).
/// Returns the audit and the unit-roundoff dtype the bound assumed.
pub fn check_trace(
    path: &Path,
    precision: Option<Precision>,
    noise_multiplier: Option<f64>,
) -> Result<(ClipperAudit, Precision)> {
    let (trace, meta) = reference::read_trace(path)?;
    let judge = Judge::from_trace(trace).map_err(|e| e.context(path.display()))?;
    let c = meta.max_grad_norm;
    // A trace without coefficients is clipped the standard way by whoever reads it.
    let coefficients = match &meta.claimed_coefficients {
        Some(cs) => cs.clone(),
        None => meta
            .claimed_norms
            .iter()
            .map(|&n| if n > c { c / n } else { 1.0 })
            .collect(),
    };
    let claim = Claim {
        norms: meta.claimed_norms.clone(),
        coefficients,
        clipped_sum: None,
    };
    // Judged at the coarser of the stored and the computed precision: factors of an f32 model
    // stored as f64 are still only f32-accurate.
    let stored = precision_of_stored(meta.dtype);
    let precision = precision.unwrap_or(match meta.compute_dtype {
        Some(d) => stored.coarser(precision_of_stored(d)),
        None => stored,
    });
    let sigma = noise_multiplier.or(meta.noise_multiplier).unwrap_or(1.0);
    let case = path
        .file_name()
        .map_or("trace".into(), |n| n.to_string_lossy().into_owned());
    let metrics = judge.evaluate(&case, &claim, c, sigma, precision)?;
    let cases = vec![metrics];
    let worst = worst_case(&cases);
    let audit = ClipperAudit {
        name: meta.clipper.clone().unwrap_or_else(|| "claimed".into()),
        verdict: cases[worst].verdict,
        worst_case: worst,
        cases,
        warnings: Vec::new(),
        privacy: None,
    };
    Ok((audit, precision))
}
