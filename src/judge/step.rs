//! The DP-SGD step a library applies, judged against the true per-example gradients
//! (docs/tolerances.md, "The step"): its clipped sum before noise, and, without noise, its update
//! times the divisor it states. Both are compared with S* = Σ_i c*_i g_i*, the exact clipped sum,
//! rebuilt from the reference's f64 factors a block of rows at a time; neither is ever
//! materialized per example in full.
//!
//! Where a sum is off, it is decomposed against the batch's own gradients: ĉ = G⁺b with
//! G_ik = ⟨g_i*, g_k*⟩ and b_i = ⟨g_i*, X⟩ are the coefficients the sum implies. That says which
//! examples it dropped or over-weighted (a lost micro-batch: ĉ_i = 0 for its examples), whether
//! any example's contribution exceeds C (ĉ_i n*_i / C > 1), what scale a wrong divisor applied,
//! and how much of X no combination of this batch's gradients explains (another batch's update).

use super::metrics::{ratio, CaseMetrics};
use super::tolerance::{Arithmetic, Tolerance};
use super::truth::{for_each_param_block, Block, Truth};
use super::verdict::Verdict;
use crate::error::{Error, Result};
use crate::options::{ClipNorm, NoiseMultiplier};
use ghost_oracle_reference::{Floats, StepClaim};
use ndarray::Array2;
use serde::Serialize;

/// One claimed sum (the clipped sum, or the update times its divisor) against S*.
#[derive(Clone, Debug, Serialize)]
pub struct SumCheck {
    /// `clipped sum` or `update × divisor`.
    pub what: &'static str,
    /// ‖X − S*‖ / ‖S*‖ and the rounding bound on it (`null` where S* = 0).
    pub rel_err: Option<f64>,
    pub bound: Option<f64>,
    /// The parameter whose sum is furthest off, relative to its own ‖S*_p‖.
    pub worst_param: String,
    pub worst_param_rel_err: Option<f64>,
    /// ⟨X, S*⟩ / ‖S*‖²: a wrong divisor scales the whole sum by this.
    pub scale: Option<f64>,
    /// ĉ = G⁺b, the coefficients X implies, and the largest ĉ_i n*_i / C.
    pub implied_coefficients: Vec<f64>,
    pub implied_sensitivity: f64,
    /// ĉ_i plus the most the sum's rounding bound can move it: the high end, for privacy.
    pub coefficient_high: Vec<f64>,
    /// X is S* times one scale, beyond rounding: the update was divided by another divisor
    /// than the stated one (only said of an update times its divisor).
    pub shared_scale: bool,
    /// ‖X − Σ_i ĉ_i g_i*‖ / ‖X‖: the part of X outside the span of the batch's gradients.
    pub unexplained: Option<f64>,
    /// G was singular (e.g. two identical examples): ĉ is the minimum-norm solution, one of
    /// many, and no privacy verdict is drawn from it.
    pub singular: bool,
    /// Some value of X is NaN or infinite.
    pub invalid: bool,
    pub verdict: Verdict,
}

/// The noise of one parameter tensor: r = u·D − K, whose squared norm over (σC)² is χ² with as
/// many degrees of freedom as the tensor has entries when the library added N(0, σ²C²) to each.
#[derive(Clone, Debug, Serialize)]
pub struct NoiseCheck {
    /// A parameter, or `all` for the whole update.
    pub param: String,
    pub entries: usize,
    /// ‖r‖² / (σC)².
    pub chi2: f64,
    /// The acceptance interval of χ² at the step's false-alarm rate (Laurent–Massart).
    pub low: f64,
    pub high: f64,
    /// σ̂ / σ = √(χ² / entries): the noise the tensor got, in units of the stated.
    pub sigma_ratio: f64,
    pub verdict: Verdict,
}

/// An update under noise without its clipped sum: signal and noise told apart by the batch's own
/// gradients. ĉ = G⁺b (b_i = ⟨g*_i, u·D⟩) has mean c* and covariance σ²C²G⁻¹ for a correct
/// update, so (ĉ − c*)ᵀG(ĉ − c*)/(σC)² is χ² with rank(G) degrees of freedom; what is left,
/// u·D − Σ ĉ_i g*_i, is the noise with those directions projected out, χ² with N − rank(G).
#[derive(Clone, Debug, Serialize)]
pub struct NoisyUpdateCheck {
    pub implied_coefficients: Vec<f64>,
    /// (ĉ − c*)ᵀG(ĉ − c*)/(σC)², its degrees of freedom and its acceptance interval.
    pub chi2: f64,
    pub dof: usize,
    pub high: f64,
    /// The smallest error of the clipped signal this test can see from one update, as a
    /// fraction of ‖S*‖: σC·√high / ‖S*‖. Under σ ≈ 1 a few-percent signal error hides here.
    pub smallest_visible: Option<f64>,
    /// The residual noise over the whole update.
    pub residual: NoiseCheck,
    pub verdict: Verdict,
    /// Reported once, in [`StepMetrics::divisor`].
    #[serde(skip)]
    divisor: Option<DivisorCheck>,
}

/// The family-wise false-alarm rate of the noise test over one step's tensors.
pub const NOISE_ALPHA: f64 = 1e-6;

/// The step's figures and verdict.
#[derive(Clone, Debug, Serialize)]
pub struct StepMetrics {
    /// c*_i from the true norms with the library's clipping rule and stabilizer.
    pub true_coefficients: Vec<f64>,
    pub clipped_sum: Option<SumCheck>,
    /// Judged as a sum only without noise (σ = 0).
    pub update: Option<SumCheck>,
    /// Under noise with the clipped sum given: per tensor, then over all of them.
    pub noise: Vec<NoiseCheck>,
    /// An update under noise without the clipped sum, judged by its implied coefficients.
    pub noisy_update: Option<NoisyUpdateCheck>,
    /// The update under noise was not judged (no way to separate it was available).
    pub update_not_judged: bool,
    /// The divisor the update implies, when one can be read from it.
    pub divisor: Option<DivisorCheck>,
    /// The least noise, as a fraction of the stated σ, of any tensor: 1 where every tensor's χ²
    /// is consistent with the stated σ or above it; below, the low end of σ_p / σ at the noise
    /// test's confidence, √(χ²_p / high_p).
    pub noise_fraction: f64,
    /// Per example, its contribution to the step in units of what the stated σ and C allow:
    /// √(Σ_p ĉ_i² ‖g*_{i,p}‖² / (f_p² C²)), the Gaussian mechanism with per-tensor noise σ f_p
    /// (diagonal covariance). ĉ_i is the clipper's coefficient, or the high end of the
    /// coefficient the step implies where its sum is off. 1 or below: as private as stated.
    pub contributions: Vec<f64>,
    /// σ / max(1, max_i contribution): the noise multiplier the step acts with.
    pub sigma_eff: f64,
    pub verdict: Verdict,
}

/// The divisor an update was divided by, read from the update: without noise from the scale of
/// its signal, under noise from its projection on the clipped sum (or on S* without one).
#[derive(Clone, Debug, Serialize)]
pub struct DivisorCheck {
    pub stated: f64,
    pub implied: f64,
    /// The relative uncertainty of `implied`: one standard deviation of what the noise adds to
    /// it, or the rounding bound without noise.
    pub spread: f64,
    /// The batch's actual size.
    pub drawn: usize,
    /// The implied divisor is off the stated one and equals the drawn size: the update's
    /// normalization depends on the data (the sampled batch's size), which the stated σ does not
    /// account for.
    pub data_dependent: bool,
}

/// How many spreads apart two divisors must be to be told apart (a normal tail of 5.7e-7).
const DIVISOR_Z: f64 = 5.0;

impl DivisorCheck {
    fn new(stated: f64, implied: f64, spread: f64, drawn: usize) -> Option<Self> {
        if !implied.is_finite() || implied <= 0.0 {
            return None;
        }
        let apart = |a: f64, b: f64| (a - b).abs() > DIVISOR_Z * spread * implied + 1e-12 * a;
        Some(DivisorCheck {
            stated,
            implied,
            spread,
            drawn,
            data_dependent: apart(implied, stated)
                && !apart(implied, drawn as f64)
                && apart(stated, drawn as f64),
        })
    }
}

/// Laurent and Massart's bounds for χ²_N: P(χ² ≥ N + 2√(Nx) + 2x) ≤ e⁻ˣ and
/// P(χ² ≤ N − 2√(Nx)) ≤ e⁻ˣ, exact for every N; x = ln(2m/α) makes the two-sided test over m
/// tensors (and their total) family-wise α.
fn chi2_interval(entries: usize, tests: usize) -> (f64, f64) {
    let n = entries as f64;
    let x = (2.0 * tests as f64 / NOISE_ALPHA).ln();
    (
        (n - 2.0 * (n * x).sqrt()).max(0.0),
        n + 2.0 * (n * x).sqrt() + 2.0 * x,
    )
}

/// A χ² of noise with `dof` degrees of freedom against its interval: below it less noise than
/// stated (the stated σ no longer buys the stated ε), above it more.
fn noise_check(param: String, dof: usize, chi2: f64, tests: usize) -> NoiseCheck {
    let (low, high) = chi2_interval(dof, tests);
    let verdict = if !chi2.is_finite() {
        Verdict::InvalidNorm
    } else if chi2 < low {
        Verdict::PrivacyViolation
    } else if chi2 > high {
        Verdict::UtilityDistortion
    } else {
        Verdict::Pass
    };
    NoiseCheck {
        param,
        entries: dof,
        chi2,
        low,
        high,
        sigma_ratio: (chi2 / dof.max(1) as f64).sqrt(),
        verdict,
    }
}

fn noise_checks(
    update: &[(String, Floats)],
    clipped_sum: &[(String, Floats)],
    divisor: f64,
    sigma_c: f64,
) -> Vec<NoiseCheck> {
    let tests = update.len() + 1;
    let check = |param: String, entries: usize, sq: f64| {
        noise_check(param, entries, sq / (sigma_c * sigma_c), tests)
    };
    let mut out: Vec<NoiseCheck> = update
        .iter()
        .map(|(p, u)| {
            let k = &clipped_sum
                .iter()
                .find(|(q, _)| q == p)
                .expect("the reader gives both sums for every parameter")
                .1;
            let mut sq = 0.0;
            u.zip_chunks(k, |u, k| {
                sq += u
                    .iter()
                    .zip(k)
                    .map(|(u, k)| (u * divisor - k).powi(2))
                    .sum::<f64>();
            });
            check(p.clone(), u.len(), sq)
        })
        .collect();
    let (entries, sq) = out.iter().fold((0, 0.0), |(n, s), c| {
        (n + c.entries, s + c.chi2 * sigma_c * sigma_c)
    });
    out.push(check("all".into(), entries, sq));
    out
}

/// Σ_i c_i g_i* rebuilt block by block against a claimed X, with everything the decomposition
/// needs: ‖X − S*‖², ‖S*‖², ⟨X, S*⟩, ‖X‖², b_i = ⟨g_i*, X⟩, and the same per parameter.
struct Sums {
    err2: f64,
    ref2: f64,
    cross: f64,
    x2: f64,
    b: Vec<f64>,
    /// (parameter, ‖X_p − S*_p‖², ‖S*_p‖²).
    per_param: Vec<(String, f64, f64)>,
    /// ‖X − Σ a_i g_i*‖² and ‖Σ a_i g_i*‖² for other coefficients a, when asked for: the
    /// clipper's own, from the same gradients.
    other: Option<(f64, f64)>,
}

/// `claimed` is read times `scale` (an update times its divisor), a block at a time; `other`
/// coefficients are compared with in the same pass.
fn sums(
    truth: &Truth,
    coefs: &[f64],
    claimed: &[(String, Floats)],
    scale: f64,
    other: Option<&[f64]>,
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
        let mut x = x.widened(rows.start * cols..rows.end * cols);
        if scale != 1.0 {
            x.to_mut().iter_mut().for_each(|v| *v *= scale);
        }
        let x = &x[..];
        let mut want = Array2::<f64>::zeros((rows.len(), cols));
        let mut want_other = other.map(|_| Array2::<f64>::zeros((rows.len(), cols)));
        for i in 0..n {
            let mut unit = vec![0.0; n];
            unit[i] = 1.0;
            let mut g = Array2::<f64>::zeros((rows.len(), cols));
            for &j in sites {
                factors.add_site_gradient_rows(j, &unit, rows.clone(), &mut g)?;
            }
            s.b[i] += g.iter().zip(x).map(|(a, v)| a * v).sum::<f64>();
            want.scaled_add(coefs[i], &g);
            if let (Some(w), Some(a)) = (want_other.as_mut(), other) {
                w.scaled_add(a[i], &g);
            }
        }
        if let (Some(w), Some((e2, r2))) = (&want_other, s.other.as_mut()) {
            for (w, v) in w.iter().zip(x) {
                *e2 += (v - w) * (v - w);
                *r2 += w * w;
            }
        }
        let (mut e2, mut r2) = (0.0, 0.0);
        for (w, v) in want.iter().zip(x) {
            e2 += (v - w) * (v - w);
            r2 += w * w;
            s.cross += v * w;
            s.x2 += v * v;
        }
        s.err2 += e2;
        s.ref2 += r2;
        match s.per_param.last_mut() {
            Some((p, pe, pr)) if p == param => {
                *pe += e2;
                *pr += r2;
            }
            Some(_) | None => s.per_param.push((param.to_string(), e2, r2)),
        }
        Ok(())
    })?;
    Ok(s)
}

/// Solves G c = b for the symmetric positive semi-definite Gram G, by Gaussian elimination with
/// full pivoting; directions whose pivot falls below a relative 1e-12 of the largest are
/// dropped (the minimum-norm solution there, to rounding). Returns c and whether any was.
fn solve_gram(gram: &[Vec<f64>], b: &[f64]) -> (Vec<f64>, usize) {
    let n = b.len();
    let mut a: Vec<Vec<f64>> = gram.to_vec();
    let mut rhs = b.to_vec();
    let mut perm: Vec<usize> = (0..n).collect();
    let scale = (0..n).map(|i| a[i][i].abs()).fold(0.0, f64::max);
    let mut rank = n;
    for k in 0..n {
        // The largest remaining diagonal (G is symmetric: pivot on the diagonal).
        let (p, piv) = (k..n)
            .map(|i| (i, a[i][i]))
            .fold((k, f64::NEG_INFINITY), |m, x| if x.1 > m.1 { x } else { m });
        // A NaN pivot counts as none.
        if piv.is_nan() || piv <= 1e-12 * scale {
            rank = k;
            break;
        }
        a.swap(k, p);
        for row in a.iter_mut() {
            row.swap(k, p);
        }
        rhs.swap(k, p);
        perm.swap(k, p);
        let (pivot_row, rest) = a.split_at_mut(k + 1);
        let pivot_row = &pivot_row[k];
        for (offset, row) in rest.iter_mut().enumerate() {
            let f = row[k] / pivot_row[k];
            for (x, p) in row[k..].iter_mut().zip(&pivot_row[k..]) {
                *x -= f * p;
            }
            rhs[k + 1 + offset] -= f * rhs[k];
        }
    }
    let mut x = vec![0.0; n];
    for k in (0..rank).rev() {
        let s: f64 = (k + 1..rank).map(|j| a[k][j] * x[j]).sum();
        x[k] = (rhs[k] - s) / a[k][k];
    }
    let mut out = vec![0.0; n];
    for (k, &i) in perm.iter().enumerate() {
        out[i] = x[k];
    }
    (out, rank)
}

/// ĉᵀGĉ.
fn gram_quad(gram: &[Vec<f64>], c: &[f64]) -> f64 {
    (0..c.len())
        .map(|i| (0..c.len()).map(|k| c[i] * gram[i][k] * c[k]).sum::<f64>())
        .sum()
}

/// The update under noise, decomposed against the batch's gradients (see [`NoisyUpdateCheck`]).
fn check_noisy_update(
    update: &[(String, Floats)],
    divisor: f64,
    truth: &Truth,
    coefs: &[f64],
    sigma_c: f64,
) -> Result<NoisyUpdateCheck> {
    let s = sums(truth, coefs, update, divisor, None)?;
    let (implied, rank) = solve_gram(&truth.gram, &s.b);
    let diff: Vec<f64> = implied.iter().zip(coefs).map(|(a, b)| a - b).collect();
    let chi2 = gram_quad(&truth.gram, &diff) / (sigma_c * sigma_c);
    let tests = 2;
    let (_, high) = chi2_interval(rank, tests);
    let explained: f64 = implied.iter().zip(&s.b).map(|(ci, bi)| ci * bi).sum();
    let residual2 = (s.x2 - 2.0 * explained + gram_quad(&truth.gram, &implied)).max(0.0);
    let entries: usize = update.iter().map(|(_, v)| v.len()).sum();
    let dof = entries.saturating_sub(rank);
    let residual = noise_check("all".into(), dof, residual2 / (sigma_c * sigma_c), tests);
    // ĉ = (D/D')(c* + G⁻¹⟨g, n⟩): its projection on c* in G's metric reads D/D', to within
    // σC/‖S*‖ (one standard deviation).
    let signal2 = gram_quad(&truth.gram, coefs);
    let along: f64 = (0..coefs.len())
        .map(|i| {
            (0..coefs.len())
                .map(|k| implied[i] * truth.gram[i][k] * coefs[k])
                .sum::<f64>()
        })
        .sum();
    let divisor = DivisorCheck::new(
        divisor,
        divisor * signal2 / along,
        sigma_c / signal2.sqrt(),
        coefs.len(),
    );
    let signal = if !chi2.is_finite() {
        Verdict::InvalidNorm
    } else if chi2 > high {
        Verdict::UtilityDistortion
    } else {
        Verdict::Pass
    };
    Ok(NoisyUpdateCheck {
        implied_coefficients: implied,
        chi2,
        dof: rank,
        high,
        smallest_visible: ratio(sigma_c * high.sqrt(), s.ref2.sqrt()),
        verdict: signal.max(residual.verdict),
        residual,
        divisor,
    })
}

/// Judges one claimed sum X against S* = Σ c*_i g_i*.
#[allow(clippy::too_many_arguments)]
fn check_sum(
    what: &'static str,
    claimed: &[(String, Floats)],
    scale: f64,
    truth: &Truth,
    tolerance: &Tolerance,
    metrics: &CaseMetrics,
    coefs: &[f64],
    c: f64,
    arithmetic: &Arithmetic,
    extra_rounding: f64,
    is_update: bool,
    other: Option<&[f64]>,
) -> Result<(SumCheck, Option<(f64, f64)>)> {
    let invalid = claimed.iter().any(|(_, v)| v.any_non_finite());
    let s = sums(truth, coefs, claimed, scale, other)?;
    let other_sums = s.other.map(|(e2, r2)| (e2.sqrt(), r2.sqrt()));
    let reference = s.ref2.sqrt();
    // Rounding of the sum itself, the coefficients' share of the norms' rounding (each c_i may
    // be off by 2·bound_i·c*_i), and the division's rounding.
    let coefficient_slack: f64 = metrics
        .examples
        .iter()
        .zip(coefs)
        .map(|(e, ci)| 2.0 * e.bound * ci * e.true_norm)
        .sum();
    let bound = tolerance.clipped_sum_bound_at(coefs, arithmetic)
        + coefficient_slack
        + extra_rounding * s.x2.sqrt();
    let (implied, rank) = solve_gram(&truth.gram, &s.b);
    let singular = rank < coefs.len();
    let quad = gram_quad(&truth.gram, &implied);
    let explained: f64 = implied.iter().zip(&s.b).map(|(ci, bi)| ci * bi).sum();
    let unexplained2 = (s.x2 - 2.0 * explained + quad).max(0.0);
    let implied_sensitivity = implied
        .iter()
        .zip(&truth.norms)
        .map(|(ci, n)| ci * n / c)
        .fold(0.0, f64::max);
    // How far rounding alone could move each ĉ_i: an error δ of X moves ĉ by G⁺⟨g, δ⟩, whose
    // i-th entry is at most √(G⁺)_ii·‖δ‖ (Cauchy–Schwarz in G's metric). A nearly dependent
    // batch makes ĉ uncertain, and that must not read as a contribution above C.
    let spread: Vec<f64> = (0..coefs.len())
        .map(|i| {
            let mut unit = vec![0.0; coefs.len()];
            unit[i] = 1.0;
            solve_gram(&truth.gram, &unit).0[i].max(0.0).sqrt() * bound
        })
        .collect();
    let uncertain_sensitivity = (0..coefs.len())
        .map(|i| (implied[i] - spread[i]) * truth.norms[i] / c)
        .fold(0.0, f64::max);
    let coefficient_high: Vec<f64> = implied.iter().zip(&spread).map(|(a, b)| a + b).collect();
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
    let shared_scale =
        is_update && !within && scale.is_some_and(|k| k > 0.0 && off_scale <= bound * k.max(1.0));
    // Off beyond rounding: a privacy violation where even the low end of some example's implied
    // contribution, ĉ_i less what the sum's rounding can move it by, exceeds C. A correct sum's
    // ĉ lies within that spread of coefficients whose contributions are at most C times one
    // norm bound (the coefficients' share of the norms' rounding is in `bound` already).
    let max_norm_bound = metrics.examples.iter().map(|e| e.bound).fold(0.0, f64::max);
    let verdict = if invalid {
        Verdict::InvalidNorm
    } else if within {
        Verdict::Pass
    } else if shared_scale {
        // Signal and (were there any) noise scaled alike: what the noise buys is unchanged,
        // the step's size is not.
        Verdict::UtilityDistortion
    } else if !singular && uncertain_sensitivity > 1.0 + max_norm_bound {
        // With a singular Gram the coefficients are not identifiable (ĉ is one of many), so
        // only a regular one can show a contribution above C.
        Verdict::PrivacyViolation
    } else {
        Verdict::UtilityDistortion
    };
    let check = SumCheck {
        what,
        rel_err: ratio(err, reference),
        bound: ratio(bound, reference),
        worst_param,
        worst_param_rel_err,
        scale,
        implied_coefficients: implied,
        implied_sensitivity,
        coefficient_high,
        shared_scale,
        unexplained: ratio(unexplained2.sqrt(), s.x2.sqrt()),
        singular,
        invalid,
        verdict,
    };
    Ok((check, other_sums))
}

/// The step's checks: the clipped sum when given, and the update times its divisor when there
/// is no noise. With `claimed_coefficients`, also the clipped sum's distance from Σ ĉ_i g_i* at
/// those coefficients, ‖X − Σ ĉ_i g_i*‖ and ‖Σ ĉ_i g_i*‖, taken from the same rebuilt gradients
/// as the check at the true coefficients.
#[allow(clippy::too_many_arguments)]
pub fn evaluate_step(
    truth: &Truth,
    tolerance: &Tolerance,
    metrics: &CaseMetrics,
    step: &StepClaim,
    max_grad_norm: ClipNorm,
    noise_multiplier: NoiseMultiplier,
    arithmetic: &Arithmetic,
    claimed_coefficients: Option<&[f64]>,
) -> Result<(StepMetrics, Option<(f64, f64)>)> {
    let c = max_grad_norm.get();
    let true_coefficients: Vec<f64> = truth
        .norms
        .iter()
        .map(|&n| step.clipping.coefficient(n, c, step.clip_stabilizer))
        .collect();
    let clipped_sum = step
        .clipped_sum
        .as_ref()
        .map(|k| {
            check_sum(
                "clipped sum",
                k,
                1.0,
                truth,
                tolerance,
                metrics,
                &true_coefficients,
                c,
                arithmetic,
                0.0,
                false,
                claimed_coefficients,
            )
        })
        .transpose()?;
    let (clipped_sum, sum_at_claimed) = match clipped_sum {
        Some((check, at)) => (Some(check), at),
        None => (None, None),
    };
    let without_noise = noise_multiplier.get() == 0.0;
    let update = match (&step.update, step.batch_divisor) {
        (Some(u), Some(d)) if without_noise => Some(
            check_sum(
                "update × divisor",
                u,
                d,
                truth,
                tolerance,
                metrics,
                &true_coefficients,
                c,
                arithmetic,
                2.0 * arithmetic.coarsest_unit_roundoff(),
                true,
                None,
            )?
            .0,
        ),
        (Some(_), Some(_)) | (Some(_), None) | (None, Some(_)) | (None, None) => None,
    };
    let noise = match (&step.update, &step.clipped_sum, step.batch_divisor) {
        (Some(u), Some(k), Some(d)) if !without_noise => {
            noise_checks(u, k, d, noise_multiplier.get() * c)
        }
        _ => Vec::new(),
    };
    let noisy_update = match (&step.update, &step.clipped_sum, step.batch_divisor) {
        (Some(u), None, Some(d)) if !without_noise => Some(check_noisy_update(
            u,
            d,
            truth,
            &true_coefficients,
            noise_multiplier.get() * c,
        )?),
        _ => None,
    };
    let update_not_judged =
        step.update.is_some() && !without_noise && noise.is_empty() && noisy_update.is_none();
    let drawn = true_coefficients.len();
    let divisor = match (&update, &step.update, &step.clipped_sum, step.batch_divisor) {
        (Some(check), _, _, Some(d)) => check
            .scale
            .and_then(|k| DivisorCheck::new(d, d / k, check.bound.unwrap_or(0.0), drawn)),
        (None, Some(u), Some(k), Some(d)) if !without_noise => {
            divisor_from_clipped_sum(u, k, d, noise_multiplier.get() * c, drawn)
        }
        (Some(_), _, _, None) | (None, _, _, _) => {
            noisy_update.as_ref().and_then(|n| n.divisor.clone())
        }
    };
    let noise_fractions = noise_fractions(&noise, noisy_update.as_ref());
    let noise_fraction = noise_fractions.iter().map(|(_, f)| *f).fold(1.0, f64::min);
    // The coefficients the step acted with: the clipper's where its sum is consistent with them
    // (then c_i n*_i / C is exact), else the high end of those the sum implies.
    let off = [&clipped_sum, &update]
        .into_iter()
        .flatten()
        .filter(|x| x.verdict != Verdict::Pass && !x.singular && !x.shared_scale)
        .collect::<Vec<_>>();
    let contributions: Vec<f64> = (0..drawn)
        .map(|i| {
            let (own, claimed) = metrics
                .examples
                .get(i)
                .map_or((0.0, f64::NAN), |e| (e.sensitivity.max(0.0), e.coefficient));
            let implied = off
                .iter()
                .filter(|x| {
                    let spread = x.coefficient_high[i] - x.implied_coefficients[i];
                    let d = (x.implied_coefficients[i] - claimed).abs();
                    d.is_nan() || d > spread
                })
                .map(|x| x.coefficient_high[i] * truth.norms[i] / c)
                .fold(own, f64::max);
            implied * spread_over_tensors(truth, i, &noise_fractions, noise_fraction)
        })
        .collect();
    let worst = contributions.iter().copied().fold(0.0, f64::max);
    let sigma_eff = noise_multiplier.get() / worst.max(1.0);
    let verdict = [&clipped_sum, &update]
        .into_iter()
        .flatten()
        .map(|s| s.verdict)
        .chain(noise.iter().map(|n| n.verdict))
        .chain(noisy_update.iter().map(|n| n.verdict))
        .max()
        .unwrap_or(Verdict::Pass);
    let metrics = StepMetrics {
        true_coefficients,
        clipped_sum,
        update,
        noise,
        noisy_update,
        update_not_judged,
        divisor,
        noise_fraction,
        contributions,
        sigma_eff,
        verdict,
    };
    Ok((metrics, sum_at_claimed))
}

/// 1/D' = ⟨u, K⟩/‖K‖² for an update u = (K + n)/D', to within σC/‖K‖ (one standard deviation).
fn divisor_from_clipped_sum(
    update: &[(String, Floats)],
    clipped_sum: &[(String, Floats)],
    stated: f64,
    sigma_c: f64,
    drawn: usize,
) -> Option<DivisorCheck> {
    let (mut uk, mut kk) = (0.0, 0.0);
    for (p, u) in update {
        let k = &clipped_sum.iter().find(|(q, _)| q == p)?.1;
        u.zip_chunks(k, |u, k| {
            for (u, k) in u.iter().zip(k) {
                uk += u * k;
                kk += k * k;
            }
        });
    }
    DivisorCheck::new(stated, kk / uk, sigma_c / kk.sqrt(), drawn)
}

/// (parameter, f_p) for every tensor whose noise was measured: 1 where its χ² is consistent
/// with the stated σ or above, else the low end of σ_p / σ, √(χ²_p / high_p). An update judged
/// without its clipped sum measures the noise over all tensors at once (`all`).
fn noise_fractions(
    noise: &[NoiseCheck],
    noisy_update: Option<&NoisyUpdateCheck>,
) -> Vec<(String, f64)> {
    noise
        .iter()
        .chain(noisy_update.map(|n| &n.residual))
        .map(|n| {
            let f = if n.chi2 < n.low {
                (n.chi2 / n.high).sqrt()
            } else {
                1.0
            };
            (n.param.clone(), f)
        })
        .collect()
}

/// √(Σ_p w_ip / f_p²), w_ip = ‖g*_{i,p}‖² / ‖g*_i‖²: how much an example's privacy loss grows
/// when tensor p gets σ f_p instead of σ. Where no single tensor shows too little noise, every
/// tensor takes the fraction of `all` (1 when it passes); a tensor measured only within `all`
/// takes `all`'s; a truth without per-tensor norms, the smallest fraction.
fn spread_over_tensors(truth: &Truth, i: usize, fractions: &[(String, f64)], least: f64) -> f64 {
    let all = fractions
        .iter()
        .find(|(p, _)| p == "all")
        .map_or(least, |(_, f)| *f);
    let some_tensor_low = fractions.iter().any(|(p, f)| p != "all" && *f < 1.0);
    let total: f64 = truth.param_sq.iter().map(|(_, v)| v[i]).sum();
    if truth.param_sq.is_empty() || total <= 0.0 {
        return 1.0 / least;
    }
    let weighted: f64 = truth
        .param_sq
        .iter()
        .map(|(p, v)| {
            let f = match fractions.iter().find(|(q, _)| q == p) {
                Some((_, f)) if some_tensor_low => *f,
                // Jointly too little noise that no one tensor shows is too little on each.
                Some(_) | None => all,
            };
            v[i] / total / (f * f)
        })
        .sum();
    weighted.sqrt()
}
