//! The reference's large f64 products. They run in faer, whose f64 kernels on x86-64 are its own
//! AVX-512 and AVX2 code (not the `gemm` crate that the clippers' candle uses for f32). At the
//! Llama-3.2-1B shapes on the 2-core build machine that is 2–3× the rate of ndarray's
//! matrixmultiply (benches/faer_rate, docs/results.md). An example's cost there is its
//! matmuls. Small products (attention's per-head T×T) stay in ndarray. The judge's products on
//! the reference's factors (its Grams) run here too: they are the reference side.

use ndarray::{Array2, ArrayView2, ArrayViewMut2};

/// Whether a product replaces what `c` holds or is added to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accumulate {
    /// c = α·a·b.
    Replace,
    /// c += α·a·b.
    Add,
}

/// c = α·a·b, or c += α·a·b. Panics on shapes that do not chain, as ndarray's
/// `general_mat_mul` does: every caller forms them from one model's dimensions.
pub fn product_into(
    alpha: f64,
    a: ArrayView2<'_, f64>,
    b: ArrayView2<'_, f64>,
    into: Accumulate,
    mut c: ArrayViewMut2<'_, f64>,
) {
    let (m, k) = a.dim();
    let (k2, n) = b.dim();
    assert!(
        k == k2 && c.dim() == (m, n),
        "a {m}×{k} · {k2}×{n} product into {:?}",
        c.dim()
    );
    let (sa, sb) = (a.strides(), b.strides());
    let sc = [c.strides()[0], c.strides()[1]];
    // SAFETY: each view is built from an ndarray view's own pointer, shape and strides, so it
    // covers exactly that view's elements; `c` is borrowed mutably, so it aliases neither input.
    let (fa, fb, fc) = unsafe {
        (
            faer::MatRef::from_raw_parts(a.as_ptr(), m, k, sa[0], sa[1]),
            faer::MatRef::from_raw_parts(b.as_ptr(), k, n, sb[0], sb[1]),
            faer::MatMut::from_raw_parts_mut(c.as_mut_ptr(), m, n, sc[0], sc[1]),
        )
    };
    let accum = match into {
        Accumulate::Replace => faer::Accum::Replace,
        Accumulate::Add => faer::Accum::Add,
    };
    faer::linalg::matmul::matmul(fc, accum, fa, fb, alpha, parallelism());
}

/// a·b as a new array.
pub fn product(a: ArrayView2<'_, f64>, b: ArrayView2<'_, f64>) -> Array2<f64> {
    let mut c = Array2::zeros((a.nrows(), b.ncols()));
    product_into(1.0, a, b, Accumulate::Replace, c.view_mut());
    c
}

/// How a product spreads over the cores: inside a parallel loop (a worker of rayon's pool) the
/// loop already keeps every core busy, and a product that spread itself again only adds barrier
/// waits (a seventh of `check`'s time on a convolution network judged an example per task).
fn parallelism() -> faer::Par {
    if rayon::current_thread_index().is_some() {
        faer::Par::Seq
    } else {
        faer::Par::rayon(0)
    }
}

/// A·Aᵀ, symmetric: one triangle formed (faer's triangular product) and mirrored, half the
/// multiply-adds of [`product`]. The judge's B×B Gram of the examples' gradients is this at
/// B² · P/2: at B = 512 over a 2.7 M-parameter network, most of `check`'s time.
pub fn gram(a: ArrayView2<'_, f64>) -> Array2<f64> {
    let (m, k) = a.dim();
    let mut c = Array2::<f64>::zeros((m, m));
    let sa = a.strides();
    let sc = [c.strides()[0], c.strides()[1]];
    // SAFETY: as in `product_into`: each view covers exactly its ndarray's elements, and `c`
    // is a fresh array that aliases neither.
    let (fa, fat, fc) = unsafe {
        (
            faer::MatRef::from_raw_parts(a.as_ptr(), m, k, sa[0], sa[1]),
            faer::MatRef::from_raw_parts(a.as_ptr(), k, m, sa[1], sa[0]),
            faer::MatMut::from_raw_parts_mut(c.as_mut_ptr(), m, m, sc[0], sc[1]),
        )
    };
    use faer::linalg::matmul::triangular::{matmul, BlockStructure};
    matmul(
        fc,
        BlockStructure::TriangularLower,
        faer::Accum::Replace,
        fa,
        BlockStructure::Rectangular,
        fat,
        BlockStructure::Rectangular,
        1.0,
        parallelism(),
    );
    for i in 0..m {
        for j in i + 1..m {
            c[(i, j)] = c[(j, i)];
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::s;

    #[test]
    fn a_gram_from_one_triangle_is_the_whole_product() {
        let a = Array2::from_shape_fn((37, 53), |(i, j)| ((i * 7 + j * 3) % 11) as f64 - 5.0);
        let g = gram(a.view());
        let want = naive(a.view(), a.t());
        assert!(g
            .iter()
            .zip(want.iter())
            .all(|(x, y)| (x - y).abs() <= 1e-9));
        let strided = a.slice(s![..;2, 1..]);
        let want = naive(strided, strided.t());
        assert!(gram(strided)
            .iter()
            .zip(want.iter())
            .all(|(x, y)| (x - y).abs() <= 1e-9));
    }

    fn naive(a: ArrayView2<'_, f64>, b: ArrayView2<'_, f64>) -> Array2<f64> {
        Array2::from_shape_fn((a.nrows(), b.ncols()), |(i, j)| {
            (0..a.ncols()).map(|k| a[(i, k)] * b[(k, j)]).sum()
        })
    }

    #[test]
    fn products_of_transposed_and_sliced_views_match_the_definition() {
        // Small integers: every product and sum is exact, so the answers must be equal.
        let x = Array2::from_shape_fn((37, 53), |(i, j)| ((i * 7 + j * 3) % 11) as f64 - 5.0);
        let y = Array2::from_shape_fn((53, 29), |(i, j)| ((i * 5 + j * 2) % 13) as f64 - 6.0);
        assert_eq!(product(x.view(), y.view()), naive(x.view(), y.view()));
        // The reference's layouts: a weight used transposed, a column range of backprops.
        let yt = y.t().to_owned();
        assert_eq!(product(x.view(), yt.t()), naive(x.view(), y.view()));
        let cols = x.slice(s![.., 4..40]);
        assert_eq!(product(cols.t(), x.view()), naive(cols.t(), x.view()));
        // Accumulating with a scale, into a slice of a larger buffer.
        let mut c = Array2::from_elem((40, 60), 1.0);
        product_into(
            2.0,
            x.view(),
            y.view(),
            Accumulate::Add,
            c.slice_mut(s![1..38, 3..32]),
        );
        let want = naive(x.view(), y.view()).mapv(|v| 2.0 * v + 1.0);
        assert_eq!(c.slice(s![1..38, 3..32]), want);
        assert_eq!(c[(0, 0)], 1.0);
        assert_eq!(c[(39, 59)], 1.0);
    }
}
