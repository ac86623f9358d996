//! The truth of a case: every example's norm, the Gram of the true gradients, and the reference's
//! factors, from which the true clipped sum of any claim is rebuilt (no clipper code).
//!
//! No example's whole gradient is ever held. The true gradients are rebuilt from the f64 trace a
//! block of rows at a time ([`for_each_block`]), so the judge's memory is the trace plus a few
//! blocks, whatever the model's size: a 0.5 B-parameter model's gradient is 4 GB an example in
//! f64, and keeping one per example is what once limited the audit to a batch of two.

use crate::error::{Error, Result};
use ghost_oracle_reference::{Reference, Trace as RefTrace};
use ndarray::{Array2, ArrayView1};
use std::ops::Range;

/// Bytes of rebuilt gradient rows held at once, over all examples of a block.
const BLOCK_BYTES: usize = 64 << 20;

/// Everything about a case that comes from the reference, not from the clipper.
#[derive(Clone, Debug)]
pub struct Truth {
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
struct GramAndCross {
    gram: Vec<Vec<f64>>,
    cross: Vec<f64>,
    param_sq: Vec<(String, Vec<f64>)>,
}

impl Truth {
    /// Norms and the split from the reference's materialized gradients; the Gram from its
    /// factors, whose diagonal must reproduce those norms (a reference whose trace disagrees
    /// with its own gradients is a bug, reported as such).
    pub fn from_reference(r: Reference) -> Result<Self> {
        let factors = r
            .trace
            .ok_or_else(|| Error::internal("reference ran without a trace"))?;
        let GramAndCross { gram, param_sq, .. } = gram_and_cross(&factors)?;
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

    /// The truth of any trace, by the reference's brute force: every site's gradient
    /// materialized in f64 (a block of rows at a time), sites of a parameter summed.
    pub fn from_trace(trace: RefTrace) -> Result<Self> {
        let GramAndCross {
            gram,
            cross,
            param_sq,
        } = gram_and_cross(&trace)?;
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

/// Visits every parameter of a trace in blocks of rows of its gradient's layout, in order, sized
/// so that `examples_per_block` such blocks fit in [`BLOCK_BYTES`], after the trace's shapes are
/// checked (every site of a parameter writes one shape).
pub(crate) fn for_each_param_block(
    trace: &RefTrace,
    examples_per_block: usize,
    visit: &mut dyn FnMut(Block<'_>) -> Result<()>,
) -> Result<()> {
    trace.validate()?;
    for (param, js) in trace.params() {
        let (rows, cols) = trace.site_gradient_shape(js[0]);
        let per_row = (cols * 8 * examples_per_block.max(1)).max(1);
        let step = (BLOCK_BYTES / per_row).max(1);
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

fn gram_and_cross(trace: &RefTrace) -> Result<GramAndCross> {
    let b = trace.batch_size();
    let mut gram = vec![vec![0.0; b]; b];
    let mut cross = vec![0.0; b];
    let mut param_sq: Vec<(String, Vec<f64>)> = Vec::new();
    for_each_param_block(trace, b, &mut |block| {
        let Block {
            param,
            sites: js,
            rows,
            cols,
            ..
        } = block;
        if param_sq.last().is_none_or(|(p, _)| p != param) {
            param_sq.push((param.to_string(), vec![0.0; b]));
        }
        let sq = &mut param_sq.last_mut().expect("pushed above").1;
        let mut grads = Vec::with_capacity(b);
        for i in 0..b {
            let mut weights = vec![0.0; b];
            weights[i] = 1.0;
            let mut sum = Array2::zeros((rows.len(), cols));
            if js.len() == 1 {
                trace.add_site_gradient_rows(js[0], &weights, rows.clone(), &mut sum)?;
            } else {
                // Σ_{j≠k}⟨G_j, G_k⟩ = ‖Σ_j G_j‖² − Σ_j ‖G_j‖², block by block.
                for &j in js {
                    let mut g = Array2::zeros((rows.len(), cols));
                    trace.add_site_gradient_rows(j, &weights, rows.clone(), &mut g)?;
                    cross[i] -= flat_dot(&g, &g);
                    sum += &g;
                }
                cross[i] += flat_dot(&sum, &sum);
            }
            grads.push(sum);
        }
        for i in 0..b {
            for k in i..b {
                let d = flat_dot(&grads[i], &grads[k]);
                gram[i][k] += d;
                if k != i {
                    gram[k][i] += d;
                } else {
                    sq[i] += d;
                }
            }
        }
        Ok(())
    })?;
    Ok(GramAndCross {
        gram,
        cross,
        param_sq,
    })
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
