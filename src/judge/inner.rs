//! Inner products of true per-example gradients straight from the reference's factors, never
//! forming a gradient: a site's gradient is G = Σ_t u_t v_tᵀ in its parameter's layout, so
//!
//!   ⟨G_{j,i}, G_{l,k}⟩ = Σ_{t,s} (u_{j,i,t} · u_{l,k,s}) (v_{j,i,t} · v_{l,k,s}),
//!
//! T·S terms (T and S the two sites' rows) built from products of width rows + cols instead of rows·cols entries. This is
//! the judge's own arithmetic on the f64 trace (ndarray), written apart from any clipper: a bug
//! shared by a clipper's kernel and the judge would be invisible to the audit.

use ghost_oracle_reference::{product_into, Accumulate};
use ghost_oracle_reference::{SiteKind, Trace as RefTrace};
use ndarray::{s, Array2, Array3, ArrayView2, ArrayView3, CowArray, Ix3, Zip};

/// The factor along the layout's rows (u_t), for every example.
enum RowSide<'a> {
    /// B×R×rows.
    Dense(CowArray<'a, f64, Ix3>),
    /// B×R ids: u_t = onehot(id_t), so a product with it is a lookup.
    OneHot(Array2<usize>),
}

/// The factor along the layout's columns (v_t), for every example.
enum ColSide<'a> {
    /// B×R×cols.
    Dense(ArrayView3<'a, f64>),
    /// v_t = 1, the single column of a bias-like gradient.
    Ones,
}

/// One site's two factors in its parameter's layout.
pub(super) struct SiteSides<'a> {
    rows: RowSide<'a>,
    cols: ColSide<'a>,
    /// Rows R each example's gradient sums over: the site's own (T, k·T for a per-head norm, 1
    /// for a pooled head, ...).
    terms: usize,
}

impl<'a> SiteSides<'a> {
    /// Site `j` of a validated trace (ids inside the table, activations where the kind needs
    /// them).
    pub(super) fn of(trace: &'a RefTrace, j: usize) -> Self {
        let site = &trace.sites[j];
        let bp = site.backprops.view();
        let act = || {
            site.activations
                .as_ref()
                .expect("a validated linear, conv1d or layernorm site has activations")
                .view()
        };
        let (rows, cols) = match site.spec.kind {
            SiteKind::Linear => (RowSide::Dense(bp.into()), ColSide::Dense(act())),
            SiteKind::Conv1d => (RowSide::Dense(act().into()), ColSide::Dense(bp)),
            SiteKind::Embedding => {
                let ids = site.ids.as_ref().expect("a validated embedding has ids");
                // Validation has put every id inside 0..vocab.
                (
                    RowSide::OneHot(ids.mapv(|x| x as usize)),
                    ColSide::Dense(bp),
                )
            }
            SiteKind::Bias => (RowSide::Dense(bp.into()), ColSide::Ones),
            SiteKind::LayerNorm => {
                let prod: Array3<f64> = &bp * &act();
                (RowSide::Dense(prod.into()), ColSide::Ones)
            }
        };
        SiteSides {
            rows,
            cols,
            terms: bp.dim().1,
        }
    }

    fn dense_rows(&self) -> bool {
        matches!(self.rows, RowSide::Dense(_))
    }

    fn dense_cols(&self) -> bool {
        matches!(self.cols, ColSide::Dense(_))
    }
}

/// Multiply-adds of one ⟨G_{j,i}, G_{l,k}⟩ by the identity, for a layout of `rows`×`cols`: the
/// two T×S products (a lookup where a side is one-hot or ones) and their elementwise sum.
pub(super) fn pair_cost(a: &SiteSides<'_>, b: &SiteSides<'_>, rows: usize, cols: usize) -> f64 {
    let row_width = if a.dense_rows() && b.dense_rows() {
        rows
    } else {
        1
    };
    let col_width = if a.dense_cols() && b.dense_cols() {
        cols
    } else {
        1
    };
    (a.terms * b.terms) as f64 * (row_width + col_width + 1) as f64
}

/// ⟨G_{a,i}, G_{b,k}⟩: example i's gradient at site a with example k's at site b, two sites of
/// one parameter (the same layout).
pub(super) fn site_inner(a: &SiteSides<'_>, i: usize, b: &SiteSides<'_>, k: usize) -> f64 {
    let (t, s) = (a.terms, b.terms);
    let mut u = Array2::<f64>::zeros((t, s));
    match (&a.rows, &b.rows) {
        (RowSide::Dense(x), RowSide::Dense(y)) => {
            let (x, y) = (x.slice(s![i, .., ..]), y.slice(s![k, .., ..]));
            product_into(1.0, x, y.t(), Accumulate::Replace, u.view_mut());
        }
        (RowSide::OneHot(ix), RowSide::Dense(y)) => {
            let y = y.slice(s![k, .., ..]);
            lookup(&mut u, &y, |p, q| (q, ix[(i, p)]));
        }
        (RowSide::Dense(x), RowSide::OneHot(iy)) => {
            let x = x.slice(s![i, .., ..]);
            lookup(&mut u, &x, |p, q| (p, iy[(k, q)]));
        }
        (RowSide::OneHot(ix), RowSide::OneHot(iy)) => {
            u.indexed_iter_mut().for_each(|((p, q), v)| {
                *v = f64::from(u8::from(ix[(i, p)] == iy[(k, q)]));
            });
        }
    }
    match (&a.cols, &b.cols) {
        (ColSide::Ones, ColSide::Ones) => u.sum(),
        (ColSide::Dense(x), ColSide::Dense(y)) => {
            let mut v = Array2::<f64>::zeros((t, s));
            let (x, y) = (x.slice(s![i, .., ..]), y.slice(s![k, .., ..]));
            product_into(1.0, x, y.t(), Accumulate::Replace, v.view_mut());
            Zip::from(&u).and(&v).fold(0.0, |acc, p, q| acc + p * q)
        }
        // Only a one-column layout mixes a ones side with a dense one (a linear site with one
        // input tied to a bias, say): v_t · 1 is the dense side's single value.
        (ColSide::Dense(x), ColSide::Ones) => {
            let x = x.slice(s![i, .., 0]);
            Zip::indexed(&u).fold(0.0, |acc, (p, _), w| acc + w * x[p])
        }
        (ColSide::Ones, ColSide::Dense(y)) => {
            let y = y.slice(s![k, .., 0]);
            Zip::indexed(&u).fold(0.0, |acc, (_, q), w| acc + w * y[q])
        }
    }
}

/// Fills the T×S matrix `u` with entries of a dense side, `at(p, q)` giving (row, column) in it.
fn lookup(
    u: &mut Array2<f64>,
    dense: &ArrayView2<'_, f64>,
    at: impl Fn(usize, usize) -> (usize, usize),
) {
    u.indexed_iter_mut()
        .for_each(|((p, q), v)| *v = dense[at(p, q)]);
}
