//! Auditing a clipper outside Rust from its trace file: the truth from the trace itself (the
//! reference's brute-force materialization in f64), the claimed norms from the file.

use crate::audit::{worst_case, ClipperAudit};
use crate::clipper::{clip_coefficients, Clipped, NormReport};
use crate::error::{Error, Result};
use crate::metrics::{evaluate, unit_roundoff, Truth};
use crate::trace::Trace;
use candle_core::{DType, Device, Tensor};
use ghost_oracle_reference::{self as reference, Dtype, Trace as RefTrace, TraceMeta};
use ndarray::{Array2, Array3};
use std::path::Path;

/// The precision a trace's factors were stored in, as a candle dtype.
pub fn stored_dtype(d: Dtype) -> DType {
    match d {
        Dtype::F64 => DType::F64,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        _ => DType::F32,
    }
}

/// Audits the norms claimed in a trace file. `precision` overrides the unit roundoff the bound
/// assumes (default: the precision the factors are stored in).
/// Returns the audit and the unit-roundoff dtype the bound assumed.
pub fn check_trace(
    path: &Path,
    precision: Option<DType>,
    noise_multiplier: Option<f64>,
) -> Result<(ClipperAudit, DType)> {
    let (trace, meta) = reference::read_trace(path)?;
    let truth = Truth::from_trace(&trace).map_err(|e| e.context(path.display()))?;
    let c = meta.max_grad_norm;
    let coefficients = match &meta.claimed_coefficients {
        Some(cs) => cs.clone(),
        None => clip_coefficients(&meta.claimed_norms, c),
    };
    let clipped = Clipped {
        report: NormReport {
            norms: meta.claimed_norms.clone(),
            ..Default::default()
        },
        coefficients,
        clipped_sum: Vec::new(),
    };
    let precision = precision.unwrap_or(stored_dtype(meta.dtype));
    let u = unit_roundoff(precision);
    let sigma = noise_multiplier.or(meta.noise_multiplier).unwrap_or(1.0);
    let case = path
        .file_name()
        .map_or("trace".into(), |n| n.to_string_lossy().into_owned());
    let metrics = evaluate(&case, &truth, &clipped, c, sigma, u)?;
    let cases = vec![metrics];
    let worst = worst_case(&cases);
    let audit = ClipperAudit {
        name: meta.clipper.clone().unwrap_or_else(|| "claimed".into()),
        verdict: cases[worst].verdict,
        worst_case: worst,
        cases,
        warnings: Vec::new(),
    };
    Ok((audit, precision))
}

fn to_array3(t: &Tensor) -> Result<Array3<f64>> {
    let (b, tt, m) = t.dims3()?;
    let v: Vec<f64> = t.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
    Array3::from_shape_vec((b, tt, m), v).map_err(|e| Error::internal(e.to_string()))
}

impl Trace {
    /// The trace as f64 arrays (for writing, or for the reference's brute force).
    pub fn to_reference(&self) -> Result<RefTrace> {
        let sites = self
            .sites
            .iter()
            .map(|s| {
                let ids = match &s.ids {
                    Some(ids) => {
                        let (b, t) = ids.dims2()?;
                        let v: Vec<u32> = ids.to_device(&Device::Cpu)?.flatten_all()?.to_vec1()?;
                        Some(
                            Array2::from_shape_vec((b, t), v.into_iter().map(i64::from).collect())
                                .map_err(|e| Error::internal(e.to_string()))?,
                        )
                    }
                    None => None,
                };
                Ok(reference::Site {
                    spec: s.spec.clone(),
                    activations: s.activations.as_ref().map(to_array3).transpose()?,
                    ids,
                    backprops: to_array3(&s.backprops)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(RefTrace { sites })
    }
}

/// Writes a trace with a clipper's norms as the claim (factors in the trace's own dtype).
pub fn write_claimed_trace(
    path: &Path,
    trace: &Trace,
    clipper: &str,
    norms: &[f64],
    coefficients: &[f64],
    max_grad_norm: f64,
) -> Result<()> {
    let dtype = match trace.dtype() {
        DType::F64 => Dtype::F64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        _ => Dtype::F32,
    };
    let meta = TraceMeta {
        max_grad_norm,
        noise_multiplier: None,
        clipper: Some(clipper.to_string()),
        claimed_norms: norms.to_vec(),
        claimed_coefficients: Some(coefficients.to_vec()),
        dtype,
    };
    Ok(reference::write_trace(path, &trace.to_reference()?, &meta)?)
}
