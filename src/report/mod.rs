//! Human-readable tables, the JSON document and JUnit XML.

mod explain;
mod html;
mod kill_matrix;
mod numbers;

pub use explain::{kill_matrix_explanation, Explanation, Reader};
pub use html::audit_html;
pub(crate) use html::{audit_sections, page, verdict_colour};
pub use kill_matrix::{
    kill_matrix_html, kill_matrix_json, kill_matrix_table, kill_matrix_verdict_line,
};

use crate::audit::ClipperAudit;
use crate::judge::{nan_max, CaseMetrics, NoiseScope, StepMetrics, Verdict};
use ghost_oracle_reference::{Precision, Reference};
use serde_json::{json, Value};
use std::fmt::Write;

fn sci(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.is_infinite() {
        "inf".into()
    } else {
        format!("{v:.2e}")
    }
}

/// The reference's per-example (and per-parameter) norms as a text table.
pub fn reference_table(r: &Reference) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "per-example gradient norms (reduction: {})",
        r.reduction.name()
    );
    let _ = writeln!(
        s,
        "{:>7}  {:>12}  {:>14}  {:>12}  {:>12}  {:>13}  {:>10}",
        "example", "loss", "norm", "input_sq", "output_sq", "cross", "2·cross/n²"
    );
    for (i, e) in r.examples.iter().enumerate() {
        match e.shared.first() {
            Some((_, sp)) => {
                let _ = writeln!(
                    s,
                    "{i:>7}  {:>12.6}  {:>14.8e}  {:>12.4e}  {:>12.4e}  {:>13.4e}  {:>10.4}",
                    e.loss,
                    e.norm,
                    sp.input_sq,
                    sp.output_sq,
                    sp.cross,
                    2.0 * sp.cross / (e.norm * e.norm)
                );
            }
            None => {
                let _ = writeln!(
                    s,
                    "{i:>7}  {:>12.6}  {:>14.8e}  {:>12}  {:>12}  {:>13}  {:>10}",
                    e.loss, e.norm, "-", "-", "-", "-"
                );
            }
        }
    }
    if let Some((name, _)) = r.examples.first().and_then(|e| e.shared.first()) {
        let _ = writeln!(
            s,
            "shared parameter: {name} (input = embedding use, output = LM head use)"
        );
    }
    let _ = writeln!(s, "\nper-parameter norms");
    let width = r.examples[0]
        .params
        .iter()
        .map(|(n, _)| n.len())
        .max()
        .unwrap_or(10);
    let mut header = format!("{:<width$}", "parameter");
    for i in 0..r.examples.len() {
        let _ = write!(header, "  {:>10}", format!("ex {i}"));
    }
    let _ = writeln!(s, "{header}");
    for (k, (name, _)) in r.examples[0].params.iter().enumerate() {
        let mut line = format!("{name:<width$}");
        for e in &r.examples {
            let _ = write!(line, "  {:>10.4e}", e.params[k].1);
        }
        let _ = writeln!(s, "{line}");
    }
    s
}

/// Every clipper's audit as text tables, headed by the precision and device.
pub fn audit_tables(audits: &[ClipperAudit], dtype: &str, device: &str) -> String {
    let mut s = String::new();
    for a in audits {
        let _ = writeln!(
            s,
            "\nclipper {} ({dtype}, {device}): {}",
            a.name,
            a.verdict.name().to_uppercase()
        );
        s.push_str(&case_rows(a));
        if let Some(c) = a
            .cases
            .get(a.worst_case)
            .filter(|c| c.verdict != Verdict::Pass)
        {
            let e = &c.examples[c.worst_example];
            let _ = writeln!(
                s,
                "  worst ({}): case {} example {}: norm {:.6e} vs true {:.6e} (rel err {}, bound {}), clipped contribution {:.4}·C",
                worst_rule(c.verdict),
                c.case,
                c.worst_example,
                e.norm,
                e.true_norm,
                sci(e.norm_rel_err),
                sci(e.bound),
                e.sensitivity
            );
        }
        // A single case (a trace file) shows every check of its step; a suite shows those
        // that failed.
        let every = a.cases.len() == 1;
        for c in &a.cases {
            if let Some(step) = &c.step {
                s.push_str(&step_lines(&c.case, step, every));
            }
        }
        for w in &a.warnings {
            let _ = writeln!(s, "  warning: {w}");
        }
        let p = &a.privacy;
        let _ = writeln!(s, "  privacy: {}", p.sentence());
        let _ = writeln!(s, "    ({})", p.setting());
        if p.order_at_grid_edge {
            let _ = writeln!(
                s,
                "  warning: the optimal Rényi order {} is at an end of the grid; a wider grid may give a smaller ε",
                p.order
            );
        }
    }
    let _ = writeln!(
        s,
        "\ncolumns: norm err = max |n−n*|/n*; err/bound = that over the derived tolerance; Δc = clip coefficient difference;\n\
         sens = max c·n*/C (above 1: the DP guarantee fails at the stated σ); σ_eff = σ/max(1, sens);\n\
         ρ, ρ* = σC/‖Σ c_i g_i*‖ with this clipper's and exact coefficients; cos = cosine of the two clipped sums;\n\
         2x/n² = largest share of a norm² that is the tied cross term; n/a = undefined (a zero sum or norm)."
    );
    s.push_str(&summary(audits));
    s
}

/// A clipper's cases, a row each, under the columns' header; the deciding case marked.
fn case_rows(a: &ClipperAudit) -> String {
    let mut s = String::new();
    let w = a
        .cases
        .iter()
        .map(|c| c.case.len())
        .max()
        .unwrap_or(4)
        .max(4);
    let _ = writeln!(
        s,
        "  {:<w$}  {:<18}  {:>9}  {:>9}  {:>9}  {:>5}  {:>8}  {:>7}  {:>8}  {:>8}  {:>8}  {:>9}",
        "case",
        "verdict",
        "norm err",
        "err/bound",
        "max |Δc|",
        "flips",
        "sens",
        "σ_eff",
        "ρ",
        "ρ*",
        "cos",
        "2x/n² max"
    );
    for (k, c) in a.cases.iter().enumerate() {
        let mark = if k == a.worst_case && c.verdict != Verdict::Pass {
            " <- worst"
        } else {
            ""
        };
        let _ = writeln!(
            s,
            "  {:<w$}  {:<18}  {:>9}  {:>9}  {:>9}  {:>5}  {:>8.5}  {:>7.4}  {:>8}  {:>8}  {:>8}  {:>9}{mark}",
            c.case,
            c.verdict.name(),
            sci(c.max_norm_rel_err),
            sci(c.max_err_units),
            sci(c.max_coef_abs_diff),
            c.decision_flips,
            c.max_sensitivity_ratio,
            c.effective_noise_multiplier,
            fixed(c.effective_noise_ratio, 4),
            fixed(c.reference_noise_ratio, 4),
            fixed(c.clipped_sum_cosine, 5),
            fixed(c.max_cross_share, 4)
        );
    }
    s
}

/// What in the step decided a case's verdict, when the step did.
fn step_figure(step: &StepMetrics, verdict: Verdict) -> Option<String> {
    if step.verdict != verdict || verdict == Verdict::Pass {
        return None;
    }
    if let Some(check) = [&step.clipped_sum, &step.update]
        .into_iter()
        .flatten()
        .find(|x| x.verdict == verdict)
    {
        return Some(format!(
            "the step's {} is off by {} of the exact clipped sum (bound {}), scale {}, implied contributions up to {:.4}·C",
            check.what.name(),
            check.rel_err.map_or("n/a".into(), sci),
            check.bound.map_or("n/a".into(), sci),
            fixed(check.scale, 4),
            check.implied_sensitivity
        ));
    }
    step.noise.iter().find(|n| n.verdict == verdict).map(|n| {
        format!(
            "the step's noise on {} is {:.4}·σ (χ² {:.1} outside [{:.1}, {:.1}])",
            n.scope, n.sigma_ratio, n.chi2, n.low, n.high
        )
    })
}

/// The step's sum checks of a case, a line each (every check, or those that failed).
fn sum_lines(case: &str, step: &StepMetrics, every: bool) -> String {
    let mut s = String::new();
    let shown = |v: Verdict| every || v != Verdict::Pass;
    for check in [&step.clipped_sum, &step.update]
        .into_iter()
        .flatten()
        .filter(|c| shown(c.verdict))
    {
        let _ = writeln!(
            s,
            "  step ({case}): {} {}: off by {} of S* (bound {}), worst parameter `{}` ({}); scale {}; implied contributions up to {:.4}·C; unexplained {}{}{}",
            check.what.name(),
            check.verdict.name(),
            check.rel_err.map_or("n/a".into(), sci),
            check.bound.map_or("n/a".into(), sci),
            check.worst_param,
            check.worst_param_rel_err.map_or("n/a".into(), sci),
            fixed(check.scale, 4),
            check.implied_sensitivity,
            check.unexplained.map_or("n/a".into(), sci),
            if check.missing_examples.is_empty() || check.verdict == Verdict::Pass {
                String::new()
            } else {
                format!("; examples {:?} are missing from it (their implied coefficients are under half the true ones)", check.missing_examples)
            },
            if check.singular { "; the batch's Gram is singular (minimum-norm coefficients)" } else { "" }
        );
    }
    s
}

/// The step's checks of a case, a line each.
fn step_lines(case: &str, step: &StepMetrics, every: bool) -> String {
    let mut s = sum_lines(case, step, every);
    let shown = |v: Verdict| every || v != Verdict::Pass;
    for n in step
        .noise
        .iter()
        .filter(|n| n.verdict != Verdict::Pass || (every && n.scope == NoiseScope::Whole))
    {
        let _ = writeln!(
            s,
            "  step ({case}): noise on {} ({} entries) {}: χ² = {:.1} against [{:.1}, {:.1}] (false alarms ≤ 1e-6 a step), σ̂ = {:.4}·σ",
            n.scope,
            n.entries,
            n.verdict.name(),
            n.chi2,
            n.low,
            n.high,
            n.sigma_ratio
        );
    }
    if let Some(n) = step.noisy_update.as_ref().filter(|n| shown(n.verdict)) {
        let _ = writeln!(
            s,
            "  step ({case}): update under noise {}: implied coefficients χ² = {:.2} on {} degrees of freedom (at most {:.2}); residual noise χ² = {:.1} against [{:.1}, {:.1}], σ̂ = {:.4}·σ; from one noisy update this test sees signal errors of {} of S* or more, not less",
            n.verdict.name(),
            n.chi2,
            n.dof,
            n.high,
            n.residual.chi2,
            n.residual.low,
            n.residual.high,
            n.residual.sigma_ratio,
            n.smallest_visible.map_or("n/a".into(), sci)
        );
    }
    if let Some(d) = step
        .divisor
        .as_ref()
        .filter(|d| every || d.data_dependent || step.verdict != Verdict::Pass)
    {
        let _ = writeln!(
            s,
            "  step ({case}): divisor stated {}, implied {:.4} (± {} relative){}",
            d.stated,
            d.implied,
            sci(d.spread),
            if d.data_dependent {
                format!(
                    "; the update divides by the batch's drawn size {}, not the stated {}: its normalization depends on the data",
                    d.drawn, d.stated
                )
            } else {
                String::new()
            }
        );
    }
    if step.noise_fraction < 1.0 {
        let _ = writeln!(
            s,
            "  step ({case}): some tensor got as little as {:.4}·σ of noise (the low end at the noise test's confidence); weighed per example by how its gradient divides among the tensors, the largest contribution is {:.4}·C and the step acts with σ_eff = {:.4}",
            step.noise_fraction,
            step.contributions.iter().copied().fold(0.0, f64::max),
            step.sigma_eff
        );
    }
    if step.update_not_judged {
        let _ = writeln!(
            s,
            "  step ({case}): the update is under noise (σ > 0) and the trace has no clipped sum: its signal and noise are not judged by this version"
        );
    }
    s
}

/// How the worst example of a case was picked, by verdict.
fn worst_rule(v: Verdict) -> &'static str {
    match v {
        Verdict::InvalidNorm => "first invalid norm",
        Verdict::PrivacyViolation => "largest clipped contribution",
        Verdict::CannotJudge => "loosest bound",
        Verdict::Pass | Verdict::UtilityDistortion => "largest err/bound",
    }
}

/// A metric that may be undefined, fixed-point.
fn fixed(v: Option<f64>, digits: usize) -> String {
    v.map_or("n/a".into(), |x| format!("{x:.digits$}"))
}

/// The figure that decided a clipper's verdict, in words.
pub fn deciding_figure(a: &ClipperAudit) -> String {
    let Some(c) = a.cases.get(a.worst_case) else {
        return "no case".into();
    };
    let e = &c.examples[c.worst_example];
    let case = &c.base_case;
    // The norms' own figure where they alone give the verdict; the step's where only it does.
    let norms_decide = match c.verdict {
        Verdict::InvalidNorm => !c.invalid_examples.is_empty(),
        Verdict::PrivacyViolation => c.examples.iter().any(|e| e.sensitivity > 1.0 + e.bound),
        Verdict::UtilityDistortion => c.max_err_units > 1.0,
        Verdict::CannotJudge | Verdict::Pass => true,
    };
    if let Some(figure) = c
        .step
        .as_ref()
        .filter(|_| !norms_decide)
        .and_then(|s| step_figure(s, c.verdict))
    {
        return format!("{case}: {figure}");
    }
    match c.verdict {
        Verdict::InvalidNorm => format!(
            "{case} example {} has norm {} (coefficient {}); {} invalid example(s)",
            c.worst_example,
            e.norm,
            e.coefficient,
            c.invalid_examples.len()
        ),
        Verdict::PrivacyViolation => format!(
            "{} example {} contributes {:.4}·C, σ_eff {:.3}",
            c.case, c.worst_example, e.sensitivity, c.effective_noise_multiplier
        ),
        Verdict::CannotJudge => format!(
            "{case} example {}: at {} the rounding bound is {:.1}% of the norm (T = {}, widest factor {}), too loose to tell a right norm from a wrong one ({}); {}",
            c.worst_example,
            a.precision,
            100.0 * e.bound,
            c.seq_len,
            c.widest_factor,
            c.cannot_judge_reason.as_deref().unwrap_or("no reason recorded"),
            finer_remedy(a.precision)
        ),
        Verdict::UtilityDistortion => format!(
            "{} example {} norm off by {} = {} × the bound, no contribution above C",
            c.case,
            c.worst_example,
            sci(e.norm_rel_err),
            sci(e.err_units)
        ),
        Verdict::Pass => format!(
            "largest error {} of the bound",
            sci(a.cases.iter().map(|c| c.max_err_units).fold(0.0, nan_max))
        ),
    }
}

/// What to do about a bound too loose to judge: compute in a finer precision.
fn finer_remedy(p: Precision) -> &'static str {
    match p {
        Precision::BF16 | Precision::F16 => "store the factors in f32 or accumulate in f32",
        Precision::F32 => "compute the model and the norms in f64",
        Precision::F64 => "f64 cannot resolve this norm: its gradient cancels too far",
    }
}

/// One line per clipper with its verdict and the figure that decided it, then an overall line.
pub fn summary(audits: &[ClipperAudit]) -> String {
    let mut s = String::from("\nsummary:\n");
    for a in audits {
        let _ = write!(
            s,
            "  {} {} ({}: {})",
            if a.verdict == Verdict::Pass {
                "PASS"
            } else {
                "FAIL"
            },
            a.name,
            a.verdict.name(),
            deciding_figure(a)
        );
        let p = &a.privacy;
        let epsilon = |e: Option<f64>| fixed(e.filter(|e| e.is_finite()), 2).replace("n/a", "∞");
        let (stated, actual) = (epsilon(Some(p.stated_epsilon)), epsilon(p.actual_epsilon));
        let _ = if actual != stated {
            writeln!(s, "; ε {stated} → {actual}")
        } else {
            writeln!(s, "; ε {stated}")
        };
    }
    let failing: Vec<&str> = audits
        .iter()
        .filter(|a| a.verdict != Verdict::Pass)
        .map(|a| a.name.as_str())
        .collect();
    if failing.is_empty() {
        let _ = writeln!(s, "all {} audited clipper(s) pass", audits.len());
    } else {
        let _ = writeln!(
            s,
            "{} of {} audited clipper(s) fail: {}",
            failing.len(),
            audits.len(),
            failing.join(", ")
        );
    }
    s
}

/// Every clipper's audit as JSON, with the precision and device.
pub fn audit_json(audits: &[ClipperAudit], dtype: &str, device: &str) -> Value {
    let clippers: Vec<Value> = audits
        .iter()
        .map(|a| {
            let worst = a.cases.get(a.worst_case);
            let fmax = |f: &dyn Fn(&CaseMetrics) -> f64| a.cases.iter().map(f).fold(0.0_f64, nan_max);
            json!({
                "name": a.name,
                "verdict": a.verdict.name(),
                "max_norm_rel_err": fmax(&|c| c.max_norm_rel_err),
                "max_err_units": fmax(&|c| c.max_err_units),
                "max_coef_abs_diff": fmax(&|c| c.max_coef_abs_diff),
                "decision_flips": a.cases.iter().map(|c| c.decision_flips).sum::<usize>(),
                "max_sensitivity_ratio": fmax(&|c| c.max_sensitivity_ratio),
                "effective_noise_ratio": worst.and_then(|c| c.effective_noise_ratio),
                "reference_noise_ratio": worst.and_then(|c| c.reference_noise_ratio),
                "decided_by": deciding_figure(a),
                "privacy": a.privacy,
                "worst": {"case": worst.map(|c| c.case.clone()), "example": worst.map(|c| c.worst_example)},
                "warnings": a.warnings,
                "cases": a.cases,
            })
        })
        .collect();
    let verdicts: serde_json::Map<String, Value> = audits
        .iter()
        .map(|a| (a.name.clone(), json!(a.verdict.name())))
        .collect();
    json!({
        "passed": audits.iter().all(|a| a.verdict == Verdict::Pass),
        "verdicts": verdicts,
        "dtype": dtype,
        "device": device,
        "clippers": clippers,
    })
}

/// `s` with the characters XML gives a meaning to (`&`, `<`, `>`, `"`) escaped.
pub(crate) fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Every clipper's audit as a JUnit XML document: a test suite per clipper, a test case per case.
pub fn audit_junit(audits: &[ClipperAudit]) -> String {
    let mut s = String::from(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<testsuites name=\"ghost-oracle audit\">\n",
    );
    for a in audits {
        let failures = a
            .cases
            .iter()
            .filter(|c| c.verdict != Verdict::Pass)
            .count();
        let _ = writeln!(
            s,
            "  <testsuite name=\"{}\" tests=\"{}\" failures=\"{failures}\">",
            xml_escape(&a.name),
            a.cases.len()
        );
        for c in &a.cases {
            let _ = write!(
                s,
                "    <testcase classname=\"{}\" name=\"{}\"",
                xml_escape(&a.name),
                xml_escape(&c.case)
            );
            if c.verdict == Verdict::Pass {
                let _ = writeln!(s, "/>");
            } else {
                let e = &c.examples[c.worst_example];
                let mut msg = format!(
                    "{}: example {} norm {:e} vs true {:e} (rel err {:e}, bound {:e}); sensitivity ratio {:.6}",
                    c.verdict.name(),
                    c.worst_example,
                    e.norm,
                    e.true_norm,
                    e.norm_rel_err,
                    e.bound,
                    c.max_sensitivity_ratio
                );
                msg.push_str("; ");
                msg.push_str(&a.privacy.sentence());
                let _ = writeln!(
                    s,
                    ">\n      <failure type=\"{}\" message=\"{}\"/>\n    </testcase>",
                    c.verdict.name(),
                    xml_escape(&msg)
                );
            }
        }
        let _ = writeln!(s, "  </testsuite>");
    }
    s.push_str("</testsuites>\n");
    s
}
