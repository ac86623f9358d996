//! A claimed sum (the clipped sum, or the update times its divisor) against S* = Σ_i c*_i g_i*,
//! and its decomposition against the batch's own gradients: ĉ = G⁺b with G_ik = ⟨g_i*, g_k*⟩
//! and b_i = ⟨g_i*, X⟩, the coefficients the sum implies.

use crate::error::{Error, Result};
use crate::judge::example::ExampleMetrics;
use crate::judge::numeric::{bilinear, ratio, GramSolver};
use crate::judge::tolerance::{Arithmetic, Tolerance};
use crate::judge::truth::{for_each_param_block, Block, Truth};
use crate::judge::verdict::Verdict;
use ghost_oracle_reference::{Factors, Floats, Trace};
use ndarray::Array2;
use rayon::prelude::*;
use serde::Serialize;
use std::ops::Range;

/// Which sum of the step a check judges.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum SumKind {
    /// Σ_i c_i g_i before noise, as the library holds it.
    #[serde(rename = "clipped sum")]
    ClippedSum,
    /// The update times the divisor the step states, u·D (judged as a sum without noise only).
    #[serde(rename = "update × divisor")]
    Update,
}

impl SumKind {
    /// `clipped sum` or `update × divisor`, as reports name it.
    pub fn name(self) -> &'static str {
        match self {
            SumKind::ClippedSum => "clipped sum",
            SumKind::Update => "update × divisor",
        }
    }
}

/// One claimed sum (the clipped sum, or the update times its divisor) against S*.
#[derive(Clone, Debug, Serialize)]
pub struct SumCheck {
    /// Which sum.
    pub what: SumKind,
    /// ‖X − S*‖ / ‖S*‖ and the rounding bound on it (`null` where S* = 0).
    pub rel_err: Option<f64>,
    /// The rounding bound on `rel_err`.
    pub bound: Option<f64>,
    /// The parameter whose sum is furthest off, relative to its own ‖S*_p‖.
    pub worst_param: String,
    /// ‖X_p − S*_p‖ / ‖S*_p‖ of `worst_param` (`null` where S*_p = 0).
    pub worst_param_rel_err: Option<f64>,
    /// ⟨X, S*⟩ / ‖S*‖²: a wrong divisor scales the whole sum by this.
    pub scale: Option<f64>,
    /// ĉ = G⁺b, the coefficients X implies, and the largest ĉ_i n*_i / C.
    pub implied_coefficients: Vec<f64>,
    /// max_i ĉ_i n*_i / C: above 1, the sum spends more privacy than stated.
    pub implied_sensitivity: f64,
    /// ĉ_i plus the most the sum's rounding bound can move it: the high end, for privacy.
    pub coefficient_high: Vec<f64>,
    /// Examples the sum leaves out: ĉ_i under half of c*_i (a lost micro-batch has ĉ_i = 0 for
    /// its examples). Empty where the Gram is singular, since ĉ is then one of many.
    pub missing_examples: Vec<usize>,
    /// X is S* times one positive scale, beyond rounding: every example's implied coefficient is
    /// the true one times `scale`. For the update, the divisor it was divided by is another
    /// than the stated one ([`SumCheck::scaled_by_divisor`]).
    pub shared_scale: bool,
    /// ‖X − Σ_i ĉ_i g_i*‖ / ‖X‖: the part of X outside the span of the batch's gradients.
    pub unexplained: Option<f64>,
    /// G was singular (e.g. two identical examples): ĉ is the minimum-norm solution, one of
    /// many, and no privacy verdict is drawn from it.
    pub singular: bool,
    /// Some value of X is NaN or infinite.
    pub invalid: bool,
    /// Pass, a utility distortion or a privacy violation, from the figures above.
    pub verdict: Verdict,
}

impl SumCheck {
    /// The update is S* times one scale: divided by another divisor than the stated one, which
    /// scales signal and noise alike and leaves what the noise buys unchanged.
    pub fn scaled_by_divisor(&self) -> bool {
        self.what == SumKind::Update && self.shared_scale
    }
}

/// What every sum of one step is judged against: the truth, its tolerance, the norms' metrics
/// of the clipper that took the step, the true coefficients c*_i and C.
pub(super) struct SumContext<'a, F> {
    pub truth: &'a Truth<F>,
    pub tolerance: &'a Tolerance,
    pub arithmetic: &'a Arithmetic,
    pub examples: &'a [ExampleMetrics],
    pub true_coefficients: &'a [f64],
    pub max_grad_norm: f64,
}

/// A claimed sum: its values per parameter and what they are multiplied by before they are
/// compared (the update's stated divisor, 1 for the clipped sum).
pub(super) struct ClaimedSum<'a> {
    pub what: SumKind,
    pub values: &'a [(String, Floats)],
    pub scale: f64,
}

impl<'a> ClaimedSum<'a> {
    /// The clipped sum K, as it is.
    pub fn clipped_sum(values: &'a [(String, Floats)]) -> Self {
        ClaimedSum {
            what: SumKind::ClippedSum,
            values,
            scale: 1.0,
        }
    }

    /// The update u, times the divisor D the step states.
    pub fn update(values: &'a [(String, Floats)], divisor: f64) -> Self {
        ClaimedSum {
            what: SumKind::Update,
            values,
            scale: divisor,
        }
    }
}

/// Σ_i c_i g_i* rebuilt block by block against a claimed X, with everything the decomposition
/// needs: ‖X − S*‖², ‖S*‖², ⟨X, S*⟩, ‖X‖², b_i = ⟨g_i*, X⟩, and the same per parameter.
pub(super) struct Sums {
    pub err2: f64,
    pub ref2: f64,
    pub cross: f64,
    pub x2: f64,
    pub b: Vec<f64>,
    /// (parameter, ‖X_p − S*_p‖², ‖S*_p‖²).
    pub per_param: Vec<(String, f64, f64)>,
    /// ‖X − Σ a_i g_i*‖² and ‖Σ a_i g_i*‖² for other coefficients a, when asked for: the
    /// clipper's own, from the same gradients.
    pub other: Option<(f64, f64)>,
}

/// `claimed` is read times `scale` (an update times its divisor), a block at a time; `other`
/// coefficients are compared with in the same pass.
pub(super) fn sums<F: Factors>(
    truth: &Truth<F>,
    coefs: &[f64],
    claimed: &[(String, Floats)],
    scale: f64,
    other: Option<&[f64]>,
) -> Result<Sums> {
    sums_in_tiles(truth, coefs, claimed, scale, other, TILE_BYTES)
}

/// [`sums`] with tiles of about `tile_bytes` of one example's rows (at least one row).
fn sums_in_tiles<F: Factors>(
    truth: &Truth<F>,
    coefs: &[f64],
    claimed: &[(String, Floats)],
    scale: f64,
    other: Option<&[f64]>,
    tile_bytes: usize,
) -> Result<Sums> {
    let factors = truth
        .factors
        .as_ref()
        .ok_or_else(|| Error::internal("the step is judged from the reference's factors"))?;
    let n = coefs.len();
    let mut s = Sums {
        err2: 0.0,
        ref2: 0.0,
        cross: 0.0,
        x2: 0.0,
        b: vec![0.0; n],
        per_param: Vec::new(),
        other: other.map(|_| (0.0, 0.0)),
    };
    for_each_param_block(factors, n, &mut |block| {
        let Block {
            param,
            sites,
            size,
            rows,
            cols,
        } = block;
        let x = &claimed
            .iter()
            .find(|(p, _)| p == param)
            .ok_or_else(|| Error::input(format!("the step has no sum for parameter `{param}`")))?
            .1;
        if x.len() != size {
            return Err(Error::input(format!(
                "the step's sum of `{param}` has {} values; expected {size}",
                x.len()
            )));
        }
        // Tiles of rows small enough that an example's rows, S*'s and the other sum's stay in
        // a core's cache while every example is folded in: the rebuilt gradients never go to
        // memory. The tiles run on every core; their sums are added in tile order, so the
        // result does not depend on how the pool split the work.
        let tile = (tile_bytes / (cols * 8).max(1)).max(1);
        let tiles: Vec<Range<usize>> = rows
            .clone()
            .step_by(tile)
            .map(|r| r..(r + tile).min(rows.end))
            .collect();
        let folded: Vec<Result<TileSums>> = tiles
            .into_par_iter()
            .map(|r| {
                let mut x = x.widened(r.start * cols..r.end * cols);
                if scale != 1.0 {
                    x.to_mut().iter_mut().for_each(|v| *v *= scale);
                }
                tile_sums(factors, sites, r, cols, &x, coefs, other)
            })
            .collect();
        let mut totals = BlockTotals::default();
        for t in folded {
            let t = t?;
            for (b, tb) in s.b.iter_mut().zip(&t.b) {
                *b += tb;
            }
            totals = totals.add(t.totals);
        }
        if let Some((e2, r2)) = s.other.as_mut() {
            *e2 += totals.other_err2;
            *r2 += totals.other_ref2;
        }
        s.add_block(param, &totals);
        Ok(())
    })?;
    Ok(s)
}

/// Bytes of one example's rebuilt rows in a tile: with S*'s and the other sum's, three such
/// buffers stay within this machine's 4 MiB of cache a core, and the products stay tall enough
/// for the kernels (tiles of 512 KiB to 8 MiB took the same time at 1B width).
const TILE_BYTES: usize = 2 << 20;

/// What a tile of rows adds to the sums: b_i over its rows, and its [`BlockTotals`].
struct TileSums {
    b: Vec<f64>,
    totals: BlockTotals,
}

/// Rows `rows` (`cols` wide) of every example's gradient rebuilt from the factors, one example
/// at a time, against X's same rows `x`: S* = Σ c_i g_i*, the other coefficients' Σ a_i g_i*,
/// and b_i = ⟨g_i*, X⟩.
fn tile_sums<F: Factors>(
    factors: &Trace<F>,
    sites: &[usize],
    rows: Range<usize>,
    cols: usize,
    x: &[f64],
    coefs: &[f64],
    other: Option<&[f64]>,
) -> Result<TileSums> {
    let n = coefs.len();
    let mut want = vec![0.0; x.len()];
    let mut want_other = other.map(|_| vec![0.0; x.len()]);
    let mut g = Array2::<f64>::zeros((rows.len(), cols));
    let mut b = vec![0.0; n];
    let mut unit = vec![0.0; n];
    for i in 0..n {
        if i > 0 {
            unit[i - 1] = 0.0;
            g.fill(0.0);
        }
        unit[i] = 1.0;
        for &j in sites {
            factors.add_site_gradient_rows(j, &unit, rows.clone(), &mut g)?;
        }
        let g = g.as_slice().expect("a fresh array is contiguous");
        let c = coefs[i];
        let mut dot = 0.0;
        for ((w, g), v) in want.iter_mut().zip(g).zip(x) {
            *w += c * g;
            dot += g * v;
        }
        b[i] = dot;
        if let (Some(o), Some(a)) = (want_other.as_mut(), other) {
            for (o, g) in o.iter_mut().zip(g) {
                *o += a[i] * g;
            }
        }
    }
    let mut t = BlockTotals::default();
    for (w, v) in want.iter().zip(x) {
        t.err2 += (v - w) * (v - w);
        t.ref2 += w * w;
        t.cross += v * w;
        t.x2 += v * v;
    }
    if let Some(o) = &want_other {
        for (w, v) in o.iter().zip(x) {
            t.other_err2 += (v - w) * (v - w);
            t.other_ref2 += w * w;
        }
    }
    Ok(TileSums { b, totals: t })
}

/// A block's S* (`want`) against X, and the other coefficients' sum against X.
#[derive(Clone, Copy, Debug, Default)]
struct BlockTotals {
    err2: f64,
    ref2: f64,
    cross: f64,
    x2: f64,
    other_err2: f64,
    other_ref2: f64,
}

impl BlockTotals {
    fn add(mut self, o: BlockTotals) -> Self {
        self.err2 += o.err2;
        self.ref2 += o.ref2;
        self.cross += o.cross;
        self.x2 += o.x2;
        self.other_err2 += o.other_err2;
        self.other_ref2 += o.other_ref2;
        self
    }
}

impl Sums {
    /// One block's totals, added to the whole and to its parameter's.
    fn add_block(&mut self, param: &str, t: &BlockTotals) {
        self.err2 += t.err2;
        self.ref2 += t.ref2;
        self.cross += t.cross;
        self.x2 += t.x2;
        match self.per_param.last_mut() {
            Some((p, pe, pr)) if p == param => {
                *pe += t.err2;
                *pr += t.ref2;
            }
            Some(_) | None => self.per_param.push((param.to_string(), t.err2, t.ref2)),
        }
    }
}

/// What X implies of each example, from ĉ = G⁺b.
struct Implied {
    coefficients: Vec<f64>,
    /// ĉ_i plus how far the sum's rounding alone could move it.
    high: Vec<f64>,
    /// max_i ĉ_i n*_i / C, and the same at the low end of each ĉ_i.
    sensitivity: f64,
    low_sensitivity: f64,
    /// ‖X − Σ_i ĉ_i g_i*‖².
    unexplained2: f64,
    singular: bool,
}

/// Decomposes X against the batch's gradients. An error δ of X moves ĉ by G⁺⟨g, δ⟩, whose i-th
/// entry is at most √(G⁺)_ii·‖δ‖ (Cauchy–Schwarz in G's metric): a nearly dependent batch makes
/// ĉ uncertain, and that must not read as a contribution above C.
fn implied<F: Factors>(ctx: &SumContext<F>, s: &Sums, bound: f64) -> Implied {
    let (gram, norms, c) = (&ctx.truth.gram, &ctx.truth.norms, ctx.max_grad_norm);
    let n = ctx.true_coefficients.len();
    let solver = GramSolver::new(gram);
    let coefficients = solver.solve(&s.b);
    let explained: f64 = coefficients.iter().zip(&s.b).map(|(ci, bi)| ci * bi).sum();
    let unexplained2 =
        (s.x2 - 2.0 * explained + bilinear(gram, &coefficients, &coefficients)).max(0.0);
    let spread: Vec<f64> = (0..n)
        .map(|i| {
            let mut unit = vec![0.0; n];
            unit[i] = 1.0;
            solver.solve(&unit)[i].max(0.0).sqrt() * bound
        })
        .collect();
    let sensitivity = |i: usize, ci: f64| ci * norms[i] / c;
    Implied {
        sensitivity: (0..n)
            .map(|i| sensitivity(i, coefficients[i]))
            .fold(0.0, f64::max),
        low_sensitivity: (0..n)
            .map(|i| sensitivity(i, coefficients[i] - spread[i]))
            .fold(0.0, f64::max),
        high: coefficients
            .iter()
            .zip(&spread)
            .map(|(a, b)| a + b)
            .collect(),
        coefficients,
        unexplained2,
        singular: solver.rank() < n,
    }
}

/// Judges one claimed sum X against S* = Σ c*_i g_i*. With `other` coefficients, also returns
/// ‖X − Σ a_i g_i*‖ and ‖Σ a_i g_i*‖ at them, from the same rebuilt gradients.
pub(super) fn check_sum<F: Factors>(
    ctx: &SumContext<F>,
    claimed: &ClaimedSum,
    other: Option<&[f64]>,
) -> Result<(SumCheck, Option<(f64, f64)>)> {
    let coefs = ctx.true_coefficients;
    let invalid = claimed.values.iter().any(|(_, v)| v.any_non_finite());
    let s = sums(ctx.truth, coefs, claimed.values, claimed.scale, other)?;
    let other_sums = s.other.map(|(e2, r2)| (e2.sqrt(), r2.sqrt()));
    let reference = s.ref2.sqrt();
    // Rounding of the sum itself, the coefficients' share of the norms' rounding (each c_i may
    // be off by 2·bound_i·c*_i), and, for the update, the division's rounding.
    let coefficient_slack: f64 = ctx
        .examples
        .iter()
        .zip(coefs)
        .map(|(e, ci)| 2.0 * e.bound * ci * e.true_norm)
        .sum();
    let extra_rounding = match claimed.what {
        SumKind::ClippedSum => 0.0,
        SumKind::Update => 2.0 * ctx.arithmetic.coarsest_unit_roundoff(),
    };
    let bound = ctx.tolerance.clipped_sum_bound_at(coefs, ctx.arithmetic)
        + coefficient_slack
        + extra_rounding * s.x2.sqrt();
    let implied = implied(ctx, &s, bound);
    let (worst_param, worst_param_rel_err) = s
        .per_param
        .iter()
        .map(|(p, e2, r2)| (p.clone(), ratio(e2.sqrt(), r2.sqrt())))
        .max_by(|a, b| {
            a.1.unwrap_or(f64::INFINITY)
                .total_cmp(&b.1.unwrap_or(f64::INFINITY))
        })
        .unwrap_or_default();
    let err = s.err2.sqrt();
    let within = err <= bound;
    // ‖X − sS*‖ for the best single scale s = ⟨X, S*⟩/‖S*‖²: an update divided by a wrong divisor
    // is S* times D/D' to rounding (whose bound scales with it).
    let scale = ratio(s.cross, s.ref2);
    let off_scale = (s.x2 - s.cross * s.cross / s.ref2.max(f64::MIN_POSITIVE))
        .max(0.0)
        .sqrt();
    let shared_scale = !within && scale.is_some_and(|k| k > 0.0 && off_scale <= bound * k.max(1.0));
    let missing_examples = if implied.singular {
        Vec::new()
    } else {
        (0..coefs.len())
            .filter(|&i| implied.coefficients[i].abs() < 0.5 * coefs[i])
            .collect()
    };
    let verdict = sum_verdict(ctx, claimed.what, invalid, within, shared_scale, &implied);
    let check = SumCheck {
        what: claimed.what,
        rel_err: ratio(err, reference),
        bound: ratio(bound, reference),
        worst_param,
        worst_param_rel_err,
        scale,
        implied_sensitivity: implied.sensitivity,
        coefficient_high: implied.high,
        missing_examples,
        shared_scale,
        unexplained: ratio(implied.unexplained2.sqrt(), s.x2.sqrt()),
        singular: implied.singular,
        implied_coefficients: implied.coefficients,
        invalid,
        verdict,
    };
    Ok((check, other_sums))
}

/// Off beyond rounding: a privacy violation where even the low end of some example's implied
/// contribution, ĉ_i less what the sum's rounding can move it by, exceeds C. A correct sum's ĉ
/// lies within that spread of coefficients whose contributions are at most C times one norm
/// bound (the coefficients' share of the norms' rounding is in the sum's bound already).
fn sum_verdict<F: Factors>(
    ctx: &SumContext<F>,
    what: SumKind,
    invalid: bool,
    within: bool,
    shared_scale: bool,
    implied: &Implied,
) -> Verdict {
    let max_norm_bound = ctx.examples.iter().map(|e| e.bound).fold(0.0, f64::max);
    if invalid {
        Verdict::InvalidNorm
    } else if within {
        Verdict::Pass
    } else if what == SumKind::Update && shared_scale {
        // Signal and (were there any) noise scaled alike: what the noise buys is unchanged,
        // the step's size is not.
        Verdict::UtilityDistortion
    } else if !implied.singular && implied.low_sensitivity > 1.0 + max_norm_bound {
        // With a singular Gram the coefficients are not identifiable (ĉ is one of many), so
        // only a regular one can show a contribution above C.
        Verdict::PrivacyViolation
    } else {
        Verdict::UtilityDistortion
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::judge::truth::with_block_bytes;
    use ghost_oracle_reference::{
        Site, SiteKind, SiteSpec, SplitMix64, Trace as RefTrace, GRADIENT_BLOCK_BYTES,
    };
    use ndarray::{Array2 as A2, Array3};

    const B: usize = 3;
    const T: usize = 4;

    /// Holds the step's figures `s` to the loops' (‖X − S*‖², ‖S*‖², ⟨X, S*⟩, ‖X‖²) and
    /// ⟨g_i, X⟩ (`bi`), each by `close`.
    fn assert_sums_match(
        s: &Sums,
        (err2, ref2, cross, x2): (f64, f64, f64, f64),
        bi: &[f64],
        close: impl Fn(f64, f64, &str),
    ) {
        close(s.err2, err2, "‖X − S*‖²");
        close(s.ref2, ref2, "‖S*‖²");
        close(s.cross, cross, "⟨X, S*⟩");
        close(s.x2, x2, "‖X‖²");
        for (i, (&got, &want)) in s.b.iter().zip(bi).enumerate() {
            close(got, want, &format!("⟨g_{i}, X⟩"));
        }
    }
    const V: usize = 7;
    const D: usize = 3;

    /// A tied embedding and head (one V×D parameter, two sites) and an untied linear layer.
    fn tied_trace(rng: &mut SplitMix64) -> RefTrace {
        let mut dense = |w: usize| Array3::from_shape_fn((B, T, w), |_| rng.normal());
        let spec = |name: &str, param: &str, kind, vocab| SiteSpec {
            name: name.into(),
            param: param.into(),
            kind,
            vocab,
        };
        let emb_bp = dense(D);
        let head_bp = dense(V);
        let head_act = dense(D);
        let fc_bp = dense(2);
        let fc_act = dense(D);
        RefTrace {
            sites: vec![
                Site {
                    spec: spec("emb", "wte", SiteKind::Embedding, Some(V)),
                    activations: None,
                    // Repeated tokens within and across examples.
                    ids: Some(A2::from_shape_fn((B, T), |(b, t)| ((b + 2 * t) % 4) as i64)),
                    backprops: emb_bp,
                    conv: None,
                },
                Site {
                    spec: spec("head", "wte", SiteKind::Linear, None),
                    activations: Some(head_act),
                    ids: None,
                    backprops: head_bp,
                    conv: None,
                },
                Site {
                    spec: spec("fc", "fc", SiteKind::Linear, None),
                    activations: Some(fc_act),
                    ids: None,
                    backprops: fc_bp,
                    conv: None,
                },
            ],
        }
    }

    /// Per parameter, every example's whole gradient: its sites' own materialized gradients
    /// summed, by plain loops over the factors (not the judge's blocks).
    fn whole(trace: &RefTrace, js: &[usize], i: usize) -> A2<f64> {
        let mut g: Option<A2<f64>> = None;
        for &j in js {
            let s = &trace.sites[j];
            let (rows, cols) = trace.site_gradient_shape(j);
            let mut m = A2::<f64>::zeros((rows, cols));
            for t in 0..T {
                for c in 0..cols {
                    match s.spec.kind {
                        SiteKind::Embedding => {
                            let r = s.ids.as_ref().unwrap()[(i, t)] as usize;
                            m[(r, c)] += s.backprops[(i, t, c)];
                        }
                        _ => {
                            let a = s.activations.as_ref().unwrap();
                            for r in 0..rows {
                                m[(r, c)] += s.backprops[(i, t, r)] * a[(i, t, c)];
                            }
                        }
                    }
                }
            }
            g = Some(g.map_or(m.clone(), |g| g + &m));
        }
        g.unwrap()
    }

    #[test]
    fn the_step_sums_streamed_a_few_vocabulary_rows_at_a_time_equal_whole_gradients() {
        let mut rng = SplitMix64::new(5);
        let trace = tied_trace(&mut rng);
        let truth = Truth::from_trace(trace).unwrap();
        let trace = truth.factors.as_ref().unwrap();
        let coefs = [0.3, 1.0, 0.7];
        let other = [1.0, 0.5, 0.25];
        // X: the exact clipped sum plus a known error, in each parameter's layout.
        let (mut claimed, mut err2, mut ref2, mut cross, mut x2) = (Vec::new(), 0.0, 0.0, 0.0, 0.0);
        let (mut bi, mut o) = (vec![0.0; B], (0.0, 0.0));
        for (param, js) in trace.params() {
            let g: Vec<A2<f64>> = (0..B).map(|i| whole(trace, &js, i)).collect();
            let want = g
                .iter()
                .zip(coefs)
                .fold(g[0].clone() * 0.0, |s, (g, c)| s + g * c);
            let want_o = g
                .iter()
                .zip(other)
                .fold(g[0].clone() * 0.0, |s, (g, c)| s + g * c);
            let x = want.mapv(|w| w + 0.01 * rng.normal());
            err2 += (&x - &want).mapv(|e| e * e).sum();
            ref2 += want.mapv(|w| w * w).sum();
            cross += (&x * &want).sum();
            x2 += x.mapv(|v| v * v).sum();
            o.0 += (&x - &want_o).mapv(|e| e * e).sum();
            o.1 += want_o.mapv(|w| w * w).sum();
            for (b, g) in bi.iter_mut().zip(&g) {
                *b += (g * &x).sum();
            }
            claimed.push((param, Floats::F64(x.iter().copied().collect())));
        }
        // One row of the V×D table per block, a few rows, and the whole table at once; within
        // a block, tiles of one row and of two rows, run on the pool.
        let blocks = [1, 2 * D * 8 * B + 1, GRADIENT_BLOCK_BYTES];
        for (bytes, tile) in blocks
            .into_iter()
            .flat_map(|b| [(b, 1), (b, 2 * D * 8), (b, TILE_BYTES)])
        {
            let s = with_block_bytes(bytes, || {
                sums_in_tiles(&truth, &coefs, &claimed, 1.0, Some(&other), tile).unwrap()
            });
            let close = |got: f64, want: f64, what: &str| {
                assert!(
                    (got - want).abs() <= 1e-12 * want.abs().max(1.0),
                    "{bytes}-byte blocks, {tile}-byte tiles, {what}: {got:e} vs {want:e}"
                );
            };
            assert_sums_match(&s, (err2, ref2, cross, x2), &bi, close);
            let (e, r) = s.other.unwrap();
            close(e, o.0, "‖X − Σ a_i g_i‖²");
            close(r, o.1, "‖Σ a_i g_i‖²");
            // One entry per parameter however many blocks it took.
            assert_eq!(
                s.per_param.len(),
                2,
                "{bytes}-byte blocks: {:?}",
                s.per_param
            );
            close(
                s.per_param.iter().map(|p| p.1).sum(),
                err2,
                "Σ_p ‖X_p − S*_p‖²",
            );
        }
    }

    /// The step always writes every example's gradient out, on every shape: ⟨G_i, X⟩ by the
    /// identity, Σ_t δ_tᵀ X x_t, reads X once per row just as writing G_i does (rows · d_in ·
    /// d_out an example either way), and ‖X − S*‖ needs S* itself, since the expansion
    /// ‖X‖² − 2⟨X, S*⟩ + ‖S*‖² cancels exactly where X is right. What the Gram's route moves is
    /// the decomposition ĉ = G⁺b: held here, on the shapes where each route wins, against the
    /// same figures from plain loops.
    #[test]
    fn the_step_sums_equal_loops_on_convolution_and_language_model_shapes_by_either_gram_route() {
        use crate::judge::truth::tests::{loop_gradient, route_shapes};
        use crate::judge::truth::GramRoute;
        let trace = route_shapes(31, B);
        let coefs = [0.4, 1.0, 0.8];
        let mut rng = SplitMix64::new(8);
        let (mut claimed, mut err2, mut ref2, mut cross, mut x2) = (Vec::new(), 0.0, 0.0, 0.0, 0.0);
        let mut bi = vec![0.0; B];
        let mut gram = vec![vec![0.0; B]; B];
        for (param, js) in trace.params() {
            let g: Vec<A2<f64>> = (0..B)
                .map(|i| {
                    js.iter()
                        .map(|&j| loop_gradient(&trace.sites[j], i, false))
                        .reduce(|a, b| a + b)
                        .unwrap()
                })
                .collect();
            let want = g
                .iter()
                .zip(coefs)
                .fold(g[0].clone() * 0.0, |s, (g, c)| s + g * c);
            // X off S* by about 1 % of each entry: a wrong sum the figures must measure.
            let x = want.mapv(|w| w + 0.01 * w.abs() * rng.normal());
            err2 += (&x - &want).mapv(|e| e * e).sum();
            ref2 += want.mapv(|w| w * w).sum();
            cross += (&x * &want).sum();
            x2 += x.mapv(|v| v * v).sum();
            for i in 0..B {
                bi[i] += (&g[i] * &x).sum();
                for k in 0..B {
                    gram[i][k] += (&g[i] * &g[k]).sum();
                }
            }
            claimed.push((param, Floats::F64(x.iter().copied().collect())));
        }
        let want_implied = GramSolver::new(&gram).solve(&bi);
        for route in [
            GramRoute::ByCost,
            GramRoute::Materialize,
            GramRoute::Identity,
        ] {
            let truth = Truth::from_trace_routed(trace.clone(), route, &|_, _, _| {}).unwrap();
            let s = sums(&truth, &coefs, &claimed, 1.0, None).unwrap();
            // The loops and the tiles add in other orders: within 1e-9 of each figure, ~10⁷ u,
            // far above the γ_N of these lengths and far below the 1 % error measured.
            let close = |got: f64, want: f64, what: &str| {
                assert!(
                    (got - want).abs() <= 1e-9 * want.abs(),
                    "{route:?}, {what}: {got:e} vs {want:e}"
                );
            };
            assert_sums_match(&s, (err2, ref2, cross, x2), &bi, close);
            let implied = GramSolver::new(&truth.gram).solve(&s.b);
            for (i, (&got, &want)) in implied.iter().zip(&want_implied).enumerate() {
                close(got, want, &format!("ĉ_{i}"));
            }
        }
    }
}
