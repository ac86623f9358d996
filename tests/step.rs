//! The DP-SGD step judged from a trace: a library's clipped sum, and its update at σ = 0,
//! against S* = Σ c*_i g*_i. The truth here is built by hand: every per-example gradient is
//! materialized in the test itself (G_i = Σ_t δ_it a_itᵀ), independently of the judge.

use crate::cli::{expect_input_error, tmp};
use ghost_oracle::audit::check_trace;
use ghost_oracle::{CheckOptions, Verdict};
use ghost_oracle_reference::{write_trace, Clipping, Precision, Site, SiteKind, SiteSpec};
use ghost_oracle_reference::{SplitMix64, StepClaim, Trace as RefTrace, TraceMeta};
use ndarray::Array3;
use std::path::{Path, PathBuf};

const B: usize = 4;
const T: usize = 5;
const P: usize = 3;
const Q: usize = 2;
const DIVISOR: f64 = 4.0;

/// Two linear sites of one 2×3 weight (a tied pair) and a bias: a small model's step.
fn trace() -> RefTrace {
    let mut rng = SplitMix64::new(21);
    let mut arr = |w: usize| Array3::from_shape_fn((B, T, w), |_| rng.uniform() - 0.5);
    let site = |name: &str, param: &str, kind, activations, backprops| Site {
        spec: SiteSpec {
            name: name.into(),
            param: param.into(),
            kind,
            vocab: None,
        },
        activations,
        ids: None,
        backprops,
    };
    let (a1, d1, a2, d2, db) = (arr(P), arr(Q), arr(P), arr(Q), arr(Q));
    RefTrace {
        sites: vec![
            site("w.first", "w", SiteKind::Linear, Some(a1), d1),
            site("w.second", "w", SiteKind::Linear, Some(a2), d2),
            site("b", "b", SiteKind::Bias, None, db),
        ],
    }
}

/// Example i's gradient per parameter, materialized here: (w as Q×P row-major, b).
fn gradient(t: &RefTrace, i: usize) -> (Vec<f64>, Vec<f64>) {
    let mut w = vec![0.0; Q * P];
    for s in &t.sites[..2] {
        let a = s.activations.as_ref().unwrap();
        for tt in 0..T {
            for o in 0..Q {
                for k in 0..P {
                    w[o * P + k] += s.backprops[(i, tt, o)] * a[(i, tt, k)];
                }
            }
        }
    }
    let b = (0..Q)
        .map(|o| (0..T).map(|tt| t.sites[2].backprops[(i, tt, o)]).sum())
        .collect();
    (w, b)
}

fn norm(g: &(Vec<f64>, Vec<f64>)) -> f64 {
    g.0.iter().chain(&g.1).map(|v| v * v).sum::<f64>().sqrt()
}

/// Σ_i w_i g_i per parameter.
fn weighted(t: &RefTrace, w: &[f64]) -> Vec<(String, Vec<f64>)> {
    let mut sw = vec![0.0; Q * P];
    let mut sb = vec![0.0; Q];
    for (i, wi) in w.iter().enumerate() {
        let (gw, gb) = gradient(t, i);
        sw.iter_mut().zip(&gw).for_each(|(s, g)| *s += wi * g);
        sb.iter_mut().zip(&gb).for_each(|(s, g)| *s += wi * g);
    }
    vec![("w".into(), sw), ("b".into(), sb)]
}

/// C at the median norm, the exact norms as the claim, and the exact coefficients.
fn setup() -> (RefTrace, f64, Vec<f64>, Vec<f64>) {
    let t = trace();
    let norms: Vec<f64> = (0..B).map(|i| norm(&gradient(&t, i))).collect();
    let mut sorted = norms.clone();
    sorted.sort_by(f64::total_cmp);
    let c = 0.5 * (sorted[1] + sorted[2]);
    let coefs = norms.iter().map(|n| (c / n).min(1.0)).collect();
    (t, c, norms, coefs)
}

fn write(
    name: &str,
    sum: Option<Vec<(String, Vec<f64>)>>,
    update: Option<Vec<(String, Vec<f64>)>>,
    sigma: f64,
) -> PathBuf {
    let (t, c, norms, _) = setup();
    let path = tmp(&format!("step-{name}")).join("t.safetensors");
    let meta = TraceMeta {
        max_grad_norm: c,
        noise_multiplier: Some(sigma),
        clipper: Some(name.into()),
        claimed_norms: norms,
        claimed_coefficients: None,
        dtype: Precision::F64,
        compute_dtype: None,
        site_compute_dtypes: Vec::new(),
        site_dtypes: Vec::new(),
        step: Some(StepClaim {
            batch_divisor: update.as_ref().map(|_| DIVISOR),
            clipped_sum: sum,
            update,
            clip_stabilizer: 0.0,
            clipping: Clipping::Flat,
        }),
    };
    write_trace(&path, &t, &meta).unwrap();
    path
}

fn scaled(s: &[(String, Vec<f64>)], k: f64) -> Vec<(String, Vec<f64>)> {
    s.iter()
        .map(|(p, v)| (p.clone(), v.iter().map(|x| x * k).collect()))
        .collect()
}

fn judge(path: &Path) -> ghost_oracle::ClipperAudit {
    check_trace(path, &CheckOptions::default()).unwrap()
}

#[test]
fn the_exact_clipped_sum_and_update_pass() {
    let (t, _, _, coefs) = setup();
    let s = weighted(&t, &coefs);
    let a = judge(&write(
        "exact",
        Some(s.clone()),
        Some(scaled(&s, 1.0 / DIVISOR)),
        0.0,
    ));
    let step = a.cases[0].step.as_ref().unwrap();
    assert_eq!(a.verdict, Verdict::Pass, "{step:?}");
    for check in [&step.clipped_sum, &step.update] {
        let check = check.as_ref().unwrap();
        assert_eq!(check.verdict, Verdict::Pass);
        assert!(check.rel_err.unwrap() < 1e-13, "{check:?}");
        // The implied coefficients are the true ones: the batch's Gram is regular here.
        for (ci, want) in check.implied_coefficients.iter().zip(&coefs) {
            assert!((ci - want).abs() < 1e-9, "{ci} vs {want}");
        }
        assert!((check.scale.unwrap() - 1.0).abs() < 1e-12);
        assert!(check.unexplained.unwrap() < 1e-6);
    }
}

#[test]
fn a_lost_micro_batch_is_named_and_is_a_distortion() {
    // Only the second micro-batch (examples 2 and 3) reached the sum: Opacus ghost mode with
    // two backward passes before one step.
    let (t, _, _, coefs) = setup();
    let last = [0.0, 0.0, coefs[2], coefs[3]];
    let s = weighted(&t, &last);
    let a = judge(&write(
        "lost",
        Some(s.clone()),
        Some(scaled(&s, 1.0 / DIVISOR)),
        0.0,
    ));
    let step = a.cases[0].step.as_ref().unwrap();
    let check = step.clipped_sum.as_ref().unwrap();
    assert_eq!(check.verdict, Verdict::UtilityDistortion, "{check:?}");
    assert_eq!(a.verdict, Verdict::UtilityDistortion);
    assert!(
        check.implied_coefficients[0].abs() < 1e-9 && check.implied_coefficients[1].abs() < 1e-9
    );
    assert!((check.implied_coefficients[3] - coefs[3]).abs() < 1e-9);
}

#[test]
fn a_sum_five_percent_high_is_a_privacy_violation_and_spends_epsilon() {
    let (t, _, _, coefs) = setup();
    let s = scaled(&weighted(&t, &coefs), 1.05);
    let a = judge(&write("high", Some(s), None, 1.0));
    let check = a.cases[0]
        .step
        .as_ref()
        .unwrap()
        .clipped_sum
        .as_ref()
        .unwrap();
    assert_eq!(check.verdict, Verdict::PrivacyViolation, "{check:?}");
    assert!((check.implied_sensitivity - 1.05).abs() < 1e-9);
    assert!((check.scale.unwrap() - 1.05).abs() < 1e-12);
    assert_eq!(
        a.privacy.worst_contribution,
        Some(check.implied_sensitivity)
    );
    assert!(a.privacy.actual() > a.privacy.stated_epsilon);
}

#[test]
fn a_divisor_one_and_a_half_times_the_applied_one_shows_as_a_scale() {
    let (t, _, _, coefs) = setup();
    let s = weighted(&t, &coefs);
    let a = judge(&write(
        "divisor",
        None,
        Some(scaled(&s, 1.0 / (1.5 * DIVISOR))),
        0.0,
    ));
    let check = a.cases[0].step.as_ref().unwrap().update.as_ref().unwrap();
    assert_eq!(check.verdict, Verdict::UtilityDistortion);
    assert!(
        (check.scale.unwrap() - 1.0 / 1.5).abs() < 1e-12,
        "{check:?}"
    );
}

#[test]
fn another_batchs_update_is_unexplained() {
    // A sum along no combination of this batch's gradients: the bias of every example shifted.
    let (t, _, _, coefs) = setup();
    let mut s = weighted(&t, &coefs);
    s[1].1 = vec![3.0, -2.0];
    s[0].1.iter_mut().for_each(|v| *v = 1.0);
    let a = judge(&write("other", None, Some(scaled(&s, 1.0 / DIVISOR)), 0.0));
    let check = a.cases[0].step.as_ref().unwrap().update.as_ref().unwrap();
    assert_ne!(check.verdict, Verdict::Pass);
    assert!(check.unexplained.unwrap() > 0.1, "{check:?}");
}

#[test]
fn under_noise_the_clipped_sum_is_judged_and_the_update_is_said_not_to_be() {
    let (t, _, _, coefs) = setup();
    let s = weighted(&t, &coefs);
    let noisy: Vec<_> = scaled(&s, 1.0 / DIVISOR)
        .into_iter()
        .map(|(p, v)| (p, v.iter().map(|x| x + 0.3).collect()))
        .collect();
    let a = judge(&write("noisy", Some(s), Some(noisy), 1.0));
    let step = a.cases[0].step.as_ref().unwrap();
    assert!(step.update.is_none() && step.update_not_judged);
    assert_eq!(step.clipped_sum.as_ref().unwrap().verdict, Verdict::Pass);
    assert_eq!(a.verdict, Verdict::Pass);
}

#[test]
fn a_nan_in_the_sum_is_invalid() {
    let (t, _, _, coefs) = setup();
    let mut s = weighted(&t, &coefs);
    s[0].1[2] = f64::NAN;
    let a = judge(&write("nan", Some(s), None, 0.0));
    assert_eq!(a.verdict, Verdict::InvalidNorm);
}

#[test]
fn malformed_step_keys_are_named() {
    let (t, _, _, coefs) = setup();
    let s = weighted(&t, &coefs);
    // A sum for one parameter only.
    let path = write("partial", Some(vec![s[0].clone()]), None, 0.0);
    expect_input_error(
        &["check", path.to_str().unwrap()],
        &["claimed.clipped_sum.b", "is missing"],
    );
    // A sum of the wrong size.
    let mut short = s.clone();
    short[1].1.pop();
    let path = write("short", Some(short), None, 0.0);
    expect_input_error(
        &["check", path.to_str().unwrap()],
        &["claimed.clipped_sum.b", "has 1 values", "2×1"],
    );
    // A sum naming no parameter.
    let mut extra = s.clone();
    extra.push(("ghost".into(), vec![0.0]));
    let path = write("extra", Some(extra), None, 0.0);
    expect_input_error(
        &["check", path.to_str().unwrap()],
        &["claimed.clipped_sum.ghost", "names no parameter"],
    );
}

#[test]
fn an_update_without_its_divisor_is_refused() {
    let (t, c, norms, coefs) = setup();
    let path = tmp("step-nodivisor").join("t.safetensors");
    let meta = TraceMeta {
        max_grad_norm: c,
        noise_multiplier: Some(0.0),
        clipper: None,
        claimed_norms: norms,
        claimed_coefficients: None,
        dtype: Precision::F64,
        compute_dtype: None,
        site_compute_dtypes: Vec::new(),
        site_dtypes: Vec::new(),
        step: Some(StepClaim {
            clipped_sum: None,
            update: Some(weighted(&t, &coefs)),
            batch_divisor: None,
            clip_stabilizer: 0.0,
            clipping: Clipping::Flat,
        }),
    };
    write_trace(&path, &t, &meta).unwrap();
    expect_input_error(&["check", path.to_str().unwrap()], &["batch_divisor"]);
}
