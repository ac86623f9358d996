//! The audit in ε: stated and actual ε per clipper, the σ that would keep the stated ε, the
//! `--max-epsilon` gate, and the accounting flags' errors.

use crate::cli::{expect_input_error, run, stderr, tmp};
use ghost_oracle::accountant::{default_orders, epsilon};

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn audit_json(clipper: &str, extra: &[&str]) -> (Option<i32>, serde_json::Value, String) {
    let dir = tmp(&format!("privacy-{clipper}-{}", extra.join("-")));
    let json = dir.join("a.json");
    let mut args = vec![
        "audit",
        "--clipper",
        clipper,
        "--sampling-rate",
        "0.01",
        "--steps",
        "1000",
        "--delta",
        "1e-5",
        "--json",
        json.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let o = run(&args);
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    let doc = serde_json::from_str(&std::fs::read_to_string(&json).unwrap_or_default())
        .unwrap_or(serde_json::Value::Null);
    (o.status.code(), doc, stdout(&o))
}

#[test]
fn ghost_states_a_larger_actual_epsilon_and_ghost_tied_keeps_its_stated_one() {
    let orders = default_orders();
    let (code, doc, out) = audit_json("ghost", &[]);
    assert_eq!(code, Some(0), "{out}");
    let p = &doc["clippers"][0]["privacy"];
    let stated = p["stated_epsilon"].as_f64().unwrap();
    let actual = p["actual_epsilon"].as_f64().unwrap();
    let s = p["worst_contribution"].as_f64().unwrap();
    let needed = p["sigma_needed"].as_f64().unwrap();
    assert_eq!(p["sampling_rate"], 0.01);
    assert_eq!(p["steps"], 1000);
    assert_eq!(p["delta"], 1e-5);
    assert_eq!(p["default_setting"], false);
    // The worst overshoot is the largest clipped contribution of any case.
    let max_sens = doc["clippers"][0]["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["max_sensitivity_ratio"].as_f64().unwrap())
        .fold(0.0, f64::max);
    assert!(
        s > 1.0 && (s - max_sens).abs() <= 1e-12 * s,
        "{s} vs {max_sens}"
    );
    // Stated ε at σ = 1, actual at σ/s: the accountant's own numbers at those σ.
    let at = |sigma: f64| epsilon(0.01, sigma, 1000, 1e-5, &orders).unwrap().epsilon;
    assert!((stated - at(1.0)).abs() <= 1e-12 * stated);
    assert!((actual - at(1.0 / s)).abs() <= 1e-12 * actual);
    assert!(actual > stated);
    // At σ' = needed the run behaves as σ'/s, which must give back the stated ε.
    assert!(
        (needed - s).abs() <= 1e-9 * s,
        "σ needed {needed} vs overshoot {s}"
    );
    assert!((at(needed / s) - stated).abs() <= 1e-9 * stated);
    assert!(
        out.contains(&format!("stated ε = {stated:.2} (δ = 1e-5)"))
            && out.contains(&format!("the run is ε = {actual:.2}"))
            && out.contains(&format!("would keep ε = {stated:.2}")),
        "{out}"
    );

    // Exact tied ghost clipping in f32: its clipped contributions exceed C by f32 rounding at
    // most, and the ε line says what that rounding costs, to the seventh digit.
    let (code, doc, out) = audit_json("ghost-tied", &[]);
    assert_eq!(code, Some(0), "{out}");
    let p = &doc["clippers"][0]["privacy"];
    let s = p["worst_contribution"].as_f64().unwrap();
    assert!((1.0..1.0 + 1e-6).contains(&s), "{s}");
    let (stated, actual) = (
        p["stated_epsilon"].as_f64().unwrap(),
        p["actual_epsilon"].as_f64().unwrap(),
    );
    assert!(
        actual >= stated && actual - stated < 1e-5,
        "{stated} {actual}"
    );
    assert!(
        out.contains("no clipped contribution above C")
            || out.contains("f32 rounding lets clipped contributions reach (1 + "),
        "{out}"
    );
}

/// The ε always comes from the measured sensitivity: in every audit and every precision the
/// privacy report's worst contribution is the largest `max_sensitivity_ratio` of any case
/// (at least 1), whatever the verdict.
#[test]
fn the_privacy_report_and_the_sensitivity_never_disagree() {
    for (clipper, dtype) in [
        ("ghost", "f32"),
        ("ghost-tied", "f32"),
        ("ghost-tied", "bf16"),
        ("mutant:cauchy-schwarz", "f32"),
        ("mutant:batch-mean-loss", "bf16"),
    ] {
        let (code, doc, out) = audit_json(clipper, &["--precision", dtype]);
        assert_eq!(code, Some(0), "{out}");
        let a = &doc["clippers"][0];
        let max_sens = a["cases"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                let m = c["max_sensitivity_ratio"].as_f64().unwrap();
                assert_eq!(
                    c["worst_contribution"].as_f64(),
                    Some(m),
                    "{clipper} {dtype}"
                );
                m
            })
            .fold(1.0, f64::max);
        assert_eq!(
            a["max_sensitivity_ratio"].as_f64().unwrap().max(1.0),
            max_sens
        );
        assert_eq!(
            a["privacy"]["worst_contribution"].as_f64(),
            Some(max_sens),
            "{clipper} {dtype}"
        );
        let (stated, actual) = (
            a["privacy"]["stated_epsilon"].as_f64().unwrap(),
            a["privacy"]["actual_epsilon"].as_f64().unwrap(),
        );
        assert_eq!(
            actual > stated,
            max_sens > 1.0,
            "{clipper} {dtype}: {stated} {actual}"
        );
    }
}

#[test]
fn max_epsilon_gates_on_the_actual_epsilon() {
    let (_, doc, _) = audit_json("ghost", &[]);
    let p = &doc["clippers"][0]["privacy"];
    let (stated, actual) = (
        p["stated_epsilon"].as_f64().unwrap(),
        p["actual_epsilon"].as_f64().unwrap(),
    );
    let between = format!("{}", 0.5 * (stated + actual));
    let (code, _, out) = audit_json("ghost", &["--max-epsilon", &between]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("actual ε above --max-epsilon"), "{out}");
    let (code, _, out) = audit_json("ghost-tied", &["--max-epsilon", &between]);
    assert_eq!(code, Some(0), "{out}");
    let above = format!("{}", actual * 1.01);
    let (code, _, _) = audit_json("ghost", &["--max-epsilon", &above]);
    assert_eq!(code, Some(0));
}

#[test]
fn without_accounting_flags_the_typical_run_is_named() {
    let o = run(&["audit", "--clipper", "ghost-tied"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("typical fine-tuning run") && out.contains("q = 0.01, 1000 steps, δ = 1e-5"),
        "{out}"
    );
}

#[test]
fn epochs_and_dataset_size_give_the_steps() {
    // N = 60000 at q = 0.004: batches of 240, 250 of them per epoch; 3 epochs are 750 steps.
    let json = tmp("privacy-epochs").join("a.json");
    let o = run(&[
        "audit",
        "--clipper",
        "ghost-tied",
        "--epochs",
        "3",
        "--dataset-size",
        "60000",
        "--sampling-rate",
        "0.004",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(doc["clippers"][0]["privacy"]["steps"], 750);
    assert_eq!(doc["clippers"][0]["privacy"]["sampling_rate"], 0.004);
}

#[test]
fn bad_accounting_flags_are_named() {
    expect_input_error(
        &["audit", "--sampling-rate", "1.5"],
        &["--sampling-rate", "1.5"],
    );
    expect_input_error(&["audit", "--delta", "0"], &["--delta", "(0, 1)"]);
    expect_input_error(&["audit", "--steps", "0"], &["--steps"]);
    expect_input_error(&["audit", "--max-epsilon", "-1"], &["--max-epsilon"]);
    expect_input_error(
        &["audit", "--epochs", "0", "--dataset-size", "10"],
        &["--epochs"],
    );
}

/// The privacy sentence in each situation, built from the accountant's own ε: no overshoot, an
/// overshoot within rounding (named by precision), a real one (with the σ that would fix it),
/// no noise at all, and an invalid norm.
#[test]
fn the_privacy_sentence_says_what_the_overshoot_costs() {
    use ghost_oracle::judge::PrivacyReport;
    use ghost_oracle::{Accounting, Precision};
    let run = Accounting::typical();
    let at = |sigma: f64| {
        epsilon(0.01, sigma, 1000, 1e-5, &default_orders())
            .unwrap()
            .epsilon
    };
    let say = |sigma, s, rounding| {
        PrivacyReport::new(&run, sigma, s, rounding)
            .unwrap()
            .sentence()
    };

    let none = say(1.0, Some(0.98), Some(Precision::F32));
    assert!(none.contains("no clipped contribution above C"), "{none}");

    let rounding = PrivacyReport::new(&run, 1.0, Some(1.0015), Some(Precision::BF16)).unwrap();
    assert_eq!(rounding.actual(), at(1.0 / 1.0015));
    let text = rounding.sentence();
    assert!(
        text.contains("bf16 rounding lets clipped contributions reach 1.0015·C")
            && text.contains(&format!(
                "the run is ε = {:.2}, not {:.2}",
                at(1.0 / 1.0015),
                at(1.0)
            ))
            && text.contains("clip at C/1.0015 or take the norms in f32"),
        "{text}"
    );

    let tiny = say(1.0, Some(1.0 + 3e-8), Some(Precision::F32));
    assert!(
        tiny.contains("reach (1 + 3.0e-8)·C, which raises ε by"),
        "{tiny}"
    );

    let real = say(1.0, Some(1.02), None);
    assert!(
        real.contains("with clipped contributions up to 1.0200·C")
            && real.contains("σ = 1.0200 would keep"),
        "{real}"
    );

    let no_noise = say(0.0, Some(1.001), Some(Precision::F32));
    assert!(
        no_noise.contains("without noise DP-SGD gives no privacy") && !no_noise.contains("NaN"),
        "{no_noise}"
    );

    let invalid = say(1.0, None, None);
    assert!(
        invalid.contains("with invalid norms no ε holds"),
        "{invalid}"
    );
}
