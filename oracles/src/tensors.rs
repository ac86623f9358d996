//! Reading safetensors files into f64 / i64 arrays. The whole file is read (its size is what the
//! disk says, not what a header claims) and the `safetensors` crate checks every offset against
//! that length before a single tensor is touched.

use crate::error::{bail, Error, Result};
use ndarray::{ArrayD, IxDyn};
use safetensors::{Dtype, SafeTensors};
use std::path::Path;

/// Refuse files larger than this before reading them (the largest GPT-2 is about 6.5 GB in f32).
pub(crate) const MAX_FILE_BYTES: u64 = 64 << 30;

pub(crate) fn read_bytes(path: &Path, what: &str) -> Result<Vec<u8>> {
    let meta = std::fs::metadata(path)
        .map_err(|e| Error::new(format!("cannot open {what} {}: {e}", path.display())))?;
    if !meta.is_file() {
        bail!("{what} {} is not a file", path.display());
    }
    if meta.len() > MAX_FILE_BYTES {
        bail!(
            "{what} {} is {} bytes; at most {MAX_FILE_BYTES} are accepted",
            path.display(),
            meta.len()
        );
    }
    std::fs::read(path)
        .map_err(|e| Error::new(format!("cannot read {what} {}: {e}", path.display())))
}

pub(crate) fn parse<'a>(bytes: &'a [u8], label: &str) -> Result<SafeTensors<'a>> {
    SafeTensors::deserialize(bytes).map_err(|e| {
        Error::new(format!(
            "{label} is not a valid safetensors file ({e}); a header whose offsets run past the end of the file, \
             or a truncated file, is reported this way"
        ))
    })
}

/// Any floating tensor as f64, with NaN/Inf rejected (a non-finite weight makes every norm NaN).
pub(crate) fn to_f64(st: &SafeTensors, name: &str, label: &str) -> Result<ArrayD<f64>> {
    let values = to_f64_unchecked(st, name, label)?;
    if let Some((i, v)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        bail!("{label}: tensor `{name}` holds a non-finite value ({v}) at flat index {i}");
    }
    Ok(values)
}

/// A float tensor as f64 with NaN and ±∞ kept: for values that are a verdict when non-finite
/// (a clipper's claimed norms), not an input error.
pub(crate) fn to_f64_unchecked(st: &SafeTensors, name: &str, label: &str) -> Result<ArrayD<f64>> {
    let view = st
        .tensor(name)
        .map_err(|_| Error::new(format!("{label}: tensor `{name}` is missing")))?;
    let data = view.data();
    let values: Vec<f64> = match view.dtype() {
        Dtype::F64 => data
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        other => {
            bail!("{label}: tensor `{name}` has dtype {other:?}; expected F32, F64, F16 or BF16")
        }
    };
    ArrayD::from_shape_vec(IxDyn(view.shape()), values)
        .map_err(|e| Error::new(format!("{label}: tensor `{name}`: {e}")))
}

/// An integer tensor (ids, labels) as i64; I32 is accepted too since some exporters write it.
pub(crate) fn to_i64(st: &SafeTensors, name: &str, label: &str) -> Result<ArrayD<i64>> {
    let view = st
        .tensor(name)
        .map_err(|_| Error::new(format!("{label}: tensor `{name}` is missing")))?;
    let data = view.data();
    let values: Vec<i64> = match view.dtype() {
        Dtype::I64 => data
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        Dtype::I32 => data
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64)
            .collect(),
        other => bail!("{label}: tensor `{name}` has dtype {other:?}; expected I64 (or I32)"),
    };
    ArrayD::from_shape_vec(IxDyn(view.shape()), values)
        .map_err(|e| Error::new(format!("{label}: tensor `{name}`: {e}")))
}

pub(crate) fn has(st: &SafeTensors, name: &str) -> bool {
    st.tensor(name).is_ok()
}
