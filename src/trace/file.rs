//! A candle trace to and from the f64 arrays of the trace file (docs/trace-format.md).

use super::Trace;
use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};
use ghost_oracle_reference::{self as reference, Trace as RefTrace, TraceMeta};
use ndarray::{Array2, Array3};
use std::path::Path;

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
                    conv: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(RefTrace { sites })
    }
}

/// Writes a trace with a clipper's norms as the claim (factors in the trace's own dtype), whole
/// or not at all, its bytes a function of the trace alone (the header's keys sorted).
pub fn write_claimed_trace(
    path: &Path,
    trace: &Trace,
    clipper: &str,
    norms: &[f64],
    coefficients: &[f64],
    max_grad_norm: f64,
) -> Result<()> {
    let dtype = trace.precision()?;
    let meta = TraceMeta {
        clipper: Some(clipper.to_string()),
        claimed_coefficients: Some(coefficients.to_vec()),
        compute_dtype: Some(dtype),
        ..TraceMeta::norms(max_grad_norm, norms.to_vec(), dtype)
    };
    let trace = trace.to_reference()?;
    crate::atomic::write_atomically(path, "trace", |tmp| {
        reference::write_trace(tmp, &trace, &meta)?;
        crate::atomic::sort_safetensors_header(tmp)
    })
}
