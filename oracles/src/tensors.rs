//! Reading safetensors files into f64 / i64 arrays. A batch is read whole, a trace or a
//! checkpoint is memory-mapped ([`map_file`]); either way the length is what the disk says, not
//! what a header claims, and every offset is checked against it before a single tensor is
//! touched (by the `safetensors` crate for a batch or trace, by [`TensorFile`] for a
//! checkpoint).

use crate::error::{bail, Error, Result};
use crate::sweep;
use ndarray::{ArrayD, IxDyn};
use safetensors::{Dtype, SafeTensors};
use std::borrow::Cow;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// Refuse files larger than this before reading them (the largest GPT-2 is about 6.5 GB in f32).
pub(crate) const MAX_FILE_BYTES: u64 = 64 << 30;

/// The length of the file at `path`, once it is known to be a file of at most
/// [`MAX_FILE_BYTES`]; `what` names it in messages.
fn checked_len(path: &Path, what: &str) -> Result<u64> {
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
    Ok(meta.len())
}

pub(crate) fn read_bytes(path: &Path, what: &str) -> Result<Vec<u8>> {
    checked_len(path, what)?;
    std::fs::read(path)
        .map_err(|e| Error::new(format!("cannot read {what} {}: {e}", path.display())))
}

/// The file at `path` mapped read-only, after the checks [`read_bytes`] makes: its bytes are the
/// kernel's page-cache pages, brought in as they are touched, and the mapping's length is the
/// file's on disk. Like every reader that maps a file, it assumes the file is not truncated or
/// rewritten while it is mapped.
pub(crate) fn map_file(path: &Path, what: &str) -> Result<memmap2::Mmap> {
    let label = path.display();
    let len = checked_len(path, what)?;
    let file = std::fs::File::open(path)
        .map_err(|e| Error::new(format!("cannot open {what} {label}: {e}")))?;
    // SAFETY: the mapping is read-only; a file truncated or rewritten under it while in use is
    // outside what any reader that maps files can guard against.
    let map = unsafe { memmap2::Mmap::map(&file) }
        .map_err(|e| Error::new(format!("cannot map {what} {label}: {e}")))?;
    if map.len() as u64 != len {
        bail!(
            "{label} is not a valid safetensors file (it changed size while being opened ({len} bytes, then {}))",
            map.len()
        );
    }
    Ok(map)
}

/// Alignment of the ranges [`release_pages`] hands back: 64 KiB is a multiple of every base
/// page size Linux uses (4 KiB on x86-64; 4, 16 or 64 KiB on arm64), so a range aligned to it is
/// whole pages whatever the machine's.
pub(crate) const RELEASE_ALIGN: usize = 64 << 10;

/// Drops from the process the pages of `map` that lie wholly inside `range` (those of its
/// 64 KiB-aligned interior, [`RELEASE_ALIGN`]): once a tensor has been copied or widened out of
/// a mapped file, its bytes no longer count in the process's memory. The kernel may keep them in
/// its page cache, which it reclaims as it needs. The pages at the range's ends, shared with
/// the neighbouring tensors, stay.
pub(crate) fn release_pages(map: &memmap2::Mmap, range: Range<usize>) -> std::io::Result<()> {
    let start = range.start.next_multiple_of(RELEASE_ALIGN);
    let end = range.end.min(map.len()) / RELEASE_ALIGN * RELEASE_ALIGN;
    if start >= end {
        return Ok(());
    }
    // SAFETY: MADV_DONTNEED on a read-only, file-backed mapping only unmaps the pages: they
    // were never written (the mapping cannot be), so nothing is lost, and a later read of any
    // byte in the range faults the page back in from the file (or the page cache), the same
    // bytes as before. Every slice borrowed from `map` stays valid and keeps its contents, as it
    // would if the kernel had reclaimed the pages itself under memory pressure; no anonymous or
    // copy-on-write page (whose contents DONTNEED would zero or discard) is in this mapping.
    unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start) }
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
/// Widened straight from the file's bytes: no copy of it in its own dtype is made, so reading
/// it holds its bytes and its f64 values, nothing more.
pub(crate) fn to_f64(st: &SafeTensors, name: &str, label: &str) -> Result<ArrayD<f64>> {
    let view = st
        .tensor(name)
        .map_err(|_| Error::new(format!("{label}: tensor `{name}` is missing")))?;
    let (dtype, bytes) = (view.dtype(), view.data());
    let width = float_width(dtype, name, label)?;
    let mut values = vec![0.0; bytes.len() / width];
    widen_le_in_chunks(dtype, bytes, &mut values);
    check_finite(&values, 0, name, label)?;
    ArrayD::from_shape_vec(IxDyn(view.shape()), values)
        .map_err(|e| Error::new(format!("{label}: tensor `{name}`: {e}")))
}

/// A float tensor as f64 with NaN and ±∞ kept: for values that are a verdict when non-finite
/// (a clipper's claimed norms), not an input error.
pub(crate) fn to_f64_unchecked(st: &SafeTensors, name: &str, label: &str) -> Result<ArrayD<f64>> {
    let view = st
        .tensor(name)
        .map_err(|_| Error::new(format!("{label}: tensor `{name}` is missing")))?;
    Floats::decode(view.dtype(), view.data(), name, label)?.into_array(view.shape(), name, label)
}

/// A floating tensor's values in its own dtype: a checkpoint's stored weights, or a clipper's
/// claimed sums, which at a 1 B-parameter model are 4.9 GB in f32 and would be twice that
/// widened. Readers take f64 a range at a time ([`Floats::widened`]); widening is exact.
#[derive(Clone, Debug, PartialEq)]
pub enum Floats {
    /// Stored as f64.
    F64(Vec<f64>),
    /// Stored as f32.
    F32(Vec<f32>),
    /// Stored as IEEE half.
    F16(Vec<half::f16>),
    /// Stored as bfloat16.
    Bf16(Vec<half::bf16>),
}

impl Floats {
    pub(crate) fn decode(dtype: Dtype, data: &[u8], name: &str, label: &str) -> Result<Self> {
        float_width(dtype, name, label)?;
        Ok(match dtype {
            Dtype::F64 => Floats::F64(
                data.chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect(),
            ),
            Dtype::F32 => Floats::F32(
                data.chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                    .collect(),
            ),
            Dtype::F16 => Floats::F16(
                data.chunks_exact(2)
                    .map(|c| half::f16::from_le_bytes([c[0], c[1]]))
                    .collect(),
            ),
            Dtype::BF16 => Floats::Bf16(
                data.chunks_exact(2)
                    .map(|c| half::bf16::from_le_bytes([c[0], c[1]]))
                    .collect(),
            ),
            other => unreachable!("a {other:?} tensor is refused by float_width"),
        })
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            Floats::F64(v) => v.len(),
            Floats::F32(v) => v.len(),
            Floats::F16(v) => v.len(),
            Floats::Bf16(v) => v.len(),
        }
    }

    pub(crate) fn bytes(&self) -> usize {
        match self {
            Floats::F64(v) => 8 * v.len(),
            Floats::F32(v) => 4 * v.len(),
            Floats::F16(v) => 2 * v.len(),
            Floats::Bf16(v) => 2 * v.len(),
        }
    }

    /// The values, or an error naming the tensor and the first non-finite one (a non-finite
    /// weight makes every norm NaN).
    pub(crate) fn finite(self, name: &str, label: &str) -> Result<Self> {
        match self.first_non_finite() {
            Some((i, v)) => Err(non_finite(i, v, name, label)),
            None => Ok(self),
        }
    }

    /// True when there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether some value is NaN or ±∞.
    pub fn any_non_finite(&self) -> bool {
        self.first_non_finite().is_some()
    }

    /// The values at `range`, widened to f64: borrowed when they are f64 already.
    pub fn widened(&self, range: Range<usize>) -> Cow<'_, [f64]> {
        fn widen<T: Copy>(v: &[T], w: impl Fn(T) -> f64) -> Cow<'static, [f64]> {
            Cow::Owned(v.iter().map(|&x| w(x)).collect())
        }
        match self {
            Floats::F64(v) => Cow::Borrowed(&v[range]),
            Floats::F32(v) => widen(&v[range], f64::from),
            Floats::F16(v) => widen(&v[range], half::f16::to_f64),
            Floats::Bf16(v) => widen(&v[range], half::bf16::to_f64),
        }
    }

    /// `f(a, b)` over matching ranges of `self` and `other` (of the same length) widened to f64,
    /// a bounded chunk at a time so that no whole tensor is widened at once.
    pub fn zip_chunks(&self, other: &Floats, mut f: impl FnMut(&[f64], &[f64])) {
        const CHUNK: usize = 1 << 16;
        let n = self.len().min(other.len());
        let mut start = 0;
        while start < n {
            let end = (start + CHUNK).min(n);
            f(&self.widened(start..end), &other.widened(start..end));
            start = end;
        }
    }

    fn first_non_finite(&self) -> Option<(usize, f64)> {
        fn find<T: Copy>(v: &[T], wide: impl Fn(T) -> f64) -> Option<(usize, f64)> {
            v.iter()
                .map(|&x| wide(x))
                .enumerate()
                .find(|(_, x)| !x.is_finite())
        }
        match self {
            Floats::F64(v) => find(v, |x| x),
            Floats::F32(v) => find(v, f64::from),
            Floats::F16(v) => find(v, half::f16::to_f64),
            Floats::Bf16(v) => find(v, half::bf16::to_f64),
        }
    }

    /// Every value widened to f64.
    pub fn to_f64_vec(&self) -> Vec<f64> {
        self.widened(0..self.len()).into_owned()
    }

    /// Writes the values, widened to f64 (exactly), into `out` (of the same length).
    pub(crate) fn widen_into(&self, out: &mut [f64]) {
        fn copy<T: Copy + Sync>(v: &[T], out: &mut [f64], w: impl Fn(T) -> f64 + Sync) {
            sweep::fill_chunks(out, |start, chunk| {
                for (o, &x) in chunk.iter_mut().zip(&v[start..]) {
                    *o = w(x);
                }
            })
        }
        match self {
            Floats::F64(v) => copy(v, out, |x| x),
            Floats::F32(v) => copy(v, out, f64::from),
            Floats::F16(v) => copy(v, out, half::f16::to_f64),
            Floats::Bf16(v) => copy(v, out, half::bf16::to_f64),
        }
    }

    /// The values widened to f64 (exactly) as an array of `shape`.
    fn into_array(self, shape: &[usize], name: &str, label: &str) -> Result<ArrayD<f64>> {
        let values = match self {
            Floats::F64(v) => v,
            other => {
                let mut out = vec![0.0; other.len()];
                other.widen_into(&mut out);
                out
            }
        };
        ArrayD::from_shape_vec(IxDyn(shape), values)
            .map_err(|e| Error::new(format!("{label}: tensor `{name}`: {e}")))
    }
}

/// Bytes a value of a float `dtype` takes, or an error naming the tensor for any other dtype.
pub(crate) fn float_width(dtype: Dtype, name: &str, label: &str) -> Result<usize> {
    Ok(match dtype {
        Dtype::F64 => 8,
        Dtype::F32 => 4,
        Dtype::F16 | Dtype::BF16 => 2,
        other => {
            bail!("{label}: tensor `{name}` has dtype {other:?}; expected F32, F64, F16 or BF16")
        }
    })
}

/// An error naming the tensor and its first non-finite value, if `values` (from flat index
/// `offset` on) hold one: a non-finite weight makes every norm NaN.
pub(crate) fn check_finite(values: &[f64], offset: usize, name: &str, label: &str) -> Result<()> {
    match values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        Some((i, &v)) => Err(non_finite(offset + i, v, name, label)),
        None => Ok(()),
    }
}

fn non_finite(index: usize, value: f64, name: &str, label: &str) -> Error {
    Error::new(format!(
        "{label}: tensor `{name}` holds a non-finite value ({value}) at flat index {index}"
    ))
}

/// [`widen_le_into`] over `out` a chunk per task ([`sweep::fill_chunks`]): the whole of a large
/// tensor read from a file or a mapping.
fn widen_le_in_chunks(dtype: Dtype, bytes: &[u8], out: &mut [f64]) {
    let width = dtype.bitsize() / 8;
    sweep::fill_chunks(out, |start, chunk| {
        let from = start * width;
        widen_le_into(dtype, &bytes[from..from + chunk.len() * width], chunk)
    })
}

/// Little-endian values of a float `dtype` widened to f64 (exactly) into `out`, as many as
/// both hold. `dtype` has passed [`float_width`].
pub(crate) fn widen_le_into(dtype: Dtype, bytes: &[u8], out: &mut [f64]) {
    fn widen<const N: usize>(bytes: &[u8], out: &mut [f64], w: impl Fn([u8; N]) -> f64) {
        for (o, c) in out.iter_mut().zip(bytes.chunks_exact(N)) {
            *o = w(c.try_into().expect("chunks of N bytes"));
        }
    }
    match dtype {
        Dtype::F64 => widen(bytes, out, f64::from_le_bytes),
        Dtype::F32 => widen(bytes, out, |c| f64::from(f32::from_le_bytes(c))),
        Dtype::F16 => widen(bytes, out, |c| half::f16::from_le_bytes(c).to_f64()),
        Dtype::BF16 => widen(bytes, out, |c| half::bf16::from_le_bytes(c).to_f64()),
        other => unreachable!("a {other:?} tensor is refused before it is widened"),
    }
}

/// One tensor in the checkpoint's dtype, its values checked finite.
#[derive(Clone, Debug)]
pub enum StoredTensor {
    /// Decoded from a checkpoint held in memory.
    Decoded(Floats),
    /// Bytes of a memory-mapped checkpoint: page-cache pages, neither copied nor cleared.
    Mapped {
        map: Arc<memmap2::Mmap>,
        dtype: Dtype,
        range: Range<usize>,
    },
}

impl StoredTensor {
    /// `range` of `map` as a tensor of `dtype`, after its values are checked finite (a
    /// non-finite weight makes every norm NaN), a chunk at a time.
    pub(crate) fn mapped(
        map: Arc<memmap2::Mmap>,
        dtype: Dtype,
        range: Range<usize>,
        name: &str,
        label: &str,
    ) -> Result<Self> {
        let width = float_width(dtype, name, label)?;
        let mut chunk = vec![0.0; 1 << 14];
        for (k, bytes) in map[range.clone()].chunks(chunk.len() * width).enumerate() {
            let values = &mut chunk[..bytes.len() / width];
            widen_le_into(dtype, bytes, values);
            check_finite(values, k * (1 << 14), name, label)?;
        }
        Ok(StoredTensor::Mapped { map, dtype, range })
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            StoredTensor::Decoded(v) => v.len(),
            StoredTensor::Mapped { dtype, range, .. } => range.len() * 8 / dtype.bitsize(),
        }
    }

    pub(crate) fn bytes(&self) -> usize {
        match self {
            StoredTensor::Decoded(v) => v.bytes(),
            StoredTensor::Mapped { range, .. } => range.len(),
        }
    }

    pub(crate) fn widen_into(&self, out: &mut [f64]) {
        match self {
            StoredTensor::Decoded(v) => v.widen_into(out),
            StoredTensor::Mapped { map, dtype, range } => {
                widen_le_in_chunks(*dtype, &map[range.clone()], out)
            }
        }
    }
}

/// Equal values, however held (widening is exact, and stored values are finite).
impl PartialEq for StoredTensor {
    fn eq(&self, other: &Self) -> bool {
        let widened = |t: &StoredTensor| {
            let mut out = vec![0.0; t.len()];
            t.widen_into(&mut out);
            out
        };
        self.len() == other.len() && widened(self) == widened(other)
    }
}

impl From<Vec<f64>> for Floats {
    fn from(v: Vec<f64>) -> Self {
        Floats::F64(v)
    }
}

impl From<Vec<f32>> for Floats {
    fn from(v: Vec<f32>) -> Self {
        Floats::F32(v)
    }
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

/// The largest safetensors header accepted (the crate's own limit is the same size).
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// Where a checkpoint's tensors come from: a file read tensor by tensor ([`TensorFile`]) or a
/// parsed buffer. Either way every tensor's extent was checked against the data's length when
/// the source was opened.
pub trait TensorSource {
    fn names(&self) -> Vec<String>;
    /// Dtype and shape of a tensor, from the header.
    fn info(&self, name: &str) -> Option<(Dtype, Vec<usize>)>;
    /// A tensor's dtype, shape and little-endian bytes.
    fn raw(&self, name: &str, label: &str) -> Result<(Dtype, Vec<usize>, Cow<'_, [u8]>)>;

    /// A tensor kept in its own dtype, its values checked finite: decoded into memory, or
    /// where the source is a mapped file, left in the mapping.
    fn stored(&self, name: &str, label: &str) -> Result<(Vec<usize>, StoredTensor)> {
        let (dtype, shape, bytes) = self.raw(name, label)?;
        let values = Floats::decode(dtype, &bytes, name, label)?.finite(name, label)?;
        Ok((shape, StoredTensor::Decoded(values)))
    }

    fn has(&self, name: &str) -> bool {
        self.info(name).is_some()
    }

    /// A floating tensor widened to f64 straight into `out` (its length checked), with NaN/Inf
    /// rejected: no copy of it in its own dtype is made.
    fn widen_into(&self, name: &str, label: &str, out: &mut [f64]) -> Result<()> {
        let (dtype, _, bytes) = self.raw(name, label)?;
        let width = float_width(dtype, name, label)?;
        if bytes.len() != out.len() * width {
            bail!(
                "{label}: tensor `{name}` has {} values; expected {}",
                bytes.len() / width,
                out.len()
            );
        }
        widen_le_into(dtype, &bytes, out);
        check_finite(out, 0, name, label)
    }

    /// A floating tensor as f64, with NaN/Inf rejected.
    fn f64(&self, name: &str, label: &str) -> Result<ArrayD<f64>> {
        let (dtype, shape, bytes) = self.raw(name, label)?;
        Floats::decode(dtype, &bytes, name, label)?
            .finite(name, label)?
            .into_array(&shape, name, label)
    }
}

impl TensorSource for SafeTensors<'_> {
    fn names(&self) -> Vec<String> {
        SafeTensors::names(self)
            .into_iter()
            .map(str::to_string)
            .collect()
    }

    fn info(&self, name: &str) -> Option<(Dtype, Vec<usize>)> {
        self.tensor(name)
            .ok()
            .map(|v| (v.dtype(), v.shape().to_vec()))
    }

    fn raw(&self, name: &str, label: &str) -> Result<(Dtype, Vec<usize>, Cow<'_, [u8]>)> {
        let view = self
            .tensor(name)
            .map_err(|_| Error::new(format!("{label}: tensor `{name}` is missing")))?;
        Ok((
            view.dtype(),
            view.shape().to_vec(),
            Cow::Borrowed(view.data()),
        ))
    }
}

/// A safetensors file, memory-mapped once its header is checked: a tensor's bytes are the
/// kernel's page-cache pages, so nothing is copied to read them and blocks kept in the
/// checkpoint's dtype ([`StoredTensor`]) cost no memory of the process's own, none of it
/// fresh pages to clear. Like every reader that maps weights, it assumes the file is not
/// rewritten while the model is in use.
pub(crate) struct TensorFile {
    map: Arc<memmap2::Mmap>,
    /// Offset of the data section in the file.
    data_start: u64,
    /// (dtype, shape, start, end) by name, offsets relative to the data section.
    tensors: std::collections::HashMap<String, (Dtype, Vec<usize>, u64, u64)>,
}

impl TensorFile {
    /// Opens and checks a file: the header's length against the file's, every tensor's extent
    /// against its dtype and shape, and the extents tiling the data section exactly, as the
    /// `safetensors` crate checks a buffer.
    pub(crate) fn open(path: &Path, what: &str) -> Result<Self> {
        let label = path.display().to_string();
        let bad =
            |why: String| Error::new(format!("{label} is not a valid safetensors file ({why})"));
        let map = map_file(path, what)?;
        let len = map.len() as u64;
        let Some(n) = map.get(..8) else {
            return Err(bad("shorter than its 8-byte header length".into()));
        };
        let n = u64::from_le_bytes(n.try_into().expect("8 bytes"));
        if n > MAX_HEADER_BYTES || 8 + n > len {
            return Err(bad(format!(
                "a header of {n} bytes in a file of {len} bytes"
            )));
        }
        let header = &map[8..8 + n as usize];
        let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(header)
            .map_err(|e| bad(format!("its header is not a JSON object: {e}")))?;
        let mut tensors = std::collections::HashMap::new();
        let mut extents = Vec::new();
        for (name, entry) in header {
            if name == "__metadata__" {
                continue;
            }
            let field = |key: &str| {
                entry
                    .get(key)
                    .cloned()
                    .ok_or_else(|| bad(format!("tensor `{name}` has no `{key}`")))
            };
            let dtype: Dtype = serde_json::from_value(field("dtype")?)
                .map_err(|e| bad(format!("tensor `{name}`: dtype: {e}")))?;
            let shape: Vec<usize> = serde_json::from_value(field("shape")?)
                .map_err(|e| bad(format!("tensor `{name}`: shape: {e}")))?;
            let (start, end): (u64, u64) = serde_json::from_value(field("data_offsets")?)
                .map_err(|e| bad(format!("tensor `{name}`: data_offsets: {e}")))?;
            let bits = shape
                .iter()
                .try_fold(dtype.bitsize() as u64, |acc, &d| acc.checked_mul(d as u64))
                .ok_or_else(|| bad(format!("tensor `{name}`: its shape overflows")))?;
            if bits % 8 != 0 || end < start || end - start != bits / 8 {
                return Err(bad(format!(
                    "tensor `{name}`: data_offsets {start}..{end} do not hold a {dtype:?} tensor of shape {shape:?}"
                )));
            }
            extents.push((start, end, name.clone()));
            tensors.insert(name, (dtype, shape, start, end));
        }
        extents.sort();
        let mut at = 0;
        for (start, end, name) in &extents {
            if *start != at {
                return Err(bad(format!("tensor `{name}` starts at {start}, not {at}")));
            }
            at = *end;
        }
        if 8 + n + at != len {
            return Err(bad(format!(
                "its tensors end at byte {} of a {len}-byte file",
                8 + n + at
            )));
        }
        Ok(TensorFile {
            map: Arc::new(map),
            data_start: 8 + n,
            tensors,
        })
    }

    /// A tensor's dtype, shape and byte range in the mapping (checked against the file's
    /// length when it was opened).
    fn extent(&self, name: &str, label: &str) -> Result<(Dtype, Vec<usize>, Range<usize>)> {
        let (dtype, shape, start, end) = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::new(format!("{label}: tensor `{name}` is missing")))?;
        let range = (self.data_start + start) as usize..(self.data_start + end) as usize;
        Ok((*dtype, shape.clone(), range))
    }
}

impl TensorSource for TensorFile {
    fn names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }

    fn info(&self, name: &str) -> Option<(Dtype, Vec<usize>)> {
        self.tensors.get(name).map(|(d, s, _, _)| (*d, s.clone()))
    }

    fn raw(&self, name: &str, label: &str) -> Result<(Dtype, Vec<usize>, Cow<'_, [u8]>)> {
        let (dtype, shape, range) = self.extent(name, label)?;
        Ok((dtype, shape, Cow::Borrowed(&self.map[range])))
    }

    fn stored(&self, name: &str, label: &str) -> Result<(Vec<usize>, StoredTensor)> {
        let (dtype, shape, range) = self.extent(name, label)?;
        let tensor = StoredTensor::mapped(self.map.clone(), dtype, range, name, label)?;
        Ok((shape, tensor))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Resident bytes of the mapping that starts at `start`, as the kernel counts them
    /// (`Rss:` of its entry in /proc/self/smaps: the first after the entry's address line).
    fn resident(start: *const u8) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let head = format!("{:x}-", start as usize);
        let entry = smaps
            .split_inclusive('\n')
            .skip_while(|line| !line.starts_with(&head))
            .skip(1)
            .find_map(|line| line.strip_prefix("Rss:"))
            .expect("the mapping's entry has an Rss line");
        let kib: u64 = entry.trim().trim_end_matches("kB").trim().parse().unwrap();
        kib * 1024
    }

    #[test]
    fn released_pages_leave_the_process_and_read_back_the_same() {
        let dir = std::env::temp_dir().join(format!("ghost-oracle-release-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pages.bin");
        let len = 4 << 20;
        let content: Vec<u8> = (0..len).map(|k| (k * 7 % 251) as u8).collect();
        std::fs::write(&path, &content).unwrap();
        let map = map_file(&path, "test file").unwrap();
        // Touch every page: all 4 MiB are resident.
        let sum: u64 = map.iter().map(|&b| b as u64).sum();
        assert_eq!(sum, content.iter().map(|&b| b as u64).sum::<u64>());
        assert_eq!(resident(map.as_ptr()), len as u64);
        // A range not aligned at either end: its 64 KiB-aligned interior goes, the spans at its
        // ends stay.
        release_pages(&map, 1000..len - 1000).unwrap();
        let left = resident(map.as_ptr());
        assert!(
            left <= 2 * RELEASE_ALIGN as u64,
            "{left} bytes still resident"
        );
        // A range inside one span releases nothing.
        release_pages(&map, 10..RELEASE_ALIGN - 10).unwrap();
        assert_eq!(resident(map.as_ptr()), left);
        // The bytes read back from the file, unchanged.
        assert!(map[..] == content[..]);
        assert_eq!(resident(map.as_ptr()), len as u64);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
