//! The truth of a case: every example's norm, the Gram of the true gradients, and the reference's
//! factors, from which the true clipped sum of any claim is rebuilt (no clipper code).
//!
//! No example's whole gradient is ever held, so the judge's memory is the trace plus a few
//! blocks, whatever the model's size: a 0.5 B-parameter model's gradient is 4 GB an example in
//! f64, and keeping one per example is what once limited the audit to a batch of two. Each
//! site's own Gram and each tied pair's cross terms are taken by the cheaper of two routes
//! ([`GramRoute`]): the Gram identity on the factors ([`super::inner`], T×T products of width
//! d_in + d_out, nothing of d_in·d_out size), or the gradient written a block of rows at a time
//! (T·d_in·d_out an example). A language model's wide sites (T = 128 over d = 896..151936)
//! take the identity: rebuilding everything took ~70 s of a B = 4 audit at the Qwen2.5-0.5B
//! shape, most of it the 151936×896 head. A convolution stored as unfolded patches (1024
//! output positions over 576 × 64 at 32×32) is written out: its identity would cost 18 times
//! more an example.

use super::inner::{pair_cost, site_inner, SiteSides};
use crate::error::{Error, Result};
use ghost_oracle_reference::{product, Factors, Reference, SiteKind, Trace, GRADIENT_BLOCK_BYTES};
use ndarray::{Array2, Array3};
use rayon::iter::{IndexedParallelIterator, ParallelIterator};
use rayon::slice::ParallelSliceMut;
use std::cell::Cell;
use std::ops::Range;

thread_local! {
    /// Bytes of rebuilt gradient rows held at once, over all examples of a block: the reader's
    /// memory budget counts on [`GRADIENT_BLOCK_BYTES`]. A parameter's per-example gradients
    /// (a tied embedding and head's V×d included) are never held whole, only a block of rows
    /// (vocabulary entries) of each at a time. Tests shrink it to force many blocks.
    static BLOCK_BYTES: Cell<usize> = const { Cell::new(GRADIENT_BLOCK_BYTES) };
}

/// Runs `f` with blocks of at most `bytes` (at least one row), on this thread.
#[cfg(test)]
pub(crate) fn with_block_bytes<R>(bytes: usize, f: impl FnOnce() -> R) -> R {
    let before = BLOCK_BYTES.with(|b| b.replace(bytes));
    let r = f();
    BLOCK_BYTES.with(|b| b.set(before));
    r
}

/// Everything about a case that comes from the reference, not from the clipper.
#[derive(Clone, Debug)]
pub struct Truth<F = Array3<f64>> {
    /// n*_i, the true norm of each example, in batch order.
    pub norms: Vec<f64>,
    /// ⟨g_i*, g_k*⟩ for every pair of examples.
    pub gram: Vec<Vec<f64>>,
    /// 2⟨g_in, g_out⟩ / ‖g‖² per example, summed over shared parameters (`None` where ‖g‖ = 0).
    pub cross_share: Vec<Option<f64>>,
    /// The reference's f64 factors: the true gradients, rebuilt on demand. `None` for a truth
    /// given by hand (then a claim's clipped sum is not checked).
    pub factors: Option<Trace<F>>,
    /// (parameter, ‖g*_{i,p}‖² per example), in the trace's parameter order: how an example's
    /// gradient divides among tensors whose noise may differ. Empty for a truth given by hand.
    pub param_sq: Vec<(String, Vec<f64>)>,
}

/// The Gram of a trace's true gradients and, per example, Σ_{j≠k}⟨G_j, G_k⟩ over the sites of
/// every shared parameter.
pub(crate) struct GramAndCross {
    pub gram: Vec<Vec<f64>>,
    pub cross: Vec<f64>,
    pub param_sq: Vec<(String, Vec<f64>)>,
}

impl Truth {
    /// Norms and the split from the reference's materialized gradients; the Gram from its
    /// factors, whose diagonal must reproduce those norms (a reference whose trace disagrees
    /// with its own gradients is a bug, reported as such).
    pub fn from_reference(r: Reference) -> Result<Self> {
        let factors = r
            .trace
            .ok_or_else(|| Error::internal("reference ran without a trace"))?;
        let GramAndCross { gram, param_sq, .. } = gram_and_cross(&factors, GramRoute::ByCost)?;
        let norms: Vec<f64> = r.examples.iter().map(|e| e.norm).collect();
        for (i, n) in norms.iter().enumerate() {
            let (want, got) = (n * n, gram[i][i]);
            if (got - want).abs() > 1e-6 * want.max(got) {
                return Err(Error::internal(format!(
                    "example {i}: the reference's factors give ‖g‖² = {got:e}, its materialized gradient {want:e}"
                )));
            }
        }
        let cross_share = r
            .examples
            .iter()
            .map(|e| {
                share(
                    e.shared.iter().map(|(_, s)| 2.0 * s.cross).sum(),
                    e.norm * e.norm,
                )
            })
            .collect();
        Ok(Truth {
            norms,
            gram,
            cross_share,
            factors: Some(factors),
            param_sq,
        })
    }
}

impl<F: Factors> Truth<F> {
    /// The truth of any trace, from its factors alone (no materialized norms to agree with),
    /// widened to f64 an example at a time.
    pub fn from_trace(trace: Trace<F>) -> Result<Self> {
        Self::from_trace_with_progress(trace, &|_, _, _| {})
    }

    /// [`from_trace`](Self::from_trace), telling `progress(done, total, parameter)` as each
    /// parameter's Gram is taken.
    pub fn from_trace_with_progress(
        trace: Trace<F>,
        progress: &dyn Fn(usize, usize, &str),
    ) -> Result<Self> {
        Self::from_trace_routed(trace, GramRoute::ByCost, progress)
    }

    /// [`from_trace_with_progress`](Self::from_trace_with_progress) with every site's Gram
    /// taken by `route` ([`GramRoute::ByCost`] is what the judge uses; a forced route gives the
    /// same figures to f64 rounding, docs/tolerances.md, and is there to be timed and tested).
    pub fn from_trace_routed(
        trace: Trace<F>,
        route: GramRoute,
        progress: &dyn Fn(usize, usize, &str),
    ) -> Result<Self> {
        let GramAndCross {
            gram,
            cross,
            param_sq,
        } = gram_and_cross_with_progress(&trace, route, progress)?;
        let mut norms = Vec::with_capacity(gram.len());
        let mut cross_share = Vec::with_capacity(gram.len());
        for (i, row) in gram.iter().enumerate() {
            let total_sq = row[i];
            if !total_sq.is_finite() {
                return Err(Error::input(format!(
                    "example {i}: the squared gradient norm overflows f64"
                )));
            }
            norms.push(total_sq.sqrt());
            cross_share.push(share(cross[i], total_sq));
        }
        Ok(Truth {
            norms,
            gram,
            cross_share,
            factors: Some(trace),
            param_sq,
        })
    }
}

/// A block of rows of one parameter's gradient, in the parameter's layout.
pub(crate) struct Block<'a> {
    pub param: &'a str,
    /// The trace's sites that write the parameter.
    pub sites: &'a [usize],
    /// The parameter's number of values (rows × cols of the whole gradient).
    pub size: usize,
    pub rows: Range<usize>,
    pub cols: usize,
}

/// Rows per block of a `cols`-wide gradient when `examples` such blocks are held together.
fn block_rows(cols: usize, examples: usize) -> usize {
    let per_row = (cols * 8 * examples.max(1)).max(1);
    (BLOCK_BYTES.with(Cell::get) / per_row).max(1)
}

/// Visits every parameter of a trace in blocks of rows of its gradient's layout, in order, sized
/// so that `examples_per_block` such blocks fit in [`GRADIENT_BLOCK_BYTES`], after the trace's shapes are
/// checked (every site of a parameter writes one shape).
pub(crate) fn for_each_param_block<F: Factors>(
    trace: &Trace<F>,
    examples_per_block: usize,
    visit: &mut dyn FnMut(Block<'_>) -> Result<()>,
) -> Result<()> {
    trace.validate()?;
    for (param, js) in trace.params() {
        let (rows, cols) = trace.site_gradient_shape(js[0]);
        let step = block_rows(cols, examples_per_block);
        let mut start = 0;
        while start < rows {
            let end = (start + step).min(rows);
            visit(Block {
                param: &param,
                sites: &js,
                size: rows * cols,
                rows: start..end,
                cols,
            })?;
            start = end;
        }
    }
    Ok(())
}

/// How the Gram of a parameter's true gradients is taken: chosen by cost per site and per tied
/// pair of sites, or one route forced for every site (the tests hold the routes equal; the
/// `truth_gram` bench times each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GramRoute {
    /// Per site and per pair of sites of one parameter, whichever of the two below costs fewer
    /// multiply-adds (`site_route`, `pair_route`).
    ByCost,
    /// Every example's gradient of the site written a block of rows at a time, then dot
    /// products: rows·d_in·d_out per example for a dense site.
    Materialize,
    /// The Gram identity on the factors (`judge::inner`): rows²·(d_in + d_out) per
    /// pair of examples for a dense site, nothing of d_in·d_out size.
    Identity,
}

/// Multiply-adds of one B×B block of ⟨G_{x,i}, G_{y,k}⟩ by each route.
#[derive(Clone, Copy, Debug)]
struct RouteCost {
    materialize: f64,
    identity: f64,
}

impl RouteCost {
    fn cheaper(self) -> GramRoute {
        if self.identity < self.materialize {
            GramRoute::Identity
        } else {
            GramRoute::Materialize
        }
    }
}

/// Multiply-adds of writing one example's gradient of site `j`: every entry a sum over the
/// site's rows for a dense site (rows · d_in · d_out), a scatter of its rows for an embedding.
/// A convolution stored as its input is written from its unfolded rows (P·g of them,
/// [`ghost_oracle_reference::Site::rows`]), as its /1 twin is.
fn write_cost<F: Factors>(trace: &Trace<F>, j: usize) -> f64 {
    let site = &trace.sites[j];
    let (rows, cols) = trace.site_gradient_shape(j);
    let (t, out) = (site.row_count() as f64, site.backprops.dim().2 as f64);
    match site.spec.kind {
        SiteKind::Linear | SiteKind::Conv1d => t * (rows * cols) as f64,
        SiteKind::Embedding => t * out,
        SiteKind::Bias | SiteKind::LayerNorm => t * out * 2.0,
    }
}

/// Site `j`'s own B×B Gram: materializing writes each example's gradient once and takes
/// B(B+1)/2 dot products over its entries; the identity takes B(B+1)/2 pairs of T×T products.
/// The cost per example is the same for every example of a site (one row count per site), so
/// the choice per site is the choice per site and example.
fn own_cost<F: Factors>(
    trace: &Trace<F>,
    j: usize,
    side: &SiteSides<'_, F>,
    b: usize,
) -> RouteCost {
    let (rows, cols) = trace.site_gradient_shape(j);
    let (bf, pairs) = (b as f64, (b * (b + 1) / 2) as f64);
    RouteCost {
        materialize: bf * write_cost(trace, j) + pairs * (rows * cols) as f64,
        identity: pairs * pair_cost(side, side, rows, cols),
    }
}

/// The B×B cross block ⟨G_{j,i}, G_{k,l}⟩ of two sites of one parameter: materializing writes
/// the gradients of the sites not yet `written` and takes B² dot products; the identity takes
/// B² pairs of T×S products.
fn cross_cost<F: Factors>(
    trace: &Trace<F>,
    (j, k): (usize, usize),
    (a, c): (&SiteSides<'_, F>, &SiteSides<'_, F>),
    b: usize,
    written: [bool; 2],
) -> RouteCost {
    let (rows, cols) = trace.site_gradient_shape(j);
    let bf = b as f64;
    let mut materialize = bf * bf * (rows * cols) as f64;
    for (site, done) in [(j, written[0]), (k, written[1])] {
        if !done {
            materialize += bf * write_cost(trace, site);
        }
    }
    RouteCost {
        materialize,
        identity: bf * bf * pair_cost(a, c, rows, cols),
    }
}

/// The route [`GramRoute::ByCost`] takes for site `j`'s own Gram in a batch of `b`: for a
/// dense site, materializing when rows · d_in · d_out + (B+1)/2 · d_in · d_out is below
/// (B+1)/2 · rows² · (d_in + d_out + 1) (a convolution's many output positions over narrow
/// channels), the identity otherwise (a language model's few positions over wide features).
pub(super) fn site_route<F: Factors>(
    trace: &Trace<F>,
    j: usize,
    side: &SiteSides<'_, F>,
    b: usize,
) -> GramRoute {
    own_cost(trace, j, side, b).cheaper()
}

/// The route [`GramRoute::ByCost`] takes for the cross terms of sites `j` and `k` (one
/// parameter's two uses, `sides` theirs) in a batch of `b`, given whether each site's gradients
/// are written already for its own Gram (then writing them costs nothing more).
pub(super) fn pair_route<F: Factors>(
    trace: &Trace<F>,
    (j, k): (usize, usize),
    sides: (&SiteSides<'_, F>, &SiteSides<'_, F>),
    b: usize,
    written: [bool; 2],
) -> GramRoute {
    cross_cost(trace, (j, k), sides, b, written).cheaper()
}

/// `forced`, or the route `by_cost` chooses.
fn pick(forced: GramRoute, by_cost: impl FnOnce() -> GramRoute) -> GramRoute {
    match forced {
        GramRoute::ByCost => by_cost(),
        GramRoute::Materialize | GramRoute::Identity => forced,
    }
}

#[cfg(test)]
thread_local! {
    /// A route whose every figure the tests plant a relative error of 1e-6 in, to show the
    /// brute-force comparison catches a wrong route.
    static PLANTED: Cell<Option<GramRoute>> = const { Cell::new(None) };
}

/// Runs `f` with a planted error in every figure `route` computes, on this thread.
#[cfg(test)]
pub(crate) fn with_planted_error<R>(route: GramRoute, f: impl FnOnce() -> R) -> R {
    let before = PLANTED.with(|p| p.replace(Some(route)));
    let r = f();
    PLANTED.with(|p| p.set(before));
    r
}

#[cfg(test)]
fn planted(route: GramRoute) -> f64 {
    if PLANTED.with(Cell::get) == Some(route) {
        1.0 + 1e-6
    } else {
        1.0
    }
}

#[cfg(not(test))]
fn planted(_: GramRoute) -> f64 {
    1.0
}

pub(crate) fn gram_and_cross<F: Factors>(
    trace: &Trace<F>,
    route: GramRoute,
) -> Result<GramAndCross> {
    gram_and_cross_with_progress(trace, route, &|_, _, _| {})
}

fn gram_and_cross_with_progress<F: Factors>(
    trace: &Trace<F>,
    route: GramRoute,
    progress: &dyn Fn(usize, usize, &str),
) -> Result<GramAndCross> {
    trace.validate()?;
    let b = trace.batch_size();
    let mut gram = vec![vec![0.0; b]; b];
    let mut cross = vec![0.0; b];
    let mut param_sq: Vec<(String, Vec<f64>)> = Vec::new();
    let params = trace.params();
    let total = params.len();
    for (done, (param, js)) in params.into_iter().enumerate() {
        progress(done, total, &param);
        let (g, c) = param_gram_by_site(trace, &js, b, route)?;
        for ((i, k), v) in g.indexed_iter() {
            gram[i][k] += v;
        }
        for (x, c) in cross.iter_mut().zip(c) {
            *x += c;
        }
        param_sq.push((param, g.diag().to_vec()));
    }
    progress(total, total, "the Gram of the true gradients");
    Ok(GramAndCross {
        gram,
        cross,
        param_sq,
    })
}

/// One parameter's B×B Gram ⟨Σ_x G_{x,i}, Σ_y G_{y,k}⟩ and per example its cross-site part
/// Σ_{x≠y}⟨G_{x,i}, G_{y,i}⟩, as a sum of each site's own Gram and each pair's cross block,
/// every one by its own route: a convolution tied to nothing is written out while the LM head
/// beside it takes the identity, and a pair is written out where both its sites are (their dot
/// products are then all it costs) or writing is cheaper for it.
fn param_gram_by_site<F: Factors>(
    trace: &Trace<F>,
    js: &[usize],
    b: usize,
    route: GramRoute,
) -> Result<(Array2<f64>, Vec<f64>)> {
    let sides: Vec<SiteSides<'_, F>> = js.iter().map(|&j| SiteSides::of(trace, j)).collect();
    let own: Vec<GramRoute> = js
        .iter()
        .zip(&sides)
        .map(|(&j, side)| pick(route, || site_route(trace, j, side, b)))
        .collect();
    let mut written: Vec<bool> = own.iter().map(|r| *r == GramRoute::Materialize).collect();
    let mut pairs = Vec::new();
    for x in 0..js.len() {
        for y in x + 1..js.len() {
            let r = pick(route, || {
                pair_route(
                    trace,
                    (js[x], js[y]),
                    (&sides[x], &sides[y]),
                    b,
                    [written[x], written[y]],
                )
            });
            if r == GramRoute::Materialize {
                written[x] = true;
                written[y] = true;
            }
            pairs.push((x, y, r));
        }
    }
    let mut gram = Array2::<f64>::zeros((b, b));
    let mut cross = vec![0.0; b];
    let bump = planted(GramRoute::Identity);
    for (x, side) in sides.iter().enumerate() {
        if own[x] == GramRoute::Identity {
            add_own(&mut gram, b, |i, k| bump * site_inner(side, i, side, k));
        }
    }
    for &(x, y, r) in &pairs {
        if r == GramRoute::Identity {
            let (a, c) = (&sides[x], &sides[y]);
            add_cross(&mut gram, &mut cross, b, |i, k| {
                bump * site_inner(a, i, c, k)
            });
        }
    }
    drop(sides);
    if written.iter().any(|&w| w) {
        let own_written: Vec<bool> = own.iter().map(|r| *r == GramRoute::Materialize).collect();
        let pairs_written: Vec<(usize, usize)> = pairs
            .iter()
            .filter(|p| p.2 == GramRoute::Materialize)
            .map(|&(x, y, _)| (x, y))
            .collect();
        let parts = Written {
            sites: &written,
            own: &own_written,
            pairs: &pairs_written,
        };
        add_written(trace, js, b, &parts, &mut gram, &mut cross)?;
    }
    Ok((gram, cross))
}

/// Adds a site's own Gram, `inner(i, k)` = ⟨G_i, G_k⟩, each pair of examples once.
fn add_own(gram: &mut Array2<f64>, b: usize, mut inner: impl FnMut(usize, usize) -> f64) {
    for i in 0..b {
        for k in i..b {
            let v = inner(i, k);
            gram[(i, k)] += v;
            if k != i {
                gram[(k, i)] += v;
            }
        }
    }
}

/// Adds a pair of sites' cross block, `inner(i, k)` = ⟨G_{x,i}, G_{y,k}⟩: the parameter's
/// (i, k) entry holds it and ⟨G_{y,i}, G_{x,k}⟩ = inner(k, i), so every (i, k) is added to
/// both entries; the diagonal, twice, is example i's cross-site part.
fn add_cross(
    gram: &mut Array2<f64>,
    cross: &mut [f64],
    b: usize,
    mut inner: impl FnMut(usize, usize) -> f64,
) {
    for i in 0..b {
        for k in 0..b {
            let v = inner(i, k);
            gram[(i, k)] += v;
            gram[(k, i)] += v;
            if i == k {
                cross[i] += 2.0 * v;
            }
        }
    }
}

/// Which of a parameter's sites are written out, and which own Grams and cross blocks are
/// taken from the written gradients (indices into the parameter's sites).
struct Written<'a> {
    sites: &'a [bool],
    own: &'a [bool],
    pairs: &'a [(usize, usize)],
}

/// The own Grams and cross blocks of `parts` from every example's gradient of the written
/// sites, rebuilt a block of rows at a time by the reference's own brute force
/// ([`RefTrace::add_site_gradient_rows`]) and held B × (written sites) blocks at once. The
/// examples are rebuilt in parallel, each into its row of a B × (rows · cols) matrix M, and the
/// B(B+1)/2 dot products of a block are one product M Mᵀ (M_x M_yᵀ for a pair): at B = 256 over a
/// 2.7 M-parameter network, one pairwise dot product at a time was most of `check`'s time.
fn add_written<F: Factors>(
    trace: &Trace<F>,
    js: &[usize],
    b: usize,
    parts: &Written<'_>,
    gram: &mut Array2<f64>,
    cross: &mut [f64],
) -> Result<()> {
    let bump = planted(GramRoute::Materialize);
    let sites: Vec<usize> = (0..js.len()).filter(|&x| parts.sites[x]).collect();
    let slot = |x: usize| {
        sites
            .iter()
            .position(|&s| s == x)
            .expect("a written part reads written sites")
    };
    let (rows, cols) = trace.site_gradient_shape(js[0]);
    let step = block_rows(cols, b * sites.len());
    let mut start = 0;
    while start < rows {
        let block = start..(start + step).min(rows);
        start = block.end;
        // grads[s]: row i is example i's rows `block` at written site s, flattened.
        let mut grads: Vec<Array2<f64>> = Vec::with_capacity(sites.len());
        for &x in &sites {
            grads.push(written_block(trace, js[x], b, block.clone(), cols)?);
        }
        for x in (0..js.len()).filter(|&x| parts.own[x]) {
            let g = &grads[slot(x)];
            *gram += &(ghost_oracle_reference::gram(g.view()) * bump);
        }
        for &(x, y) in parts.pairs {
            let (gx, gy) = (&grads[slot(x)], &grads[slot(y)]);
            // v[(i, k)] = ⟨G_{x,i}, G_{y,k}⟩.
            let v = product(gx.view(), gy.t());
            add_cross(gram, cross, b, |i, k| bump * v[(i, k)]);
        }
    }
    Ok(())
}

/// Every example's gradient of site `j`, rows `block` of the parameter's layout, as the rows of
/// one B × (block.len() · cols) matrix, the examples rebuilt in parallel.
fn written_block<F: Factors>(
    trace: &Trace<F>,
    j: usize,
    b: usize,
    block: Range<usize>,
    cols: usize,
) -> Result<Array2<f64>> {
    let width = block.len() * cols;
    let mut m = Array2::<f64>::zeros((b, width));
    m.as_slice_mut()
        .expect("a freshly allocated matrix is contiguous")
        .par_chunks_mut(width.max(1))
        .enumerate()
        .try_for_each(|(i, row)| -> Result<()> {
            let mut weights = vec![0.0; b];
            weights[i] = 1.0;
            let mut g = Array2::zeros((block.len(), cols));
            trace.add_site_gradient_rows(j, &weights, block.clone(), &mut g)?;
            row.copy_from_slice(
                g.as_slice()
                    .expect("a freshly allocated block is contiguous"),
            );
            Ok(())
        })?;
    Ok(m)
}

/// x / n², undefined for a zero gradient.
fn share(x: f64, n2: f64) -> Option<f64> {
    (n2 > 0.0).then(|| x / n2)
}

#[cfg(test)]
#[path = "truth_tests.rs"]
pub(crate) mod tests;
