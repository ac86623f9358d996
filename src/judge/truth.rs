//! The truth of a case: every example's norm, the Gram of the true gradients, and the reference's
//! factors, from which the true clipped sum of any claim is rebuilt (no clipper code).
//!
//! No example's whole gradient is ever held, so the judge's memory is the trace plus a few
//! blocks, whatever the model's size: a 0.5 B-parameter model's gradient is 4 GB an example in
//! f64, and keeping one per example is what once limited the audit to a batch of two. The Gram
//! is taken per parameter by the cheaper of two routes: the Gram identity on the factors
//! ([`super::inner`], T×T products, nothing of rows·cols size), or the gradient rebuilt a block
//! of rows at a time ([`for_each_param_block`]) where rows·cols is small next to T² times the
//! widths. Rebuilding everything took ~70 s of a B = 4 audit at the Qwen2.5-0.5B shape, most of
//! it the 151936×896 head, whose identity route needs only T×T products over the vocabulary.

use super::inner::{pair_cost, param_gram, SiteSides};
use crate::error::{Error, Result};
use ghost_oracle_reference::{Reference, SiteKind, Trace as RefTrace, GRADIENT_BLOCK_BYTES};
use ndarray::{Array2, ArrayView1};
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
pub struct Truth {
    /// n*_i, the true norm of each example, in batch order.
    pub norms: Vec<f64>,
    /// ⟨g_i*, g_k*⟩ for every pair of examples.
    pub gram: Vec<Vec<f64>>,
    /// 2⟨g_in, g_out⟩ / ‖g‖² per example, summed over shared parameters (`None` where ‖g‖ = 0).
    pub cross_share: Vec<Option<f64>>,
    /// The reference's f64 factors: the true gradients, rebuilt on demand. `None` for a truth
    /// given by hand (then a claim's clipped sum is not checked).
    pub factors: Option<RefTrace>,
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
        let GramAndCross { gram, param_sq, .. } = gram_and_cross(&factors, Route::ByCost)?;
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

    /// The truth of any trace, from its f64 factors alone (no materialized norms to agree with).
    pub fn from_trace(trace: RefTrace) -> Result<Self> {
        Self::from_trace_with_progress(trace, &|_, _, _| {})
    }

    /// [`from_trace`](Self::from_trace), telling `progress(done, total, parameter)` as each
    /// parameter's Gram is taken.
    pub fn from_trace_with_progress(
        trace: RefTrace,
        progress: &dyn Fn(usize, usize, &str),
    ) -> Result<Self> {
        let GramAndCross {
            gram,
            cross,
            param_sq,
        } = gram_and_cross_with_progress(&trace, Route::ByCost, progress)?;
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
pub(crate) fn for_each_param_block(
    trace: &RefTrace,
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

/// How the Gram of a parameter's true gradients is taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(
    not(test),
    expect(
        dead_code,
        reason = "the forced routes are what the tests hold to the brute force"
    )
)]
pub(crate) enum Route {
    /// Per parameter, whichever of the two below costs fewer multiply-adds.
    ByCost,
    /// Every example's gradient materialized a block of rows at a time, then dot products.
    Materialize,
    /// The Gram identity on the factors ([`inner`](super::inner)).
    Identity,
}

/// Multiply-adds of a parameter's B×B Gram by each route: (materializing, the identity).
///
/// Materializing writes every example's rows·cols entries (each a sum over T for a dense site,
/// a scatter for an embedding) and takes B(B+1)/2 dot products over them; the identity takes
/// T·S products of width rows + cols for every pair of examples and sites. At the Qwen2.5-0.5B
/// shape with B = 4, T = 128 the identity wins for the head (V×d against T²·(V + d)) and the
/// MLP, materializing for the narrow key/value projections, biases and norms.
fn route_costs(trace: &RefTrace, js: &[usize], sides: &[SiteSides<'_>], b: usize) -> (f64, f64) {
    let (rows, cols) = trace.site_gradient_shape(js[0]);
    let entries = (rows * cols) as f64;
    let bf = b as f64;
    let pairs = bf * (bf + 1.0) / 2.0;
    let mut materialize = bf * entries + pairs * entries;
    if js.len() > 1 {
        // Each site's block apart, its own dot product and the sum.
        materialize += bf * js.len() as f64 * 2.0 * entries;
    }
    let mut identity = 0.0;
    for (x, &j) in js.iter().enumerate() {
        let site = &trace.sites[j];
        let t = site.backprops.dim().1 as f64;
        let out = site.backprops.dim().2 as f64;
        materialize += bf
            * match site.spec.kind {
                SiteKind::Linear | SiteKind::Conv1d => t * entries,
                SiteKind::Embedding => t * out,
                SiteKind::Bias | SiteKind::LayerNorm => t * out * 2.0,
            };
        identity += pairs * pair_cost(&sides[x], &sides[x], rows, cols);
        for y in sides.iter().skip(x + 1) {
            identity += bf * bf * pair_cost(&sides[x], y, rows, cols);
        }
    }
    (materialize, identity)
}

pub(crate) fn gram_and_cross(trace: &RefTrace, route: Route) -> Result<GramAndCross> {
    gram_and_cross_with_progress(trace, route, &|_, _, _| {})
}

fn gram_and_cross_with_progress(
    trace: &RefTrace,
    route: Route,
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
        let sides: Vec<SiteSides<'_>> = js.iter().map(|&j| SiteSides::of(trace, j)).collect();
        let identity = match route {
            Route::ByCost => {
                let (materialize, identity) = route_costs(trace, &js, &sides, b);
                identity < materialize
            }
            Route::Materialize => false,
            Route::Identity => true,
        };
        let (g, c) = if identity {
            param_gram(&sides, b)
        } else {
            drop(sides);
            materialized_param_gram(trace, &js, b)?
        };
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

/// One parameter's B×B Gram and cross-site parts, every example's gradient rebuilt a block of
/// rows at a time by the reference's own brute force.
fn materialized_param_gram(
    trace: &RefTrace,
    js: &[usize],
    b: usize,
) -> Result<(Array2<f64>, Vec<f64>)> {
    let mut gram = Array2::<f64>::zeros((b, b));
    let mut cross = vec![0.0; b];
    let (rows, cols) = trace.site_gradient_shape(js[0]);
    let step = block_rows(cols, b);
    let mut start = 0;
    while start < rows {
        let block = start..(start + step).min(rows);
        start = block.end;
        let mut grads = Vec::with_capacity(b);
        for (i, cross_i) in cross.iter_mut().enumerate() {
            let mut weights = vec![0.0; b];
            weights[i] = 1.0;
            let mut sum = Array2::zeros((block.len(), cols));
            if js.len() == 1 {
                trace.add_site_gradient_rows(js[0], &weights, block.clone(), &mut sum)?;
            } else {
                // Σ_{j≠k}⟨G_j, G_k⟩ = ‖Σ_j G_j‖² − Σ_j ‖G_j‖², block by block.
                for &j in js {
                    let mut g = Array2::zeros((block.len(), cols));
                    trace.add_site_gradient_rows(j, &weights, block.clone(), &mut g)?;
                    *cross_i -= flat_dot(&g, &g);
                    sum += &g;
                }
                *cross_i += flat_dot(&sum, &sum);
            }
            grads.push(sum);
        }
        for i in 0..b {
            for k in i..b {
                let d = flat_dot(&grads[i], &grads[k]);
                gram[(i, k)] += d;
                if k != i {
                    gram[(k, i)] += d;
                }
            }
        }
    }
    Ok((gram, cross))
}

/// ⟨a, b⟩ of two blocks of one shape, as flat vectors (blocks are allocated here, contiguous).
fn flat_dot(a: &Array2<f64>, b: &Array2<f64>) -> f64 {
    fn flat(m: &Array2<f64>) -> ArrayView1<'_, f64> {
        ArrayView1::from(
            m.as_slice()
                .expect("a freshly allocated block is contiguous"),
        )
    }
    flat(a).dot(&flat(b))
}

/// x / n², undefined for a zero gradient.
fn share(x: f64, n2: f64) -> Option<f64> {
    (n2 > 0.0).then(|| x / n2)
}

#[cfg(test)]
#[path = "truth_tests.rs"]
mod tests;
