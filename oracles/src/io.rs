//! Writing safetensors files (checkpoints, batches, traces) from f64 and i64 arrays.

use crate::error::{Error, Result};
use crate::precision::Precision;
use ndarray::ArrayViewD;
use safetensors::tensor::{Dtype, View};
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

/// One tensor ready to be written: raw little-endian bytes with dtype and shape.
pub struct RawTensor {
    /// The dtype the bytes hold.
    pub dtype: Dtype,
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Row-major little-endian elements.
    pub bytes: Vec<u8>,
}

impl View for &RawTensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

impl RawTensor {
    /// Converts an f64 array to `precision` (rounded to nearest).
    pub fn from_f64(a: &ArrayViewD<f64>, precision: Precision) -> Self {
        let mut bytes = Vec::new();
        for &v in a.iter() {
            match precision {
                Precision::F64 => bytes.extend_from_slice(&v.to_le_bytes()),
                Precision::F32 => bytes.extend_from_slice(&(v as f32).to_le_bytes()),
                Precision::F16 => bytes.extend_from_slice(&half::f16::from_f64(v).to_le_bytes()),
                Precision::BF16 => bytes.extend_from_slice(&half::bf16::from_f64(v).to_le_bytes()),
            }
        }
        RawTensor {
            dtype: precision.stored(),
            shape: a.shape().to_vec(),
            bytes,
        }
    }

    /// An int64 tensor (token ids, labels).
    pub fn from_i64(a: &ArrayViewD<i64>) -> Self {
        let bytes = a.iter().flat_map(|v| v.to_le_bytes()).collect();
        RawTensor {
            dtype: Dtype::I64,
            shape: a.shape().to_vec(),
            bytes,
        }
    }
}

/// Writes `tensors` as one safetensors file, with optional `__metadata__`.
pub fn write_raw(
    path: &Path,
    tensors: &[(String, RawTensor)],
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let data = tensors.iter().map(|(n, t)| (n.clone(), t));
    let bytes = safetensors::serialize(data, metadata)
        .map_err(|e| Error::new(format!("cannot serialize {}: {e}", path.display())))?;
    std::fs::write(path, bytes)
        .map_err(|e| Error::new(format!("cannot write {}: {e}", path.display())))
}

/// The precision of a written checkpoint: f32 (what `save_pretrained` writes) or f64.
pub(crate) fn weight_precision(f32_weights: bool) -> Precision {
    if f32_weights {
        Precision::F32
    } else {
        Precision::F64
    }
}

/// Writes f64 arrays as a safetensors file, rounded to f32 when `f32_weights`.
pub fn write_f64_tensors(
    path: &Path,
    tensors: &[(String, ArrayViewD<f64>)],
    f32_weights: bool,
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let dtype = weight_precision(f32_weights);
    let raw: Vec<(String, RawTensor)> = tensors
        .iter()
        .map(|(n, t)| (n.clone(), RawTensor::from_f64(t, dtype)))
        .collect();
    write_raw(path, &raw, metadata)
}
