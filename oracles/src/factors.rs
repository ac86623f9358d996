//! A batch's factor tensors as the reference and the judge read them: f64 held as it is, a trace
//! file's factors in the precision they are stored in, each widened to f64 an example or a tile
//! at a time.

use ndarray::{s, Array3, ArrayBase, ArrayView2, Axis, CowArray, Ix2};
use std::fmt::Debug;
use std::ops::Range;
use std::sync::Arc;

/// A batch's factor tensor, B × R × C (a site's activations or backprops, a convolution's
/// inputs), as the reference and the judge read it: one example, or a tile of its rows, at a
/// time, in f64. The reference's own traces hold f64 ([`Array3<f64>`], read borrowed); a trace
/// file's are held in the precision they are stored in ([`StoredFactors`]) and widened an
/// example at a time, so a batch of f32 factors costs its file's bytes, not twice them.
pub trait Factors: Clone + Debug + Send + Sync {
    /// (B, R, C).
    fn dim(&self) -> (usize, usize, usize);
    /// [B, R, C].
    fn shape(&self) -> &[usize];
    /// Example `i`'s R × C rows in f64: borrowed where held in f64, widened (exactly) otherwise.
    fn example(&self, i: usize) -> CowArray<'_, f64, Ix2>;
    /// Rows `rows` of example `i` in f64, as [`Factors::example`].
    fn example_rows(&self, i: usize, rows: Range<usize>) -> CowArray<'_, f64, Ix2>;
    /// Columns `cols` of example `i`'s rows in f64, as [`Factors::example`].
    fn example_cols(&self, i: usize, cols: Range<usize>) -> CowArray<'_, f64, Ix2>;
    /// Example `i`'s R × C values as they are held, for a reader that widens each value as it
    /// copies it (a convolution's unfold) instead of widening the example first.
    fn held_example(&self, i: usize) -> HeldExample<'_>;
    /// Bytes held.
    fn held_bytes(&self) -> usize;
}

/// One example's values as a [`Factors`] holds them.
#[derive(Clone, Debug)]
pub enum HeldExample<'a> {
    /// Held as f32 (stored as f32, f16 or bf16).
    F32(ArrayView2<'a, f32>),
    /// Held as f64.
    F64(ArrayView2<'a, f64>),
}

impl Factors for Array3<f64> {
    fn dim(&self) -> (usize, usize, usize) {
        ArrayBase::dim(self)
    }

    fn shape(&self) -> &[usize] {
        ArrayBase::shape(self)
    }

    fn example(&self, i: usize) -> CowArray<'_, f64, Ix2> {
        self.index_axis(Axis(0), i).into()
    }

    fn example_rows(&self, i: usize, rows: Range<usize>) -> CowArray<'_, f64, Ix2> {
        self.slice(s![i, rows, ..]).into()
    }

    fn example_cols(&self, i: usize, cols: Range<usize>) -> CowArray<'_, f64, Ix2> {
        self.slice(s![i, .., cols]).into()
    }

    fn held_example(&self, i: usize) -> HeldExample<'_> {
        HeldExample::F64(self.index_axis(Axis(0), i))
    }

    fn held_bytes(&self) -> usize {
        self.len() * std::mem::size_of::<f64>()
    }
}

/// A factor tensor of a trace file in the precision it is stored in: f64 as f64, and f32, f16
/// and bf16 as f32 (each of which f32 holds exactly). Widening to f64 is exact, so every figure
/// the judge takes from it is the one it would take from the tensor widened whole. Shared: the
/// sites that read one tensor of the file (`backprops_of`) hold it once.
#[derive(Clone, Debug, PartialEq)]
pub enum StoredFactors {
    /// Stored as f32, f16 or bf16.
    F32(Arc<Array3<f32>>),
    /// Stored as f64.
    F64(Arc<Array3<f64>>),
}

impl StoredFactors {
    /// The values widened to f64 (exactly), the narrow copy dropped (a shared one copied).
    pub fn into_f64(self) -> Array3<f64> {
        match self {
            StoredFactors::F32(a) => a.mapv(f64::from),
            StoredFactors::F64(a) => Arc::try_unwrap(a).unwrap_or_else(|a| (*a).clone()),
        }
    }
}

impl From<Array3<f64>> for StoredFactors {
    fn from(a: Array3<f64>) -> Self {
        StoredFactors::F64(Arc::new(a))
    }
}

impl From<Array3<f32>> for StoredFactors {
    fn from(a: Array3<f32>) -> Self {
        StoredFactors::F32(Arc::new(a))
    }
}

impl Factors for StoredFactors {
    fn dim(&self) -> (usize, usize, usize) {
        match self {
            StoredFactors::F32(a) => a.dim(),
            StoredFactors::F64(a) => a.dim(),
        }
    }

    fn shape(&self) -> &[usize] {
        match self {
            StoredFactors::F32(a) => a.shape(),
            StoredFactors::F64(a) => a.shape(),
        }
    }

    fn example(&self, i: usize) -> CowArray<'_, f64, Ix2> {
        match self {
            StoredFactors::F32(a) => a.index_axis(Axis(0), i).mapv(f64::from).into(),
            StoredFactors::F64(a) => a.index_axis(Axis(0), i).into(),
        }
    }

    fn example_rows(&self, i: usize, rows: Range<usize>) -> CowArray<'_, f64, Ix2> {
        match self {
            StoredFactors::F32(a) => a.slice(s![i, rows, ..]).mapv(f64::from).into(),
            StoredFactors::F64(a) => a.slice(s![i, rows, ..]).into(),
        }
    }

    fn example_cols(&self, i: usize, cols: Range<usize>) -> CowArray<'_, f64, Ix2> {
        match self {
            StoredFactors::F32(a) => a.slice(s![i, .., cols]).mapv(f64::from).into(),
            StoredFactors::F64(a) => a.slice(s![i, .., cols]).into(),
        }
    }

    fn held_example(&self, i: usize) -> HeldExample<'_> {
        match self {
            StoredFactors::F32(a) => HeldExample::F32(a.index_axis(Axis(0), i)),
            StoredFactors::F64(a) => HeldExample::F64(a.index_axis(Axis(0), i)),
        }
    }

    fn held_bytes(&self) -> usize {
        match self {
            StoredFactors::F32(a) => a.len() * std::mem::size_of::<f32>(),
            StoredFactors::F64(a) => a.len() * std::mem::size_of::<f64>(),
        }
    }
}
