//! Inner products of true per-example gradients straight from the reference's factors, never
//! forming a gradient: a site's gradient is G = Σ_t u_t v_tᵀ in its parameter's layout, so
//!
//!   ⟨G_{j,i}, G_{l,k}⟩ = Σ_{t,s} (u_{j,i,t} · u_{l,k,s}) (v_{j,i,t} · v_{l,k,s}),
//!
//! T·S terms (T and S the two sites' rows) built from products of width rows + cols instead of rows·cols entries. This is
//! the judge's own arithmetic on the f64 trace (ndarray), written apart from any clipper: a bug
//! shared by a clipper's kernel and the judge would be invisible to the audit.

use ghost_oracle_reference::{product_into, Accumulate};
use ghost_oracle_reference::{Factors, Site, SiteKind, Trace};
use ndarray::{Array2, ArrayView1, ArrayView2, CowArray, Ix2, Zip};

/// Where a site's two factors come from, per example.
enum Layout {
    /// u_t = δ_t, v_t = a_t (linear; a convolution's rows unfolded by [`Site::rows`]).
    Linear,
    /// u_t = a_t, v_t = δ_t (HF Conv1D).
    Conv1d,
    /// u_t = onehot(id_t) (B×R ids, validated inside the table), v_t = δ_t.
    OneHot(Array2<usize>),
    /// u_t = δ_t, v_t = 1.
    Bias,
    /// u_t = δ_t ⊙ x̂_t (formed an example at a time, never the batch's B×R×out), v_t = 1.
    LayerNorm,
}

/// The factor along the layout's rows (u_t) of one example.
enum RowSide<'a> {
    /// R×rows.
    Dense(CowArray<'a, f64, Ix2>),
    /// R ids: u_t = onehot(id_t), so a product with it is a lookup.
    OneHot(ArrayView1<'a, usize>),
}

/// The factor along the layout's columns (v_t) of one example.
enum ColSide<'a> {
    /// R×cols.
    Dense(CowArray<'a, f64, Ix2>),
    /// v_t = 1, the single column of a bias-like gradient.
    Ones,
}

/// One site's two factors in its parameter's layout, read one example at a time through
/// [`Site::rows`] (borrowed for a row-form site, unfolded for a convolution stored as its
/// input).
pub(super) struct SiteSides<'a, F> {
    site: &'a Site<F>,
    layout: Layout,
    /// Rows R each example's gradient sums over: the site's own (T, k·T for a per-head norm, 1
    /// for a pooled head, P·g for a convolution, ...).
    terms: usize,
}

impl<'a, F: Factors> SiteSides<'a, F> {
    /// Site `j` of a validated trace (ids inside the table, activations where the kind needs
    /// them).
    pub(super) fn of(trace: &'a Trace<F>, j: usize) -> Self {
        let site = &trace.sites[j];
        let layout = match site.spec.kind {
            SiteKind::Linear => Layout::Linear,
            SiteKind::Conv1d => Layout::Conv1d,
            SiteKind::Embedding => {
                let ids = site.ids.as_ref().expect("a validated embedding has ids");
                // Validation has put every id inside 0..vocab.
                Layout::OneHot(ids.mapv(|x| x as usize))
            }
            SiteKind::Bias => Layout::Bias,
            SiteKind::LayerNorm => Layout::LayerNorm,
        };
        SiteSides {
            site,
            layout,
            terms: site.row_count(),
        }
    }

    /// Example i's two factors.
    fn example(&self, i: usize) -> (RowSide<'_>, ColSide<'_>) {
        let dense = |rows: ghost_oracle_reference::SiteRows<'a>| {
            let act = rows
                .activations
                .expect("a validated linear or conv1d site has activations");
            (rows.backprops, act)
        };
        match &self.layout {
            Layout::Linear => {
                let (bp, act) = dense(self.site.rows(i));
                (RowSide::Dense(bp), ColSide::Dense(act))
            }
            Layout::Conv1d => {
                let (bp, act) = dense(self.site.rows(i));
                (RowSide::Dense(act), ColSide::Dense(bp))
            }
            Layout::OneHot(ids) => (
                RowSide::OneHot(ids.row(i)),
                ColSide::Dense(self.site.rows(i).backprops),
            ),
            Layout::Bias => (RowSide::Dense(self.site.rows(i).backprops), ColSide::Ones),
            Layout::LayerNorm => {
                let rows = self.site.rows(i);
                let act = rows
                    .activations
                    .expect("a validated layernorm site has activations");
                (
                    RowSide::Dense((&rows.backprops * &act).into()),
                    ColSide::Ones,
                )
            }
        }
    }

    fn dense_rows(&self) -> bool {
        match self.layout {
            Layout::Linear | Layout::Conv1d | Layout::Bias | Layout::LayerNorm => true,
            Layout::OneHot(_) => false,
        }
    }

    fn dense_cols(&self) -> bool {
        match self.layout {
            Layout::Linear | Layout::Conv1d | Layout::OneHot(_) => true,
            Layout::Bias | Layout::LayerNorm => false,
        }
    }
}

/// Multiply-adds of one ⟨G_{j,i}, G_{l,k}⟩ by the identity, for a layout of `rows`×`cols`: the
/// two T×S products (a lookup where a side is one-hot or ones) and their elementwise sum.
pub(super) fn pair_cost<F: Factors>(
    a: &SiteSides<'_, F>,
    b: &SiteSides<'_, F>,
    rows: usize,
    cols: usize,
) -> f64 {
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
pub(super) fn site_inner<F: Factors>(
    a: &SiteSides<'_, F>,
    i: usize,
    b: &SiteSides<'_, F>,
    k: usize,
) -> f64 {
    let (t, s) = (a.terms, b.terms);
    let (a_rows, a_cols) = a.example(i);
    let (b_rows, b_cols) = b.example(k);
    let mut u = Array2::<f64>::zeros((t, s));
    match (&a_rows, &b_rows) {
        (RowSide::Dense(x), RowSide::Dense(y)) => {
            product_into(1.0, x.view(), y.t(), Accumulate::Replace, u.view_mut());
        }
        (RowSide::OneHot(ix), RowSide::Dense(y)) => {
            lookup(&mut u, &y.view(), |p, q| (q, ix[p]));
        }
        (RowSide::Dense(x), RowSide::OneHot(iy)) => {
            lookup(&mut u, &x.view(), |p, q| (p, iy[q]));
        }
        (RowSide::OneHot(ix), RowSide::OneHot(iy)) => {
            u.indexed_iter_mut().for_each(|((p, q), v)| {
                *v = f64::from(u8::from(ix[p] == iy[q]));
            });
        }
    }
    match (&a_cols, &b_cols) {
        (ColSide::Ones, ColSide::Ones) => u.sum(),
        (ColSide::Dense(x), ColSide::Dense(y)) => {
            let mut v = Array2::<f64>::zeros((t, s));
            product_into(1.0, x.view(), y.t(), Accumulate::Replace, v.view_mut());
            Zip::from(&u).and(&v).fold(0.0, |acc, p, q| acc + p * q)
        }
        // Only a one-column layout mixes a ones side with a dense one (a linear site with one
        // input tied to a bias, say): v_t · 1 is the dense side's single value.
        (ColSide::Dense(x), ColSide::Ones) => {
            let x = x.column(0);
            Zip::indexed(&u).fold(0.0, |acc, (p, _), w| acc + w * x[p])
        }
        (ColSide::Ones, ColSide::Dense(y)) => {
            let y = y.column(0);
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
