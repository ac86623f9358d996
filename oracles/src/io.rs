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
    let mut bytes = safetensors::serialize(data, metadata)
        .map_err(|e| Error::new(format!("cannot serialize {}: {e}", path.display())))?;
    sort_header(&mut bytes, path)?;
    write_whole(path, &bytes)
}

/// Rewrites a serialized file's JSON header with its keys sorted, in place: safetensors writes
/// `__metadata__` in a `HashMap`'s per-process order, so the same tensors would give other
/// bytes on every run. The sorted header holds the same keys and values, so it has the same
/// length and every tensor's offsets stay valid.
fn sort_header(bytes: &mut [u8], path: &Path) -> Result<()> {
    let bad = || {
        Error::new(format!(
            "cannot serialize {}: malformed header",
            path.display()
        ))
    };
    let n = u64::from_le_bytes(
        bytes
            .get(..8)
            .ok_or_else(bad)?
            .try_into()
            .map_err(|_| bad())?,
    ) as usize;
    let header = bytes.get(8..8 + n).ok_or_else(bad)?;
    let value: std::collections::BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(header.trim_ascii_end()).map_err(|_| bad())?;
    let sorted = serde_json::to_vec(&value).map_err(|_| bad())?;
    if sorted.len() > n {
        return Err(bad());
    }
    bytes[8..8 + sorted.len()].copy_from_slice(&sorted);
    bytes[8 + sorted.len()..8 + n].fill(b' ');
    Ok(())
}

/// Writes `bytes` to a temporary file beside `path` and renames it into place, so that a
/// failure half-way leaves nothing at `path` (or the old file intact) and no temporary file.
fn write_whole(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let written = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path));
    written.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::new(format!("cannot write {}: {e}", path.display()))
    })
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

#[cfg(test)]
mod tests {
    use super::{write_raw, RawTensor};
    use safetensors::tensor::Dtype;
    use std::collections::HashMap;

    fn tensors() -> Vec<(String, RawTensor)> {
        ["b", "a", "c"]
            .iter()
            .enumerate()
            .map(|(k, n)| {
                let bytes = (k as f32).to_le_bytes().to_vec();
                let t = RawTensor {
                    dtype: Dtype::F32,
                    shape: vec![1],
                    bytes,
                };
                (n.to_string(), t)
            })
            .collect()
    }

    fn metadata() -> HashMap<String, String> {
        (0..12)
            .map(|k| (format!("key{k}"), format!("value{k}")))
            .collect()
    }

    /// Two writes of the same tensors give the same bytes (each `HashMap` has its own random
    /// order), the header's metadata keys come out sorted, and the file reads back whole.
    #[test]
    fn written_files_are_a_function_of_their_contents() {
        let dir = std::env::temp_dir().join(format!("oracle-io-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (p, q) = (dir.join("one.safetensors"), dir.join("two.safetensors"));
        write_raw(&p, &tensors(), Some(metadata())).unwrap();
        write_raw(&q, &tensors(), Some(metadata())).unwrap();
        let (a, b) = (std::fs::read(&p).unwrap(), std::fs::read(&q).unwrap());
        assert_eq!(a, b);
        let (_, meta) = safetensors::SafeTensors::read_metadata(&a).unwrap();
        assert_eq!(meta.metadata().as_ref().unwrap(), &metadata());
        let header = String::from_utf8_lossy(&a[8..]);
        let at = |k: &str| header.find(&format!("\"{k}\"")).unwrap();
        assert!(at("key0") < at("key1") && at("key1") < at("key10") && at("key10") < at("key2"));
        let file = safetensors::SafeTensors::deserialize(&a).unwrap();
        assert_eq!(file.tensor("c").unwrap().data(), 2f32.to_le_bytes());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A write that cannot complete leaves neither the target nor a temporary file behind.
    #[test]
    fn a_failed_write_leaves_nothing() {
        let dir = std::env::temp_dir().join(format!("oracle-io-missing-{}", std::process::id()));
        let target = dir.join("out.safetensors");
        let err = write_raw(&target, &tensors(), None).unwrap_err();
        assert!(err.to_string().contains("out.safetensors"), "{err}");
        assert!(!dir.exists());
    }
}
