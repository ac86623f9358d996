//! The judge on its own: cases built so their answer is known, for every rule that decides a
//! verdict.
//!
//! Every expected number below is worked out by hand (the arithmetic is in the comments) or is
//! an identity checked against the reference's own brute force (`Trace::materialized_norms`):
//! none comes from the judge code it tests. The truths and tolerances of the verdict tests are
//! built field by field, so each rule can be put exactly on its boundary.

use crate::common::{batch, cn, nm, reference_with_trace, tiny};
use ghost_oracle::judge::{evaluate, Arithmetic, CaseMetrics, Claim, Tolerance, Truth};
use ghost_oracle::{Judge, Precision, Verdict};
use ghost_oracle_reference::{
    ExampleReport, Floats, Reduction, Reference, Site, SiteKind, SiteSpec, Trace as RefTrace,
};
use ndarray::{arr2, Array2, Array3};

// ---------------------------------------------------------------------------------------------
// Hand-built truths and tolerances for the verdict rules.

/// The unit roundoff the verdict tests judge at: with it, a tolerance whose only non-zero input
/// is `dot_scale = E` has the norm bound ½·λu·4·E/n² = E/n² (docs/tolerances.md, λ = 8).
const U: f64 = 1.0 / 16.0;

fn truth(norms: &[f64], gram: Vec<Vec<f64>>) -> Truth {
    Truth {
        norms: norms.to_vec(),
        gram,
        cross_share: vec![None; norms.len()],
        factors: None,
        param_sq: Vec::new(),
    }
}

/// Uncorrelated examples: ⟨g_i, g_k⟩ = 0 for i ≠ k.
fn diag_truth(norms: &[f64]) -> Truth {
    let gram = (0..norms.len())
        .map(|i| {
            (0..norms.len())
                .map(|k| if i == k { norms[i] * norms[i] } else { 0.0 })
                .collect()
        })
        .collect();
    truth(norms, gram)
}

/// A tolerance whose norm bound at `U` is `bounds[i]` for a true norm `norms[i]` (dot_scale =
/// bound·n², every other input zero), with no clipped-sum scales.
fn tolerance(norms: &[f64], bounds: &[f64]) -> Tolerance {
    let tol = Tolerance {
        site_scale: Vec::new(),
        site_param: Vec::new(),
        n_params: 0,
        abs_terms: vec![0.0; norms.len()],
        dot_scale: norms.iter().zip(bounds).map(|(n, b)| b * n * n).collect(),
        sqrt_width: 0.0,
        seq_len: 0,
        largest_param: 0,
        // The verdict rules are put on their boundaries with bounds of a few tenths, whose
        // arithmetic is exact; the cannot-judge rules have their own tests.
        judgeable_bound: f64::INFINITY,
        contribution_slack: Some(f64::INFINITY),
        ..Default::default()
    };
    for (i, (&n, &b)) in norms.iter().zip(bounds).enumerate() {
        let got = tol.norm_bound(i, n, U);
        assert!(
            (got - b).abs() <= 1e-15 * b,
            "test set-up: bound {got} for {b}"
        );
    }
    tol
}

fn claim(norms: &[f64], coefficients: &[f64]) -> Claim {
    Claim {
        norms: norms.to_vec(),
        coefficients: coefficients.to_vec(),
        clipped_sum: None,
        clipping: Default::default(),
    }
}

fn judge(truth: &Truth, tol: &Tolerance, claim: &Claim, c: f64, sigma: f64) -> CaseMetrics {
    evaluate(
        "hand",
        truth,
        tol,
        claim,
        cn(c),
        nm(sigma),
        &Arithmetic::Uniform(U),
    )
    .unwrap()
}

fn close(got: f64, want: f64) -> bool {
    (got - want).abs() <= 1e-14 * want.abs()
}

#[track_caller]
fn assert_close(got: f64, want: f64) {
    assert!(close(got, want), "got {got:e}, want {want:e}");
}

#[track_caller]
fn assert_close_opt(got: Option<f64>, want: f64) {
    match got {
        Some(g) => assert_close(g, want),
        None => panic!("got None, want {want:e}"),
    }
}

/// Three examples with g0 = (1, 0), g1 = (0, 3), g2 = (2, 0): norms 1, 3, 2 and Gram
/// [[1, 0, 2], [0, 9, 0], [2, 0, 4]]. At C = 1.5 the true coefficients are 1, 0.5, 0.75.
fn three() -> (Truth, Tolerance) {
    let norms = [1.0, 3.0, 2.0];
    let mut t = truth(
        &norms,
        vec![
            vec![1.0, 0.0, 2.0],
            vec![0.0, 9.0, 0.0],
            vec![2.0, 0.0, 4.0],
        ],
    );
    t.cross_share = vec![Some(-0.5), Some(0.25), None];
    (t, tolerance(&norms, &[0.5, 0.125, 0.25]))
}

#[test]
fn an_exact_claim_passes_with_every_metric_at_its_hand_computed_value() {
    let (t, tol) = three();
    let m = judge(
        &t,
        &tol,
        &claim(&[1.0, 3.0, 2.0], &[1.0, 0.5, 0.75]),
        1.5,
        2.0,
    );
    assert_eq!(m.verdict, Verdict::Pass);
    // Every error is 0: the first of the tied examples is the worst.
    assert_eq!(m.worst_example, 0);
    assert_eq!(m.max_norm_rel_err, 0.0);
    assert_eq!(m.max_err_units, 0.0);
    assert_eq!(m.max_coef_abs_diff, 0.0);
    assert_eq!(m.decision_flips, 0);
    assert!(m.invalid_examples.is_empty());
    assert_eq!(m.worst_contribution, Some(1.0));
    let want_true = [1.0, 0.5, 0.75];
    // c·n*/C: 1·1/1.5, 0.5·3/1.5, 0.75·2/1.5.
    let want_sens = [2.0 / 3.0, 1.0, 1.0];
    for (i, e) in m.examples.iter().enumerate() {
        assert_eq!(e.true_coefficient, want_true[i], "example {i}");
        assert_close(e.sensitivity, want_sens[i]);
        assert!(!e.flipped && !e.invalid, "example {i}");
        assert_eq!(e.norm_rel_err, 0.0);
        assert_eq!(e.err_units, 0.0);
        assert_eq!(e.cross_share, t.cross_share[i]);
    }
    assert_close(m.max_sensitivity_ratio, 1.0);
    assert_close(m.effective_noise_multiplier, 2.0);
    // cᵀKc = 1·1 + 0.25·9 + 0.5625·4 + 2·(1·0.75·2) = 8.5; σC = 3.
    assert_close_opt(m.effective_noise_ratio, 3.0 / 8.5f64.sqrt());
    assert_close_opt(m.reference_noise_ratio, 3.0 / 8.5f64.sqrt());
    assert_close_opt(m.clipped_sum_cosine, 1.0);
    assert_eq!(m.max_cross_share, Some(0.5));
    assert_eq!(m.clipped_sum_rel_err, None);
    assert_eq!(m.clipped_sum_bound, None);
}

#[test]
fn an_under_estimated_norm_is_a_privacy_violation_with_hand_computed_metrics() {
    let (t, tol) = three();
    // Example 2 (n* = 2 > C) claims 1 ≤ C: coefficient 1, contribution 2/1.5 = 4/3 > 1 + 0.25.
    let m = judge(
        &t,
        &tol,
        &claim(&[1.0, 3.0, 1.0], &[1.0, 0.5, 1.0]),
        1.5,
        2.0,
    );
    assert_eq!(m.verdict, Verdict::PrivacyViolation);
    // sensitivity − bound: 2/3 − 0.5, 1 − 0.125, 4/3 − 0.25.
    assert_eq!(m.worst_example, 2);
    let e = &m.examples[2];
    assert_eq!(e.norm_rel_err, 0.5); // |1 − 2| / 2
    assert_eq!(e.bound, 0.25);
    assert_eq!(e.err_units, 2.0);
    assert!(e.flipped);
    assert_close(e.sensitivity, 4.0 / 3.0);
    assert_eq!(m.decision_flips, 1);
    assert_eq!(m.max_norm_rel_err, 0.5);
    assert_eq!(m.max_err_units, 2.0);
    assert_eq!(m.max_coef_abs_diff, 0.25);
    assert_close(m.max_sensitivity_ratio, 4.0 / 3.0);
    assert_close_opt(m.worst_contribution, 4.0 / 3.0);
    // σ / max(1, 4/3).
    assert_close(m.effective_noise_multiplier, 1.5);
    // c = (1, 0.5, 1): cᵀKc = 1 + 2.25 + 4 + 2·(1·1·2) = 11.25; with c* = (1, 0.5, 0.75):
    // cᵀKc* = 1·1·1 + 1·2·0.75 + 0.5·9·0.5 + 1·2·1 + 1·4·0.75 = 9.75.
    assert_close_opt(m.effective_noise_ratio, 3.0 / 11.25f64.sqrt());
    assert_close_opt(m.reference_noise_ratio, 3.0 / 8.5f64.sqrt());
    assert_close_opt(m.clipped_sum_cosine, 9.75 / (11.25f64 * 8.5).sqrt());
}

#[test]
fn the_worst_privacy_example_is_the_largest_overshoot_beyond_its_bound() {
    // Contributions s and bounds b: (1.2, 0.001), (2.0, 0.9), (1.9, 0.6). Beyond the bound:
    // 1.199, 1.1, 1.3 → example 2 (s + b would pick 1, s / b would pick 0).
    let norms = [1.0; 3];
    let t = diag_truth(&norms);
    let tol = tolerance(&norms, &[0.001, 0.9, 0.6]);
    let m = judge(&t, &tol, &claim(&norms, &[1.2, 2.0, 1.9]), 1.0, 1.0);
    assert_eq!(m.verdict, Verdict::PrivacyViolation);
    assert_eq!(m.worst_example, 2);
}

#[test]
fn the_worst_distorted_example_has_the_largest_error_in_units_of_its_bound() {
    // Over-estimates by 0.25·n*, 0.75·n*, 0.5·n*, bounds 0.125 each: 2, 6, 4 units.
    let norms = [2.0, 4.0, 8.0];
    let t = diag_truth(&norms);
    let tol = tolerance(&norms, &[0.125; 3]);
    let c = 16.0; // nothing clipped: coefficient 1 everywhere
    let m = judge(&t, &tol, &claim(&[2.5, 7.0, 12.0], &[1.0; 3]), c, 1.0);
    assert_eq!(m.verdict, Verdict::UtilityDistortion);
    assert_eq!(m.worst_example, 1);
    assert_eq!(m.max_err_units, 6.0);
    let m = judge(&t, &tol, &claim(&[2.5, 5.0, 14.0], &[1.0; 3]), c, 1.0);
    assert_eq!(m.worst_example, 2);
    assert_eq!(m.max_err_units, 6.0);
}

#[test]
fn each_rule_alone_decides_the_verdict() {
    // n* = 2, bound 0.25, C = 1: c* = 0.5, allowed |c − c*| ≤ 2·0.25·0.5 = 0.25.
    let norms = [2.0];
    let t = diag_truth(&norms);
    let tol = tolerance(&norms, &[0.25]);
    let v = |n: f64, coef: f64| judge(&t, &tol, &claim(&[n], &[coef]), 1.0, 1.0).verdict;
    assert_eq!(v(2.0, 0.5), Verdict::Pass);
    // The norm alone off (|4 − 2| / 2 = 4 bounds), the coefficient right.
    assert_eq!(v(4.0, 0.5), Verdict::UtilityDistortion);
    // The coefficient alone off beyond 2·bound·c* = 0.25 (0.3 low), the norm right.
    assert_eq!(v(2.0, 0.2), Verdict::UtilityDistortion);
    // Within 2·bound·c*: 0.1 low.
    assert_eq!(v(2.0, 0.4), Verdict::Pass);
    // A coefficient of 0 is a distortion, not an invalid norm.
    let m = judge(&t, &tol, &claim(&[2.0], &[0.0]), 1.0, 1.0);
    assert_eq!(m.verdict, Verdict::UtilityDistortion);
    assert!(m.invalid_examples.is_empty());
    // A claimed norm of 0 under-estimates: coefficient 1, contribution 2 — a privacy violation,
    // never an invalid norm (0 is not negative).
    let m = judge(&t, &tol, &claim(&[0.0], &[1.0]), 1.0, 1.0);
    assert_eq!(m.verdict, Verdict::PrivacyViolation);
    assert!(m.invalid_examples.is_empty());
    // A positive norm far off is not invalid either.
    let m = judge(&t, &tol, &claim(&[100.0], &[0.01]), 1.0, 1.0);
    assert_eq!(m.verdict, Verdict::UtilityDistortion);
    assert!(!m.examples[0].invalid);
}

#[test]
fn the_coefficient_rule_scales_with_the_true_coefficient_and_the_bound() {
    // n* = 2, bound 0.125, C = 1.5: c* = 0.75, allowed |c − c*| ≤ 2·0.125·0.75 = 0.1875.
    let norms = [2.0];
    let t = diag_truth(&norms);
    let tol = tolerance(&norms, &[0.125]);
    let v = |coef: f64| judge(&t, &tol, &claim(&[2.0], &[coef]), 1.5, 1.0).verdict;
    assert_eq!(v(0.75), Verdict::Pass);
    assert_eq!(v(0.65), Verdict::Pass); // 0.1 low
    assert_eq!(v(0.5), Verdict::UtilityDistortion); // 0.25 low
}

#[test]
fn a_coefficient_one_rounding_step_off_passes_under_a_tiny_bound() {
    // An f64 clipper's C/n can be one ulp off the truth's; with a norm bound of 1e-20 the
    // coefficient rule must still accept it (its slack is one f64 epsilon).
    let norms = [2.0];
    let t = diag_truth(&norms);
    let tol = tolerance(&norms, &[1e-20]);
    // One ulp below (above would make the contribution 1 + ε, a genuine overshoot).
    let c_star = 0.75;
    let off = c_star - f64::EPSILON / 2.0; // the f64 just below 0.75
    assert!(off < c_star);
    for coef in [c_star, off] {
        let m = judge(&t, &tol, &claim(&[2.0], &[coef]), 1.5, 1.0);
        assert_eq!(m.verdict, Verdict::Pass, "coefficient {coef:e}");
    }
    // Two hundred ulps off is beyond rounding.
    let m = judge(
        &t,
        &tol,
        &claim(&[2.0], &[c_star - 100.0 * f64::EPSILON]),
        1.5,
        1.0,
    );
    assert_eq!(m.verdict, Verdict::UtilityDistortion);
}

#[test]
fn the_rules_at_their_boundaries() {
    let norms = [2.0];
    let t = diag_truth(&norms);
    let tol = tolerance(&norms, &[0.25]);
    // Norm error exactly one bound (|2.5 − 2| / 2 = 0.25): within it.
    let m = judge(&t, &tol, &claim(&[2.5], &[1.0]), 4.0, 1.0);
    assert_eq!(m.examples[0].err_units, 1.0);
    assert_eq!(m.verdict, Verdict::Pass);
    // Contribution exactly 1 + bound (1.25·2/2): not a privacy violation (and the coefficient
    // is within 2·bound·c* = 0.5 of c* = 1).
    let m = judge(&t, &tol, &claim(&[2.0], &[1.25]), 2.0, 1.0);
    assert_eq!(m.examples[0].sensitivity, 1.25);
    assert_eq!(m.verdict, Verdict::Pass);
    // A negative norm exactly one bound from the truth is rounding: n* = 2, bound 1.25,
    // n = −0.5 → |−0.5 − 2| / 2 = 1.25.
    let wide = tolerance(&norms, &[1.25]);
    let m = judge(&t, &wide, &claim(&[-0.5], &[1.0]), 4.0, 1.0);
    assert_eq!(m.examples[0].norm_rel_err, 1.25);
    assert!(!m.examples[0].invalid);
    assert_ne!(m.verdict, Verdict::InvalidNorm);
    // The true norm exactly C is not clipped (c* = 1); a claim above it flips the decision.
    let m = judge(&t, &tol, &claim(&[2.25], &[1.0]), 2.0, 1.0);
    assert_eq!(m.examples[0].true_coefficient, 1.0);
    assert!(m.examples[0].flipped);
    // A claimed norm exactly C while the truth is above it flips the decision too.
    let m = judge(&t, &tol, &claim(&[1.5], &[1.0]), 1.5, 1.0);
    assert!(m.examples[0].flipped);
    assert_eq!(m.decision_flips, 1);
    // Both above C, or both at or below it: no flip.
    let m = judge(&t, &tol, &claim(&[2.5], &[0.6]), 1.5, 1.0);
    assert!(!m.examples[0].flipped);
    let m = judge(&t, &tol, &claim(&[2.5], &[1.0]), 3.0, 1.0);
    assert!(!m.examples[0].flipped);
}

#[test]
fn a_zero_true_norm_has_zero_error_only_for_a_zero_claim() {
    // The bound of a zero example is not exercised here (a non-zero dot scale keeps it finite);
    // only the relative error is.
    let t = diag_truth(&[0.0, 0.0]);
    let mut tol = tolerance(&[1.0, 1.0], &[0.25, 0.25]);
    tol.dot_scale = vec![1.0, 1.0];
    let m = judge(&t, &tol, &claim(&[0.0, 0.5], &[1.0, 1.0]), 1.0, 1.0);
    assert_eq!(m.examples[0].norm_rel_err, 0.0);
    assert_eq!(m.examples[1].norm_rel_err, f64::INFINITY);
}

#[test]
fn invalid_norms_and_coefficients_are_named_whatever_else_is_right() {
    let (t, tol) = three();
    let good_norms = [1.0, 3.0, 2.0];
    let good_coefs = [1.0, 0.5, 0.75];
    let invalid_at = |norms: &[f64], coefs: &[f64]| {
        let m = judge(&t, &tol, &claim(norms, coefs), 1.5, 2.0);
        assert_eq!(m.verdict, Verdict::InvalidNorm, "{norms:?} {coefs:?}");
        assert_eq!(m.worst_contribution, None);
        assert_eq!(m.worst_example, m.invalid_examples[0]);
        m
    };
    // A NaN norm alone (its coefficient finite).
    let m = invalid_at(&[1.0, f64::NAN, 2.0], &good_coefs);
    assert_eq!(m.invalid_examples, vec![1]);
    assert_eq!(m.examples[1].norm_rel_err, f64::INFINITY);
    // An infinite norm.
    let m = invalid_at(&[1.0, 3.0, f64::INFINITY], &good_coefs);
    assert_eq!(m.invalid_examples, vec![2]);
    // An infinite coefficient alone.
    let m = invalid_at(&good_norms, &[1.0, f64::INFINITY, 0.75]);
    assert_eq!(m.invalid_examples, vec![1]);
    // A negative coefficient alone.
    let m = invalid_at(&good_norms, &[1.0, 0.5, -0.75]);
    assert_eq!(m.invalid_examples, vec![2]);
    // A negative norm far beyond rounding (−n*).
    let m = invalid_at(&[1.0, -3.0, 2.0], &good_coefs);
    assert_eq!(m.invalid_examples, vec![1]);
    // A NaN coefficient: the metrics show NaN instead of dropping it.
    let m = invalid_at(&good_norms, &[1.0, f64::NAN, 0.75]);
    assert_eq!(m.invalid_examples, vec![1]);
    assert!(m.examples[1].sensitivity.is_nan());
    assert!(m.max_sensitivity_ratio.is_nan());
    assert!(m.effective_noise_multiplier.is_nan());
    assert!(m.max_coef_abs_diff.is_nan());
    // The clipped signal leaves the NaN coefficient out: c = (1, 0, 0.75) → cᵀKc = 1 + 2.25 +
    // 2·(1·0.75·2) = 6.25.
    assert_close_opt(m.effective_noise_ratio, 3.0 / 2.5);
}

#[test]
fn no_clipped_signal_has_no_noise_ratio_and_no_cosine() {
    let (t, tol) = three();
    let m = judge(&t, &tol, &claim(&[1.0, 3.0, 2.0], &[0.0; 3]), 1.5, 2.0);
    assert_eq!(m.effective_noise_ratio, None);
    assert_eq!(m.clipped_sum_cosine, None);
    assert_close_opt(m.reference_noise_ratio, 3.0 / 8.5f64.sqrt());
}

#[test]
fn a_claim_of_the_wrong_length_is_an_error() {
    let (t, tol) = three();
    for (norms, coefs) in [
        (vec![1.0, 3.0], vec![1.0, 0.5, 0.75]),
        (vec![1.0, 3.0, 2.0], vec![1.0, 0.5]),
    ] {
        let err = evaluate(
            "short",
            &t,
            &tol,
            &claim(&norms, &coefs),
            cn(1.5),
            nm(1.0),
            &Arithmetic::Uniform(U),
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("batch of 3"),
            "{norms:?} {coefs:?}: {err}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The clipped sum.

/// Two examples, parameters `w` (2 entries) and `b` (1): g0 = (0, 4 | 3), g1 = (1, 0 | 0), norms 5
/// and 1. At C = 2.5, c* = (0.5, 1) and S* = (1, 2 | 1.5), ‖S*‖² = 7.25. The sites' scales make
/// Σ_p (Σ_{j∈p} Σ_i |c_i| S_ij)² = 3² + 4² at c*, so at U with T = 0 the bound on ‖S − S*‖ is
/// u·4·5 = 1.25.
fn sum_case() -> (Truth, Tolerance) {
    let norms = [5.0, 1.0];
    let mut t = truth(&norms, vec![vec![25.0, 0.0], vec![0.0, 1.0]]);
    // Bias sites with T = 1 write their backprops as the gradient.
    let bias = |name: &str, rows: [&[f64]; 2]| Site {
        spec: SiteSpec {
            name: name.to_string(),
            param: name.to_string(),
            kind: SiteKind::Bias,
            vocab: None,
        },
        activations: None,
        ids: None,
        backprops: Array3::from_shape_fn((2, 1, rows[0].len()), |(i, _, k)| rows[i][k]),
        conv: None,
    };
    t.factors = Some(RefTrace {
        sites: vec![
            bias("w", [&[0.0, 4.0], &[1.0, 0.0]]),
            bias("b", [&[3.0], &[0.0]]),
        ],
    });
    let mut tol = tolerance(&norms, &[0.125, 0.125]);
    tol.site_scale = vec![vec![6.0, 0.0], vec![0.0, 4.0]];
    tol.site_param = vec![0, 1];
    tol.n_params = 2;
    (t, tol)
}

fn sum_claim(w: [f64; 2], b: f64) -> Claim {
    Claim {
        norms: vec![5.0, 1.0],
        coefficients: vec![0.5, 1.0],
        clipped_sum: Some(vec![
            ("b".to_string(), vec![b].into()),
            ("w".to_string(), w.to_vec().into()),
        ]),
        clipping: Default::default(),
    }
}

#[test]
fn the_clipped_sum_is_compared_with_the_true_gradients_per_parameter() {
    let (t, tol) = sum_case();
    let m = judge(&t, &tol, &sum_claim([1.0, 2.0], 1.5), 2.5, 1.0);
    assert_eq!(m.verdict, Verdict::Pass);
    assert_eq!(m.clipped_sum_rel_err, Some(0.0));
    assert_close_opt(m.clipped_sum_bound, 1.25 / 7.25f64.sqrt());
    // Off by exactly the bound: within it.
    let m = judge(&t, &tol, &sum_claim([1.0, 2.0], 1.5 + 1.25), 2.5, 1.0);
    assert_eq!(m.verdict, Verdict::Pass);
    assert_close_opt(m.clipped_sum_rel_err, 1.25 / 7.25f64.sqrt());
    // Off beyond it, in either parameter: a distortion, everything else being right.
    let m = judge(&t, &tol, &sum_claim([1.0, 2.0], 1.5 - 1.5), 2.5, 1.0);
    assert_eq!(m.verdict, Verdict::UtilityDistortion);
    assert_close_opt(m.clipped_sum_rel_err, 1.5 / 7.25f64.sqrt());
    assert_eq!(m.max_err_units, 0.0);
    assert_eq!(m.max_coef_abs_diff, 0.0);
    // (0.9, 2.6): error √(0.01 + 0.36).
    let m = judge(&t, &tol, &sum_claim([0.9, 2.6], 1.5), 2.5, 1.0);
    assert_eq!(m.verdict, Verdict::Pass);
    assert_close_opt(
        m.clipped_sum_rel_err,
        (0.01f64 + 0.36).sqrt() / 7.25f64.sqrt(),
    );
    let m = judge(&t, &tol, &sum_claim([1.0, 3.5], 1.5), 2.5, 1.0);
    assert_eq!(m.verdict, Verdict::UtilityDistortion);
    // A NaN entry is off.
    let m = judge(&t, &tol, &sum_claim([1.0, f64::NAN], 1.5), 2.5, 1.0);
    assert_eq!(m.verdict, Verdict::UtilityDistortion);
    assert_eq!(m.clipped_sum_rel_err, None);
}

#[test]
fn a_clipped_sum_missing_a_parameter_or_of_the_wrong_size_is_an_error() {
    let (t, tol) = sum_case();
    let error_of = |c: &Claim| {
        evaluate(
            "sum",
            &t,
            &tol,
            c,
            cn(2.5),
            nm(1.0),
            &Arithmetic::Uniform(U),
        )
        .unwrap_err()
    };
    let mut c = sum_claim([1.0, 2.0], 1.5);
    c.clipped_sum.as_mut().unwrap().remove(0);
    let err = error_of(&c);
    assert!(err.to_string().contains("`b`"), "{err}");
    let mut c = sum_claim([1.0, 2.0], 1.5);
    c.clipped_sum.as_mut().unwrap()[1].1 = vec![1.0, 2.0, 0.0].into();
    let err = error_of(&c);
    assert!(
        err.to_string().contains("has 3 values; expected 2"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------
// The bounds: docs/tolerances.md evaluated by hand.

fn bare_tolerance() -> Tolerance {
    Tolerance {
        site_scale: Vec::new(),
        site_param: Vec::new(),
        n_params: 0,
        abs_terms: Vec::new(),
        dot_scale: Vec::new(),
        sqrt_width: 0.0,
        seq_len: 0,
        largest_param: 0,
        judgeable_bound: f64::INFINITY,
        ..Default::default()
    }
}

#[test]
fn the_norm_bound_is_the_documented_formula() {
    // ½·[λu(4 + √p + √q)·E + λuT·Σ|terms| + λu₆₄√(T + P_max)·Σ|terms|] / n², λ = 8.
    // At u = u₆₄ = ε/2 the three parts are comparable. Example 1: √p + √q = 5, E = 1, T = 3,
    // P_max = 13, Σ|terms| = 2, n = 3: 4ε·(9 + 3·2 + 4·2) / 2 / 9 = 46ε/9.
    let mut tol = bare_tolerance();
    tol.sqrt_width = 5.0;
    tol.seq_len = 3;
    tol.largest_param = 13;
    tol.dot_scale = vec![7.0, 1.0];
    tol.abs_terms = vec![11.0, 2.0];
    let eps = f64::EPSILON;
    assert_close(tol.norm_bound(1, 3.0, eps / 2.0), 46.0 * eps / 9.0);
    // Example 0 in f32: u = 2⁻²⁴, E = 7, Σ|terms| = 11, n = 0.5:
    // ½·[8u·9·7 + 8u·3·11 + 4ε·4·11] / 0.25.
    let u = 2f64.powi(-24);
    let want = 0.5 * (8.0 * u * 9.0 * 7.0 + 8.0 * u * 3.0 * 11.0 + 4.0 * eps * 4.0 * 11.0) / 0.25;
    assert_close(tol.norm_bound(0, 0.5, u), want);
    // The dot-product part alone (no accumulation, no reference part): ½·8u·(4 + 5)·7 / 4.
    tol.seq_len = 0;
    tol.largest_param = 0;
    tol.abs_terms = vec![0.0, 0.0];
    assert_close(
        tol.norm_bound(0, 2.0, 0.125),
        0.5 * 8.0 * 0.125 * 9.0 * 7.0 / 4.0,
    );
}

#[test]
fn the_clipped_sum_bound_is_the_documented_formula() {
    // u(4 + λ√(B·T))·‖(Σ_{j∈p} Σ_i |c_i| S_ij)_p‖ with B = 2, T = 3, c = (1, −0.5), three
    // sites (two of parameter 0): parameter 0 gets (1·1 + 2·0.5) + (1·1 + 0·0.5) = 3, parameter
    // 1 gets 2·1 + 4·0.5 = 4, norm 5.
    let mut tol = bare_tolerance();
    tol.site_scale = vec![vec![1.0, 2.0], vec![1.0, 0.0], vec![2.0, 4.0]];
    tol.site_param = vec![0, 0, 1];
    tol.n_params = 2;
    tol.seq_len = 3;
    let u = 1.0 / 64.0;
    let want = u * (4.0 + 8.0 * 6f64.sqrt()) * 5.0;
    assert_close(tol.clipped_sum_bound(&[1.0, -0.5], u), want);
}

#[test]
fn unit_roundoffs_and_names_of_the_precisions() {
    let cases = [
        (Precision::F64, 2f64.powi(-53), "f64"),
        (Precision::F32, 2f64.powi(-24), "f32"),
        (Precision::F16, 2f64.powi(-11), "f16"),
        (Precision::BF16, 2f64.powi(-8), "bf16"),
    ];
    for (p, u, name) in cases {
        assert_eq!(p.unit_roundoff(), u, "{name}");
        assert_eq!(p.name(), name);
    }
    assert_eq!(Precision::F32.coarser(Precision::F64), Precision::F32);
    assert_eq!(Precision::F64.coarser(Precision::F32), Precision::F32);
    assert_eq!(Precision::F16.coarser(Precision::BF16), Precision::BF16);
    assert_eq!(Precision::F64.coarser(Precision::F64), Precision::F64);
}

#[test]
fn verdict_names_are_the_documented_ones_and_match_the_json() {
    for (v, name) in [
        (Verdict::Pass, "pass"),
        (Verdict::UtilityDistortion, "utility-distortion"),
        (Verdict::PrivacyViolation, "privacy-violation"),
        (Verdict::InvalidNorm, "invalid-norm"),
    ] {
        assert_eq!(v.name(), name);
        assert_eq!(serde_json::to_string(&v).unwrap(), format!("\"{name}\""));
    }
}

// ---------------------------------------------------------------------------------------------
// The truth and the tolerance of a hand-built trace.

/// A site of `hand_trace`: (name, param, kind, vocab), then its factors for example 0.
fn site(
    (name, param, kind, vocab): (&str, &str, SiteKind, Option<usize>),
    activations: Option<Array2<f64>>,
    ids: Option<Vec<i64>>,
    backprops: Array2<f64>,
    scales: &[f64],
) -> Site {
    let b = scales.len();
    let stack = |a: &Array2<f64>, scaled: bool| {
        let (t, w) = a.dim();
        Array3::from_shape_fn((b, t, w), |(i, tt, k)| {
            a[(tt, k)] * if scaled { scales[i] } else { 1.0 }
        })
    };
    Site {
        spec: SiteSpec {
            name: name.to_string(),
            param: param.to_string(),
            kind,
            vocab,
        },
        activations: activations.map(|a| stack(&a, false)),
        ids: ids.map(|ids| Array2::from_shape_fn((b, ids.len()), |(_, t)| ids[t])),
        backprops: stack(&backprops, true),
        conv: None,
    }
}

/// T = 2, every site kind, the embedding and a linear head tied. Example i is example 0 with
/// every backprop scaled by `scales[i]` (ids and activations unchanged), so its gradients scale
/// by s, its squared magnitudes by s².
///
/// Per site, with sides (l, r) (docs/tolerances.md), Σ|terms| = Σ_{t,s} |(l_t·l_s)(r_t·r_s)|,
/// D = Σ_t ‖l_t‖²‖r_t‖², scale = Σ_t ‖l_t‖‖r_t‖ and the gradient G:
///
/// - emb (ids 1, 1; e = (1, 2), (2, 0)): l·l = 1, r·r = 5, 2, 4 → Σ|terms| 13, D 9,
///   scale √5 + 2, G row 1 = (3, 2).
/// - head (h = (1, 0), (1, 3); δ = (0, 1, 0), (2, 1, 0)): δ·δ = 1, 1, 5; h·h = 1, 1, 10 →
///   Σ|terms| 1 + 2 + 50 = 53, D 51, scale 1 + √50, G = [[2, 6], [2, 3], [0, 0]].
/// - emb × head: δ_s[id_t] = 1 everywhere, e_t·h_s = 1, 7, 2, 2 → 12 (= ⟨G_emb, G_head⟩), twice.
/// - b (β = (1, −1), (−3, 0)): β·β = 2, −3, 9 → 17, D 11, scale √2 + 3, G = (−2, −1).
/// - ln (γ = (1, 2), (1, 1); x̂ = (3, 1), (−1, 0); γ⊙x̂ = (3, 2), (−1, 0)): 13, −3, 1 → 20,
///   D 14, scale √13 + 1, G = (2, 2).
/// - conv (a = (2), (1); g = (1, 1), (0, 2)): a·a = 4, 2, 1; g·g = 2, 2, 4 → 8 + 4 + 4 + 4 = 20,
///   D 12, scale 2√2 + 2, G = (2, 4).
///
/// - pos (ids 0, 1: distinct, so only t = s terms; p = (1, 1), (1, −2)): 2 + 5 = 7, D 7,
///   scale √2 + √5, G = [[1, 1], [1, −2]].
///
/// Σ|terms| = 13 + 53 + 24 + 17 + 20 + 20 + 7 = 154; the tied parameter's G = [[2, 6], [5, 5],
/// [0, 0]], ‖·‖² = 90 = 13 + 53 + 24; n² = 90 + 5 + 8 + 20 + 7 = 130.
fn hand_trace(scales: &[f64]) -> RefTrace {
    RefTrace {
        sites: vec![
            site(
                ("emb", "tied", SiteKind::Embedding, Some(3)),
                None,
                Some(vec![1, 1]),
                arr2(&[[1.0, 2.0], [2.0, 0.0]]),
                scales,
            ),
            site(
                ("head", "tied", SiteKind::Linear, None),
                Some(arr2(&[[1.0, 0.0], [1.0, 3.0]])),
                None,
                arr2(&[[0.0, 1.0, 0.0], [2.0, 1.0, 0.0]]),
                scales,
            ),
            site(
                ("b", "b", SiteKind::Bias, None),
                None,
                None,
                arr2(&[[1.0, -1.0], [-3.0, 0.0]]),
                scales,
            ),
            site(
                ("ln", "ln", SiteKind::LayerNorm, None),
                Some(arr2(&[[3.0, 1.0], [-1.0, 0.0]])),
                None,
                arr2(&[[1.0, 2.0], [1.0, 1.0]]),
                scales,
            ),
            site(
                ("conv", "conv", SiteKind::Conv1d, None),
                Some(arr2(&[[2.0], [1.0]])),
                None,
                arr2(&[[1.0, 1.0], [0.0, 2.0]]),
                scales,
            ),
            site(
                ("pos", "pos", SiteKind::Embedding, Some(2)),
                None,
                Some(vec![0, 1]),
                arr2(&[[1.0, 1.0], [1.0, -2.0]]),
                scales,
            ),
        ],
    }
}

const GRADIENT: [f64; 16] = [
    2.0, 6.0, 5.0, 5.0, 0.0, 0.0, -2.0, -1.0, 2.0, 2.0, 2.0, 4.0, 1.0, 1.0, 1.0, -2.0,
];

/// A per-head norm (Qwen3's q/k norms) is a site of T·H rows: its weight gradient sums over every
/// (position, head) pair, and the bound's accumulation length is that, not T.
#[test]
fn a_per_head_norm_site_sets_the_accumulation_length() {
    let mut t = hand_trace(&[1.0, 2.0, 0.0]);
    let ln = t.sites.iter_mut().find(|s| s.spec.name == "ln").unwrap();
    let heads =
        |a: &Array3<f64>| ndarray::concatenate(ndarray::Axis(1), &[a.view(), a.view()]).unwrap();
    ln.activations = ln.activations.as_ref().map(heads);
    ln.backprops = heads(&ln.backprops);
    assert_eq!(Tolerance::from_trace(&t).unwrap().seq_len, 4);
}

#[test]
fn the_tolerance_of_a_hand_built_trace() {
    let scales = [1.0, 2.0, 0.0];
    let tol = Tolerance::from_trace(&hand_trace(&scales)).unwrap();
    assert_eq!(tol.site_param, vec![0, 0, 1, 2, 3, 4]);
    assert_eq!(tol.n_params, 5);
    assert_eq!(tol.seq_len, 2);
    // p·q: emb 3·2, head 2·3, pos 2·2, the rest 1·2.
    assert_eq!(tol.largest_param, 6);
    // √p + √q: emb √3 + √2 (head the same), pos 2√2, b, ln and conv 1 + √2.
    assert_close(tol.sqrt_width, 3f64.sqrt() + 2f64.sqrt());
    let scale = [
        5f64.sqrt() + 2.0,
        1.0 + 50f64.sqrt(),
        2f64.sqrt() + 3.0,
        13f64.sqrt() + 1.0,
        2.0 * 2f64.sqrt() + 2.0,
        2f64.sqrt() + 5f64.sqrt(),
    ];
    let dot = (3.0 + 51f64.sqrt()).powi(2) + 11.0 + 14.0 + 12.0 + 7.0;
    for (i, s) in scales.iter().enumerate() {
        for (j, want) in scale.iter().enumerate() {
            let got = tol.site_scale[j][i];
            assert!(
                (got - s * want).abs() <= 1e-14 * want,
                "site {j} example {i}: {got} vs {}",
                s * want
            );
        }
        assert_eq!(tol.abs_terms[i], 154.0 * s * s, "example {i}");
        assert!(
            (tol.dot_scale[i] - dot * s * s).abs() <= 1e-13 * dot,
            "example {i}: {} vs {}",
            tol.dot_scale[i],
            dot * s * s
        );
    }
}

#[test]
fn the_truth_of_a_hand_built_trace() {
    let scales = [1.0, 2.0, 0.0];
    let truth = Truth::from_trace(hand_trace(&scales)).unwrap();
    let n2: f64 = 130.0;
    for (i, s) in scales.iter().enumerate() {
        assert_eq!(truth.norms[i], s * n2.sqrt(), "example {i}");
        for (k, r) in scales.iter().enumerate() {
            assert_eq!(truth.gram[i][k], s * r * n2, "({i}, {k})");
        }
    }
    // Σ_{j≠k}⟨G_j, G_k⟩ = 2·12 of 130; no share for the zero gradient.
    assert_close_opt(truth.cross_share[0], 24.0 / 130.0);
    assert_close_opt(truth.cross_share[1], 24.0 / 130.0);
    assert_eq!(truth.cross_share[2], None);
}

/// A claimed clipped sum of the hand-built trace split by parameter in its layout: `tied` 3×2
/// (both sites summed), `b` and `ln` and `conv` 2 values, `pos` 2×2.
fn hand_sum(scale: f64) -> Vec<(String, Floats)> {
    let g: Vec<f64> = GRADIENT.iter().map(|v| scale * v).collect();
    [
        ("tied", 0..6),
        ("b", 6..8),
        ("ln", 8..10),
        ("conv", 10..12),
        ("pos", 12..16),
    ]
    .into_iter()
    .map(|(p, r)| (p.to_string(), g[r].to_vec().into()))
    .collect()
}

#[test]
fn the_true_clipped_sum_is_rebuilt_from_the_factors_in_the_parameters_layout() {
    // Gradients s·G with s = (1, 2, 0) and ‖G‖² = 130. At C = √130 the true coefficients are
    // (1, ½, 1), so S* = 1·G + ½·2G + 1·0 = 2G, all small integers: exact.
    let scales = [1.0, 2.0, 0.0];
    let judge = Judge::from_trace(hand_trace(&scales)).unwrap();
    let n = 130f64.sqrt();
    let mut claim = Claim {
        norms: vec![n, 2.0 * n, 0.0],
        coefficients: vec![1.0, 0.5, 1.0],
        clipped_sum: Some(hand_sum(2.0)),
        clipping: Default::default(),
    };
    let m = judge
        .evaluate("hand", &claim, cn(n), nm(1.0), Precision::F64)
        .unwrap();
    assert_eq!(m.verdict, Verdict::Pass);
    assert_eq!(m.clipped_sum_rel_err, Some(0.0));
    // One value of `pos` off by 3: ‖S − S*‖ = 3 against ‖S*‖ = 2√130, and far beyond an f64
    // bound.
    let mut pos = hand_sum(2.0)[4].1.to_f64_vec();
    pos[3] += 3.0;
    claim.clipped_sum.as_mut().unwrap()[4].1 = pos.into();
    let m = judge
        .evaluate("hand", &claim, cn(n), nm(1.0), Precision::F64)
        .unwrap();
    assert_eq!(m.verdict, Verdict::UtilityDistortion);
    assert_close_opt(m.clipped_sum_rel_err, 3.0 / (2.0 * n));
    // The sum of G alone (half of S*) is the wrong sum everywhere.
    claim.clipped_sum = Some(hand_sum(1.0));
    let m = judge
        .evaluate("hand", &claim, cn(n), nm(1.0), Precision::F64)
        .unwrap();
    assert_close_opt(m.clipped_sum_rel_err, 0.5);
}

#[test]
fn tied_sites_writing_different_shapes_or_an_overflowing_norm_are_errors() {
    let mut t = hand_trace(&[1.0]);
    t.sites[0].spec.vocab = Some(4); // emb writes 4×2, head 3×2
    let err = Truth::from_trace(t).unwrap_err().to_string();
    assert!(
        err.contains("parameter `tied`") && err.contains("head"),
        "{err}"
    );
    let err = Truth::from_trace(hand_trace(&[1e200]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("overflows"), "{err}");
}

#[test]
fn the_truth_of_a_reference_run_takes_its_cross_share_from_the_split() {
    // The cross share 2⟨g_in, g_out⟩ / ‖g‖² against the reference trace's brute-force inner
    // products of the two sites of `wte`.
    let model = tiny(true, 1, 3);
    let r = reference_with_trace(&model, &batch(3, 6, 23, 5));
    let brute = r.trace.as_ref().unwrap().materialized_norms().unwrap();
    let kept = r.gradients.clone().expect("gradients kept");
    let truth = Truth::from_reference(r).unwrap();
    // The Gram rebuilt from the factors against the reference's own materialized gradients.
    for (i, gi) in kept.iter().enumerate() {
        for (k, gk) in kept.iter().enumerate() {
            let want: f64 = gi.iter().zip(gk).map(|(a, b)| a * b).sum();
            let scale = truth.norms[i] * truth.norms[k];
            assert!(
                (truth.gram[i][k] - want).abs() <= 1e-12 * scale,
                "({i}, {k}): {} vs {want}",
                truth.gram[i][k]
            );
        }
    }
    assert_eq!(truth.cross_share.len(), 3);
    for (i, m) in brute.iter().enumerate() {
        let inner = m.shared_inner.values().next().expect("a tied parameter");
        let want = 2.0 * inner[0][1] / m.total_sq;
        let got = truth.cross_share[i].expect("a non-zero gradient");
        assert!(
            (got - want).abs() <= 1e-9 * want.abs().max(1e-3),
            "example {i}: {got} vs {want}"
        );
        assert!(want.abs() > 1e-3, "example {i}: the cross term must matter");
        assert!(((truth.norms[i] * truth.norms[i]) - m.total_sq).abs() <= 1e-9 * m.total_sq);
    }
}

#[test]
fn a_reference_with_a_zero_gradient_agrees_with_its_factors_at_zero() {
    // The hand-built trace's gradients are s·G with ‖G‖² = 130; with s = 0 the materialized
    // norm and the factors' Gram diagonal are both exactly 0, which is agreement (a check that
    // called an equal difference of 0 a disagreement would stop here).
    let example = |norm: f64| ExampleReport {
        loss: 1.0,
        norm,
        params: Vec::new(),
        shared: Vec::new(),
    };
    let r = Reference {
        reduction: Reduction::Sum,
        examples: vec![example(130f64.sqrt()), example(0.0)],
        trace: Some(hand_trace(&[1.0, 0.0])),
        layout: Vec::new(),
        gradients: None,
    };
    let truth = Truth::from_reference(r).unwrap();
    assert_eq!(truth.norms, vec![130f64.sqrt(), 0.0]);
    assert_eq!(truth.gram, vec![vec![130.0, 0.0], vec![0.0, 0.0]]);
    assert_eq!(truth.cross_share[1], None);
}

#[test]
fn the_factors_and_the_materialized_norms_agree_to_one_part_in_a_million_at_any_scale() {
    // Gradients 10⁴·G (‖g‖² = 1.3e10 from the factors, exactly). A materialized norm² that
    // differs by 2e-9 relative (26 in absolute terms) is rounding; 2e-5 relative is a bug.
    let n2 = 130.0e8_f64;
    let with = |rel: f64| Reference {
        reduction: Reduction::Sum,
        examples: vec![ExampleReport {
            loss: 1.0,
            norm: (n2 * (1.0 + rel)).sqrt(),
            params: Vec::new(),
            shared: Vec::new(),
        }],
        trace: Some(hand_trace(&[1e4])),
        layout: Vec::new(),
        gradients: None,
    };
    let truth = Truth::from_reference(with(2e-9)).unwrap();
    assert_eq!(truth.gram, vec![vec![n2]]);
    let err = Truth::from_reference(with(2e-5)).unwrap_err().to_string();
    assert!(err.contains("materialized"), "{err}");
}

#[test]
fn a_reference_whose_factors_disagree_with_its_gradients_is_an_internal_error() {
    let model = tiny(true, 1, 3);
    let mut r = reference_with_trace(&model, &batch(2, 6, 23, 5));
    // The head's backprops doubled: the factors no longer give the materialized gradient.
    let trace = r.trace.as_mut().unwrap();
    let head = trace.sites.len() - 1;
    trace.sites[head].backprops *= 2.0;
    let err = Truth::from_reference(r).unwrap_err().to_string();
    assert!(
        err.contains("example 0") && err.contains("materialized"),
        "{err}"
    );
}

#[test]
fn an_example_with_a_zero_gradient_and_an_exact_zero_claim_passes() {
    // Example 1's backprops are all zero: its gradient, its every term and its norm are 0, so
    // a claim of 0 is exact; any other claim is infinitely wrong relative to 0.
    let rt = synthetic_zero_second_example();
    let judge = Judge::from_trace(rt.clone()).unwrap();
    assert_eq!(judge.truth.norms[1], 0.0);
    assert_eq!(
        judge
            .tolerance
            .norm_bound(1, 0.0, Precision::F32.unit_roundoff()),
        0.0
    );
    let n0 = judge.truth.norms[0];
    let c = 2.0 * n0;
    let exact = Claim {
        norms: vec![n0, 0.0],
        coefficients: vec![1.0, 1.0],
        clipped_sum: None,
        clipping: Default::default(),
    };
    let m = judge
        .evaluate("zero", &exact, cn(c), nm(1.0), Precision::F64)
        .unwrap();
    assert_eq!(m.verdict, Verdict::Pass, "{:?}", m.examples[1]);
    assert_eq!(m.examples[1].err_units, 0.0);
    let off = Claim {
        norms: vec![n0, 1e-3],
        ..exact
    };
    let m = judge
        .evaluate("zero", &off, cn(c), nm(1.0), Precision::F64)
        .unwrap();
    assert_eq!(m.verdict, Verdict::UtilityDistortion);
    assert_eq!(m.worst_example, 1);
}

fn synthetic_zero_second_example() -> RefTrace {
    let spec = crate::common::tiny_synthetic_spec();
    let mut rt = ghost_oracle::synthetic::synthetic_trace(&spec, 9);
    for s in &mut rt.sites {
        s.backprops.slice_mut(ndarray::s![1, .., ..]).fill(0.0);
    }
    rt
}

#[test]
fn a_table_larger_than_a_block_is_judged_block_by_block_with_every_row_in_its_place() {
    // An embedding of 600,000 rows × 16 (2 examples: 154 MB of f64 rows, more than one 64 MB
    // block) read at ids 0, 300,000 and 599,999, the first and last rows of the table. Example 0
    // writes 1 in each read row, example 1 writes 2: ‖g_0‖² = 3·16 = 48, ‖g_1‖² = 192,
    // ⟨g_0, g_1⟩ = 96. With c = (1, ½), S* = g_0 + ½g_1 has 2 in the three rows.
    let (v, d, ids) = (600_000_usize, 16_usize, [0_i64, 300_000, 599_999]);
    let site = Site {
        spec: SiteSpec {
            name: "wte".into(),
            param: "wte".into(),
            kind: SiteKind::Embedding,
            vocab: Some(v),
        },
        activations: None,
        ids: Some(Array2::from_shape_fn((2, 3), |(_, t)| ids[t])),
        backprops: Array3::from_shape_fn((2, 3, d), |(i, _, _)| (i + 1) as f64),
        conv: None,
    };
    let judge = Judge::from_trace(RefTrace { sites: vec![site] }).unwrap();
    assert_eq!(judge.truth.norms, vec![48f64.sqrt(), 192f64.sqrt()]);
    assert_eq!(judge.truth.gram, vec![vec![48.0, 96.0], vec![96.0, 192.0]]);
    let mut sum = vec![0.0; v * d];
    for &x in &ids {
        sum[x as usize * d..(x as usize + 1) * d].fill(2.0);
    }
    let c = 48f64.sqrt();
    let mut claim = Claim {
        norms: judge.truth.norms.clone(),
        coefficients: vec![1.0, 0.5],
        clipped_sum: Some(vec![("wte".to_string(), sum.clone().into())]),
        clipping: Default::default(),
    };
    let m = judge
        .evaluate("big", &claim, cn(c), nm(1.0), Precision::F64)
        .unwrap();
    assert_eq!(m.clipped_sum_rel_err, Some(0.0));
    assert_eq!(m.verdict, Verdict::Pass);
    // The last value of the table off by 6: ‖S − S*‖ = 6 of ‖S*‖ = √(3·16·4) = √192.
    let mut off = sum;
    off[v * d - 1] += 6.0;
    claim.clipped_sum.as_mut().unwrap()[0].1 = off.into();
    let m = judge
        .evaluate("big", &claim, cn(c), nm(1.0), Precision::F64)
        .unwrap();
    assert_close_opt(m.clipped_sum_rel_err, 6.0 / 192f64.sqrt());
    assert_eq!(m.verdict, Verdict::UtilityDistortion);
}
