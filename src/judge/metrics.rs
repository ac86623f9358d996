//! What a clipper's norms do to DP-SGD, measured against the truth (docs/tolerances.md; the
//! metrics are listed in docs/auditing.md).
//!
//! Everything that decides a verdict (true norms, true coefficients min(1, C/n*), the clipped
//! sum Σ c_i g_i* and the tolerance) comes from the reference side; the clipper contributes only
//! its claim.

use super::example::ExampleMetrics;
use super::numeric::{bilinear, nan_max, ratio};
use super::step::StepMetrics;
use super::tolerance::{Arithmetic, Precision, Tolerance};
use super::truth::{for_each_param_block, Block, Truth};
use super::verdict::Verdict;
use crate::error::{Error, Result};
use crate::options::{ClipNorm, NoiseMultiplier};
use ghost_oracle_reference::Factors;
use ghost_oracle_reference::{Clipping, Floats};
use ndarray::Array2;
use serde::Serialize;

/// What a clipper claims for a batch: its norms, its coefficients and, when it computed one,
/// its clipped sum per parameter (f64 values in the parameter's row-major layout).
#[derive(Clone, Debug, Default)]
pub struct Claim {
    /// n_i, the norm the clipper claims for each example, in batch order.
    pub norms: Vec<f64>,
    /// c_i, the coefficient the clipper applied to each example, in batch order.
    pub coefficients: Vec<f64>,
    /// Σ_i c_i g_i per parameter, in the dtype the clipper produced it in.
    pub clipped_sum: Option<Vec<(String, Floats)>>,
    /// How the library says it forms a coefficient from a norm; the true coefficients follow
    /// the same rule from the true norms.
    pub clipping: ClippingRule,
}

/// A coefficient rule and its stabilizer γ: flat min(1, C/(n + γ)), or automatic C/(n + γ)
/// (fastDP's default), whose every contribution C·n/(n + γ) stays below C.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClippingRule {
    /// Flat or automatic.
    pub clipping: Clipping,
    /// γ, added to the norm in the coefficient's denominator.
    pub stabilizer: f64,
}

impl Default for ClippingRule {
    /// Flat clipping without a stabilizer, min(1, C/n): the built-in clippers'.
    fn default() -> Self {
        ClippingRule {
            clipping: Clipping::Flat,
            stabilizer: 0.0,
        }
    }
}

impl Claim {
    /// One norm and one coefficient per example of a batch of `b`.
    fn check_batch(&self, b: usize, case: &str) -> Result<()> {
        if self.norms.len() != b || self.coefficients.len() != b {
            return Err(Error::input(format!(
                "case {case}: the clipper returned {} norms and {} coefficients for a batch of {b}",
                self.norms.len(),
                self.coefficients.len()
            )));
        }
        Ok(())
    }
}

impl ClippingRule {
    /// The coefficient of norm n at clipping norm C.
    pub fn coefficient(&self, norm: f64, max_grad_norm: f64) -> f64 {
        self.clipping
            .coefficient(norm, max_grad_norm, self.stabilizer)
    }

    /// Whether a norm of n is clipped at all (automatic clipping scales every example).
    fn clips(&self, norm: f64, max_grad_norm: f64) -> bool {
        match self.clipping {
            Clipping::Flat => norm + self.stabilizer > max_grad_norm,
            Clipping::Automatic => true,
        }
    }
}

/// Which case a metric is of: the base case and, for a suite that tries several clipping norms,
/// C as a multiple of the case's median true norm.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CaseLabel {
    /// The case's name, without the clipping norm.
    pub base_case: String,
    /// C as a multiple of the case's median true norm; `None` when C was given.
    pub c_multiplier: Option<f64>,
}

impl CaseLabel {
    /// `tied-T2@C=0.5xmedian`, or the base case alone.
    pub fn label(&self) -> String {
        match self.c_multiplier {
            Some(m) => format!("{}@C={m}xmedian", self.base_case),
            None => self.base_case.clone(),
        }
    }
}

impl From<&str> for CaseLabel {
    fn from(base_case: &str) -> Self {
        CaseLabel {
            base_case: base_case.to_string(),
            c_multiplier: None,
        }
    }
}

/// One case's figures and verdict: a clipper's claim against the truth at one C and σ.
#[derive(Clone, Debug, Serialize)]
pub struct CaseMetrics {
    /// The label reports show ([`CaseLabel::label`]).
    pub case: String,
    /// The case's name, without the clipping norm.
    pub base_case: String,
    /// C as a multiple of the case's median true norm; `None` when C was given.
    pub c_multiplier: Option<f64>,
    /// C, the clipping norm the case was judged at.
    pub max_grad_norm: f64,
    /// σ, the stated noise multiplier.
    pub noise_multiplier: f64,
    /// The most severe finding over the examples (and the step, when there is one).
    pub verdict: Verdict,
    /// The example that decides the verdict.
    pub worst_example: usize,
    /// Largest |n_i − n*_i| / n*_i over the examples.
    pub max_norm_rel_err: f64,
    /// Largest error in units of its rounding bound (`err_units`) over the examples.
    pub max_err_units: f64,
    /// Largest |c_i − c*_i| over the examples.
    pub max_coef_abs_diff: f64,
    /// Examples whose clipping decision differs from the true one.
    pub decision_flips: usize,
    /// Largest clipped contribution c_i n*_i / C over the examples (above 1: privacy lost).
    pub max_sensitivity_ratio: f64,
    /// σ / max(1, `max_sensitivity_ratio`): the noise multiplier the run acts with.
    pub effective_noise_multiplier: f64,
    /// σC / ‖Σ c_i g_i*‖; `null` where the clipped signal is zero.
    pub effective_noise_ratio: Option<f64>,
    /// σC / ‖Σ c*_i g_i*‖, the same ratio with the true coefficients; `null` where that signal is zero.
    pub reference_noise_ratio: Option<f64>,
    /// Cosine of the clipped sums with the clipper's and the true coefficients; `null` where
    /// either is zero.
    pub clipped_sum_cosine: Option<f64>,
    /// ‖S − S*‖ / ‖S*‖ of the clipper's clipped sum; `null` where the clipper reported none or
    /// S* = 0 (the verdict then compares the absolute error with the absolute bound).
    pub clipped_sum_rel_err: Option<f64>,
    /// The rounding bound on `clipped_sum_rel_err`, relative to ‖S*‖; `null` with it.
    pub clipped_sum_bound: Option<f64>,
    /// Largest |2⟨g_in, g_out⟩| / ‖g*‖² of a tied parameter over the examples: how much the
    /// cross term a clipper may leave out weighs; `null` without a tied parameter.
    pub max_cross_share: Option<f64>,
    /// Examples whose norm or coefficient is invalid.
    pub invalid_examples: Vec<usize>,
    /// Examples whose bound is too loose to judge their norm.
    pub unjudgeable_examples: Vec<usize>,
    /// δ: a bound that lets a passing claim clip an example above C·(1 + δ) makes it
    /// unjudgeable (per precision, docs/tolerances.md).
    pub contribution_slack: f64,
    /// Why the loosest of `unjudgeable_examples` cannot be judged: which rule fired, with its
    /// numbers; `null` when every example can be judged.
    pub cannot_judge_reason: Option<String>,
    /// The largest relative bound over the examples.
    pub max_bound: f64,
    /// Sequence length and widest factor of the trace: what makes a low-precision bound grow.
    pub seq_len: usize,
    /// Widest factor (entries per row) of any site of the trace.
    pub widest_factor: usize,
    /// The largest clipped contribution c·n*/C, whatever the verdict (a correct clipper's
    /// rounding can exceed C too, and the run then spends more privacy than it states); `null`
    /// when a norm is invalid. This is what the run's ε is computed from, and it equals
    /// `max_sensitivity_ratio` otherwise.
    pub worst_contribution: Option<f64>,
    /// Every example's figures, in batch order.
    pub examples: Vec<ExampleMetrics>,
    /// The DP-SGD step, when the trace carries one; its verdict is folded into `verdict`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<StepMetrics>,
}

/// Compares a clipper's claim with the truth at clipping norm C and noise multiplier σ, for a
/// clipper working in unit roundoff `u`.
pub fn evaluate<F: Factors>(
    case: impl Into<CaseLabel>,
    truth: &Truth<F>,
    tolerance: &Tolerance,
    claim: &Claim,
    max_grad_norm: ClipNorm,
    noise_multiplier: NoiseMultiplier,
    arithmetic: &Arithmetic,
) -> Result<CaseMetrics> {
    let label_parts: CaseLabel = case.into();
    let label = label_parts.label();
    let c = max_grad_norm.get();
    let noise_multiplier = noise_multiplier.get();
    let b = truth.norms.len();
    claim.check_batch(b, &label)?;
    let true_coefs: Vec<f64> = truth
        .norms
        .iter()
        .map(|&n| claim.clipping.coefficient(n, c))
        .collect();
    let slack = tolerance.slack_at(arithmetic);
    let at = |tolerance: &Tolerance, i: usize, bound: f64| {
        let nt = truth.norms[i];
        let allowed = allowed_contribution(claim.clipping, nt, bound, c);
        // NaN is never within either threshold.
        let judgeable = bound <= tolerance.judgeable_bound && allowed <= 1.0 + slack;
        let mut e = example_metrics(truth, claim, i, true_coefs[i], (bound, judgeable), c);
        e.model_rounding = tolerance.model_rounding_bound(i, nt);
        e.allowed_contribution = allowed;
        e
    };
    // Deferred statistics (`Tolerance::from_trace_deferring`): an example whose findings are the
    // same at both ends of its bound has those findings at the exact bound too (each is
    // monotone in the bound); the others' figures are taken.
    let unsettled: Vec<usize> = (0..b)
        .filter(
            |&i| match tolerance.bound_interval(i, truth.norms[i], arithmetic) {
                Some((lo, hi)) => {
                    lo != hi && findings(&at(tolerance, i, lo)) != findings(&at(tolerance, i, hi))
                }
                None => true,
            },
        )
        .collect();
    let refined;
    let tolerance = if unsettled.iter().any(|&i| !tolerance.is_exact(i)) {
        let factors = truth.factors.as_ref().ok_or_else(|| {
            crate::error::Error::internal(
                "a tolerance with deferred statistics beside a truth without factors",
            )
        })?;
        refined = tolerance.refined(factors, &unsettled)?;
        &refined
    } else {
        tolerance
    };
    let examples: Vec<ExampleMetrics> = (0..b)
        .map(|i| {
            let nt = truth.norms[i];
            match tolerance.bound_interval(i, nt, arithmetic) {
                Some((lo, hi)) if lo != hi => {
                    let low = at(tolerance, i, lo);
                    let (invalid, _, privacy, off) = findings(&low);
                    let mut e = if invalid || privacy || off {
                        at(tolerance, i, hi)
                    } else {
                        low
                    };
                    e.bound_exact = false;
                    e
                }
                _ => at(tolerance, i, tolerance.bound(i, nt, arithmetic)),
            }
        })
        .collect();
    let fmax = |f: &dyn Fn(&ExampleMetrics) -> f64| examples.iter().map(f).fold(0.0_f64, nan_max);
    let invalid_examples: Vec<usize> = (0..b).filter(|&i| examples[i].invalid).collect();
    let unjudgeable_examples: Vec<usize> = (0..b).filter(|&i| !examples[i].judgeable).collect();
    let cannot_judge_reason = loosest(&examples, &unjudgeable_examples).map(|i| {
        UnjudgeableBound {
            example: i,
            metrics: &examples[i],
            judgeable_bound: tolerance.judgeable_bound,
            slack,
            precision: arithmetic.coarsest_precision(),
            method: tolerance.model_rounding.as_ref().map(|m| m.method.as_str()),
        }
        .reason()
    });
    let coefs_for_sum = for_sum(claim.coefficients.iter().copied());
    let (sig, sig_ref, cosine) = clipped_signals(&truth.gram, &coefs_for_sum, &true_coefs);
    let sum = clipped_sum_error(truth, tolerance, claim, &coefs_for_sum, arithmetic)?;

    let (verdict, worst_example) =
        case_verdict(&examples, &invalid_examples, &unjudgeable_examples);
    let max_ratio = fmax(&|e| e.sensitivity);
    let worst_contribution = (verdict != Verdict::InvalidNorm).then_some(max_ratio);
    let max_cross_share = examples
        .iter()
        .filter_map(|e| e.cross_share)
        .map(f64::abs)
        .reduce(nan_max);
    let mut metrics = CaseMetrics {
        case: label.clone(),
        base_case: label_parts.base_case,
        c_multiplier: label_parts.c_multiplier,
        max_grad_norm: c,
        noise_multiplier,
        verdict,
        worst_example,
        max_norm_rel_err: fmax(&|e| e.norm_rel_err),
        max_err_units: fmax(&|e| e.err_units),
        max_coef_abs_diff: fmax(&|e| (e.coefficient - e.true_coefficient).abs()),
        decision_flips: examples.iter().filter(|e| e.flipped).count(),
        max_sensitivity_ratio: max_ratio,
        effective_noise_multiplier: noise_multiplier / nan_max(max_ratio, 1.0),
        effective_noise_ratio: ratio(noise_multiplier * c, sig),
        reference_noise_ratio: ratio(noise_multiplier * c, sig_ref),
        clipped_sum_cosine: cosine,
        clipped_sum_rel_err: None,
        clipped_sum_bound: None,
        max_cross_share,
        invalid_examples,
        unjudgeable_examples,
        contribution_slack: slack,
        cannot_judge_reason,
        max_bound: fmax(&|e| e.bound),
        seq_len: tolerance.seq_len,
        widest_factor: tolerance.widest_factor,
        worst_contribution,
        examples,
        step: None,
    };
    if let Some(sum) = sum {
        metrics.fold_clipped_sum(sum);
    }
    Ok(metrics)
}

/// The clipped signal with the claimed and with the true coefficients, ‖Σ c_i g_i*‖ = √(cᵀGc)
/// from the true per-example gradients, and the cosine of the two sums.
fn clipped_signals(
    gram: &[Vec<f64>],
    claimed: &[f64],
    true_coefs: &[f64],
) -> (f64, f64, Option<f64>) {
    let sig = bilinear(gram, claimed, claimed).max(0.0).sqrt();
    let sig_ref = bilinear(gram, true_coefs, true_coefs).max(0.0).sqrt();
    let cosine = ratio(bilinear(gram, claimed, true_coefs), sig * sig_ref);
    (sig, sig_ref, cosine)
}

/// One example's claim against the truth; `bound` is the rounding bound on its norm's relative
/// error and whether that bound is tight enough to judge it.
fn example_metrics<F: Factors>(
    truth: &Truth<F>,
    claim: &Claim,
    i: usize,
    true_coefficient: f64,
    (bound, judgeable): (f64, bool),
    c: f64,
) -> ExampleMetrics {
    let (n, nt) = (claim.norms[i], truth.norms[i]);
    let rel = if nt > 0.0 {
        (n - nt).abs() / nt
    } else if n == 0.0 {
        0.0
    } else {
        f64::INFINITY
    };
    let coef = claim.coefficients[i];
    // A negative norm is how a clipper reports a negative n²; rounding can explain one only
    // when the whole norm is within the bound of zero.
    let invalid = !n.is_finite() || (n < 0.0 && rel > bound) || !coef.is_finite() || coef < 0.0;
    ExampleMetrics {
        true_norm: nt,
        norm: n,
        norm_rel_err: if rel.is_nan() { f64::INFINITY } else { rel },
        bound,
        bound_exact: true,
        model_rounding: 0.0,
        allowed_contribution: 0.0,
        // An exact answer is 0 units even where the bound is 0.
        err_units: if rel == 0.0 {
            0.0
        } else if rel.is_nan() {
            f64::INFINITY
        } else {
            rel / bound
        },
        coefficient: coef,
        true_coefficient,
        sensitivity: coef * nt / c,
        flipped: claim.clipping.clips(n, c) != claim.clipping.clips(nt, c),
        cross_share: truth.cross_share[i],
        invalid,
        judgeable,
    }
}

/// A violation is one the truth's own uncertainty cannot explain: beyond the bound, and above C
/// even at the low end of the truth, which the model's measured rounding leaves known only to
/// within that share of it. Where that share reaches the norm itself the truth says nothing of
/// the contribution, and the example is left to cannot-judge.
fn violates_privacy(e: &ExampleMetrics) -> bool {
    e.sensitivity > 1.0 + e.bound && e.sensitivity * (1.0 - e.model_rounding) > 1.0
}

/// The claim is off the truth beyond the bound: its norm, or its coefficient. NaN counts as off:
/// it is never within the bound.
fn is_off(e: &ExampleMetrics) -> bool {
    let d = (e.coefficient - e.true_coefficient).abs();
    let coef_off = d.is_nan() || d > e.true_coefficient * 2.0 * e.bound + f64::EPSILON;
    coef_off || e.err_units > 1.0 || e.err_units.is_nan()
}

/// Everything the verdict reads of an example that depends on its bound: invalid, judgeable,
/// a privacy violation, off. Each is monotone in the bound (a larger bound makes each less
/// likely, `judgeable` included), so an example with the same findings at both ends of an
/// interval has them at every bound within it.
fn findings(e: &ExampleMetrics) -> (bool, bool, bool, bool) {
    (e.invalid, e.judgeable, violates_privacy(e), is_off(e))
}

/// The case's verdict from its examples, the most severe first, and the example that decided
/// it.
fn case_verdict(
    examples: &[ExampleMetrics],
    invalid_examples: &[usize],
    unjudgeable_examples: &[usize],
) -> (Verdict, usize) {
    let privacy = examples.iter().any(violates_privacy);
    // Off beyond its bound, on an example whose bound can judge it: a definite finding, which
    // another example's bound being too loose to judge does not make any less so (a claim
    // 1e-3 high on two examples is wrong beside a third whose norm is rounding noise).
    let judged_off = |i: usize| is_off(&examples[i]) && !unjudgeable_examples.contains(&i);
    let verdict = if !invalid_examples.is_empty() {
        Verdict::InvalidNorm
    } else if privacy {
        Verdict::PrivacyViolation
    } else if (0..examples.len()).any(judged_off) {
        Verdict::UtilityDistortion
    } else if !unjudgeable_examples.is_empty() {
        Verdict::CannotJudge
    } else {
        Verdict::Pass
    };
    let worst_example = match verdict {
        Verdict::InvalidNorm => invalid_examples[0],
        Verdict::PrivacyViolation => argmax(examples.iter().map(|e| e.sensitivity - e.bound)),
        Verdict::CannotJudge => {
            loosest(examples, unjudgeable_examples).expect("an unjudgeable example")
        }
        Verdict::UtilityDistortion => argmax(examples.iter().enumerate().map(|(i, e)| {
            if unjudgeable_examples.contains(&i) {
                f64::NEG_INFINITY
            } else {
                e.err_units
            }
        })),
        Verdict::Pass => argmax(examples.iter().map(|e| e.err_units)),
    };
    (verdict, worst_example)
}

/// The largest clipped contribution, in units of C, of a claim within `bound` of the true norm
/// n*: the lowest such claim, n*·(1 − bound), clips least. A bound of 1 or more allows a claim
/// of 0.
fn allowed_contribution(rule: ClippingRule, true_norm: f64, bound: f64, c: f64) -> f64 {
    if true_norm == 0.0 {
        return 0.0;
    }
    let lowest = true_norm * (1.0 - bound).max(0.0);
    rule.coefficient(lowest, c) * true_norm / c
}

/// The unjudgeable example with the loosest bound (NaN the loosest).
fn loosest(examples: &[ExampleMetrics], unjudgeable: &[usize]) -> Option<usize> {
    let first = *unjudgeable.first()?;
    let bound = |i: usize| {
        let b = examples[i].bound;
        if b.is_nan() {
            f64::INFINITY
        } else {
            b
        }
    };
    Some(unjudgeable.iter().copied().fold(
        first,
        |best, i| if bound(i) > bound(best) { i } else { best },
    ))
}

/// What made an example unjudgeable, for the reason a report prints.
struct UnjudgeableBound<'a> {
    example: usize,
    metrics: &'a ExampleMetrics,
    judgeable_bound: f64,
    slack: f64,
    precision: Precision,
    /// How the trace's `model.rounding` was measured, when it has one.
    method: Option<&'a str>,
}

impl UnjudgeableBound<'_> {
    /// Which rule fired, with its numbers: the bound past use (over a tenth of the norm), or a
    /// bound that lets a passing claim clip the example above C·(1 + δ); and, where the model's
    /// own rounding is most of the bound, that rounding.
    fn reason(&self) -> String {
        let (i, e, p) = (self.example, self.metrics, self.precision);
        let consequence = if e.bound <= self.judgeable_bound {
            format!(
                "a claim that much low would pass and clip it to {}·C, past C·(1 + δ) with δ = {:e} at {p}",
                contribution(e.allowed_contribution),
                self.slack
            )
        } else {
            format!(
                "over the {} past which a claim that far off would pass too",
                share(self.judgeable_bound)
            )
        };
        let model = e.model_rounding / super::tolerance::MODEL_ROUNDING_FACTOR;
        let times = super::tolerance::MODEL_ROUNDING_FACTOR;
        match self.method {
            Some(method) if e.model_rounding > 0.0 && 2.0 * e.model_rounding >= e.bound => {
                format!(
                    "example {i}: the model's own rounding, measured by `{method}`, is {} of its norm: above what {p} can judge (counted {times} times, the bound is {} of the norm: {consequence})",
                    share(model),
                    share(e.bound)
                )
            }
            Some(method) if e.model_rounding > 0.0 => format!(
                "example {i}: the rounding bound at {p} is {} of its norm ({} of it the model's own rounding, measured by `{method}`, counted {times} times): {consequence}",
                share(e.bound),
                share(e.model_rounding)
            ),
            Some(_) | None => format!(
                "example {i}: the rounding bound at {p} is {} of its norm: {consequence}",
                share(e.bound)
            ),
        }
    }
}

/// A fraction of a norm: a percentage to three digits, or a power of ten below 0.1 %.
fn share(x: f64) -> String {
    if !x.is_finite() {
        "∞".into()
    } else if x >= 1e-3 {
        format!("{:.3} %", 100.0 * x)
    } else {
        format!("{x:.2e}")
    }
}

/// A contribution in units of C: four decimals, or 1 + (s − 1) where those would hide it.
fn contribution(s: f64) -> String {
    if !s.is_finite() {
        "∞".into()
    } else if (s - 1.0).abs() >= 1e-3 {
        format!("{s:.4}")
    } else {
        format!("(1 + {:.2e})", s - 1.0)
    }
}

fn argmax(v: impl Iterator<Item = f64>) -> usize {
    let mut best = (0, f64::NEG_INFINITY);
    for (i, x) in v.enumerate() {
        let x = if x.is_nan() { f64::INFINITY } else { x };
        if x > best.1 {
            best = (i, x);
        }
    }
    best.0
}

/// ‖S − S*‖, ‖S*‖ and the bound on the first, in absolute terms: the clipper's clipped sum
/// against S* at its own coefficients.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SumError {
    pub err: f64,
    pub reference: f64,
    pub bound: f64,
}

impl CaseMetrics {
    /// Records the clipped sum's error; a sum off beyond its bound is a utility distortion
    /// unless the case is already worse (invalid, a privacy violation, or not judgeable). The
    /// worst example stays the one with the largest error, as for a distortion of the norms.
    pub(crate) fn fold_clipped_sum(&mut self, sum: SumError) {
        self.clipped_sum_rel_err = ratio(sum.err, sum.reference);
        self.clipped_sum_bound = ratio(sum.bound, sum.reference);
        let off = sum.err > sum.bound || sum.err.is_nan();
        if off && self.verdict == Verdict::Pass {
            self.verdict = Verdict::UtilityDistortion;
        }
    }

    /// The claimed coefficients the clipped sum is compared at.
    pub(crate) fn coefficients_for_sum(&self) -> Vec<f64> {
        for_sum(self.examples.iter().map(|e| e.coefficient))
    }
}

/// Claimed coefficients as the clipped sum is compared at them: an invalid one contributes
/// nothing (the verdict already says it is invalid).
fn for_sum(coefficients: impl Iterator<Item = f64>) -> Vec<f64> {
    coefficients
        .map(|v| if v.is_finite() { v } else { 0.0 })
        .collect()
}

/// The clipper's clipped sum S against S* = Σ_i c_i g_i* from the true gradients and the
/// clipper's own coefficients. `None` when there is nothing to compare (a trace file carries
/// norms only).
fn clipped_sum_error<F: Factors>(
    truth: &Truth<F>,
    tolerance: &Tolerance,
    claim: &Claim,
    coefs: &[f64],
    arithmetic: &Arithmetic,
) -> Result<Option<SumError>> {
    let Some(sum) = &claim.clipped_sum else {
        return Ok(None);
    };
    let Some(factors) = &truth.factors else {
        return Ok(None);
    };
    let mut err2 = 0.0;
    let mut ref2 = 0.0;
    // S* is rebuilt a block of rows at a time: Σ_i c_i G_ij summed over the parameter's sites.
    for_each_param_block(factors, 1, &mut |block| {
        let Block {
            param: name,
            sites: js,
            size: n,
            rows,
            cols,
        } = block;
        let got = &sum
            .iter()
            .find(|(p, _)| p == name)
            .ok_or_else(|| {
                Error::input(format!(
                    "the clipper's clipped sum has no entry for parameter `{name}`"
                ))
            })?
            .1;
        if got.len() != n {
            return Err(Error::input(format!(
                "clipped sum of `{name}` has {} values; expected {n}",
                got.len()
            )));
        }
        let mut want = Array2::zeros((rows.len(), cols));
        for &j in js {
            factors.add_site_gradient_rows(j, coefs, rows.clone(), &mut want)?;
        }
        let got = got.widened(rows.start * cols..rows.end * cols);
        for (g, w) in got.iter().zip(want.iter()) {
            err2 += (g - w) * (g - w);
            ref2 += w * w;
        }
        Ok(())
    })?;
    Ok(Some(SumError {
        err: err2.sqrt(),
        reference: ref2.sqrt(),
        bound: tolerance.clipped_sum_bound_at(coefs, arithmetic),
    }))
}
