//! The deciding case of a report in words: the verdict, the worst example with its true and
//! claimed norm, its clipped contribution, σ_eff and ε, the tied parameter involved, and, where
//! the step decided the verdict, each of its failing checks with what the judge diagnosed
//! (missing examples, a sum scaled by a wrong divisor, too little or too much noise). The CLI
//! prints it under a failing result; the Python package raises it from its `assert_*` helpers.
//!
//! Every diagnosis here is a field the judge filled ([`SumCheck::missing_examples`],
//! [`SumCheck::shared_scale`], [`StepMetrics::divisor`], the noise checks): this module words
//! them, it decides nothing.

use super::numbers::{exp, fixed, general, percent, sci3, shortest, signed_percent};
use crate::audit::{ClipperAudit, KillMatrix};
use crate::judge::{
    CaseMetrics, NoiseScope, PrivacyReport, StepMetrics, SumCheck, SumKind, Verdict,
};
use ghost_oracle_reference::TiedParameter;

/// Who reads the explanation, and so how it names what they can change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reader {
    /// The command line: flags and trace keys.
    Cli,
    /// The Python package: keyword arguments.
    Python,
}

impl Reader {
    /// How the reader states the DP-SGD run the ε speaks of.
    fn run_arguments(self) -> &'static str {
        match self {
            Reader::Cli => "--sampling-rate, --steps, --delta",
            Reader::Python => "sampling_rate=, steps=, delta=",
        }
    }

    /// How the reader hands over the clipped sum beside a noisy update.
    fn give_clipped_sum(self) -> &'static str {
        match self {
            Reader::Cli => "add `claimed.clipped_sum.*` to the trace",
            Reader::Python => "pass clipped_sum=",
        }
    }
}

/// A report's audits with what the explanation needs besides them.
pub struct Explanation<'a> {
    /// Every clipper's audit, in report order.
    pub audits: &'a [ClipperAudit],
    /// The precision the bound assumed (a trace file) or the clippers computed in.
    pub precision: &'a str,
    /// For a trace file: the parameters its sites share (none is a finding too). `None` for an
    /// audit on a model, whose explanation reads a tied parameter from the cross term alone.
    pub tied: Option<&'a [TiedParameter]>,
    /// Who reads the explanation (the CLI or Python): words its hints for their spelling.
    pub reader: Reader,
}

/// How many rows of examples a table shows.
const ROWS: usize = 16;

impl Explanation<'_> {
    /// The clipper that decided the verdict: the most severe, then (among equals, the first
    /// wins) the largest clipped contribution of its deciding case.
    fn deciding(&self) -> Option<(&ClipperAudit, &CaseMetrics)> {
        let mut best: Option<(&ClipperAudit, &CaseMetrics)> = None;
        for a in self.audits {
            let Some(k) = a.cases.get(a.worst_case) else {
                continue;
            };
            let better = best.is_none_or(|(b, kb)| {
                a.verdict > b.verdict
                    || (a.verdict == b.verdict
                        && k.max_sensitivity_ratio > kb.max_sensitivity_ratio)
            });
            if better {
                best = Some((a, k));
            }
        }
        best
    }

    /// The deciding case in words.
    pub fn text(&self) -> String {
        let Some((c, k)) = self.deciding() else {
            return "ghost-oracle: no clipper was judged".into();
        };
        let lines = match &k.step {
            Some(s) if s.verdict != Verdict::Pass && s.verdict == k.verdict => {
                self.step_decided(c, k, s)
            }
            Some(_) | None => self.norms_decided(c, k),
        };
        lines.join("\n")
    }

    fn several_cases(&self, c: &ClipperAudit) -> bool {
        self.audits.len() > 1 || c.cases.len() > 1
    }

    /// The explanation when the norms decided the verdict.
    fn norms_decided(&self, c: &ClipperAudit, k: &CaseMetrics) -> Vec<String> {
        let i = k.worst_example;
        let e = &k.examples[i];
        let mut lines = vec![format!(
            "ghost-oracle: clipper `{}`: {}{}",
            c.name,
            c.verdict.name(),
            norms_verdict_gloss(c.verdict)
        )];
        if self.several_cases(c) {
            lines.push(format!("  deciding case: {}", k.case));
        }
        let b = k.examples.len();
        let (t, n) = (e.true_norm, e.norm);
        let diff = if n.is_finite() && t > 0.0 {
            let direction = if n < t { "low" } else { "high" };
            format!("{} {direction}", percent((n - t).abs() / t))
        } else {
            "not a valid norm".into()
        };
        lines.push(format!(
            "  worst example {i} of {b}: claimed norm {}, true norm {} ({diff}; rounding allows {} relative)",
            general(n, 6),
            general(t, 6),
            general(e.bound, 2)
        ));
        lines.push(format!(
            "  sensitivity: its clipped contribution is {}·C at C = {} (the largest over the batch: {}·C; above 1·C the stated σ does not buy the stated ε)",
            fixed(e.sensitivity, 4),
            general(k.max_grad_norm, 6),
            fixed(k.max_sensitivity_ratio, 4)
        ));
        lines.push(format!(
            "  σ_eff = {} (stated σ = {})",
            fixed(k.effective_noise_multiplier, 4),
            general(k.noise_multiplier, 6)
        ));
        if !k.unjudgeable_examples.is_empty() {
            lines.push(format!(
                "  cannot judge {} of {b} example(s) ({}) at {}: the loosest bound is {} of the norm (T = {}, widest factor {})",
                k.unjudgeable_examples.len(),
                joined(&k.unjudgeable_examples),
                self.precision,
                percent(k.max_bound),
                k.seq_len,
                k.widest_factor
            ));
            if let Some(reason) = &k.cannot_judge_reason {
                lines.push(format!("  why: {reason}"));
            }
        }
        lines.extend(self.epsilon_line(&c.privacy));
        lines.extend(self.tied_lines(k, i));
        if let Some(s) = &k.step {
            let passed = s.verdict == Verdict::Pass;
            lines.push(format!(
                "  the step: {}{}",
                s.verdict.name(),
                if passed { "" } else { " (see below)" }
            ));
            if !passed {
                lines.extend(self.step_checks(k, s));
            }
        }
        lines.extend(c.warnings.iter().map(|w| format!("  warning: {w}")));
        lines.extend(example_table(k));
        lines.extend(self.clipper_list());
        lines
    }

    /// Every clipper's verdict, when the report has several.
    fn clipper_list(&self) -> Option<String> {
        (self.audits.len() > 1).then(|| {
            let all: Vec<String> = self
                .audits
                .iter()
                .map(|x| format!("{} {}", x.name, x.verdict.name()))
                .collect();
            format!("  clippers: {}", all.join(", "))
        })
    }

    /// Stated and actual ε, for the run the reader stated (or the typical one).
    fn epsilon_line(&self, p: &PrivacyReport) -> Vec<String> {
        let setting = if p.default_setting {
            format!(
                ": a typical fine-tuning run; pass {} for yours",
                self.reader.run_arguments()
            )
        } else {
            String::new()
        };
        let place = format!(
            "δ = {}, q = {}, {} steps{setting}",
            general(p.delta, 6),
            general(p.sampling_rate, 6),
            p.steps
        );
        let stated = if p.stated_epsilon.is_finite() {
            fixed(p.stated_epsilon, 2)
        } else {
            "∞ (σ = 0: no noise, no privacy)".into()
        };
        let actual = p
            .actual_epsilon
            .filter(|a| a.is_finite())
            .map_or("∞".into(), |a| fixed(a, 2));
        let mut line = format!("  ε: stated {stated}, actual {actual} ({place})");
        if let (Some(w), Some(sigma)) = (p.worst_contribution, p.sigma_needed) {
            if w > 1.0 && sigma.is_finite() {
                line += &format!(
                    "; σ = {} would keep ε = {}",
                    fixed(sigma, 4),
                    fixed(p.stated_epsilon, 2)
                );
            }
        }
        vec![line]
    }

    /// The tied parameters and whether the claim is the truth without their cross term.
    fn tied_lines(&self, k: &CaseMetrics, i: usize) -> Vec<String> {
        let e = &k.examples[i];
        let share = e.cross_share.unwrap_or(f64::NAN);
        let head = match self.tied {
            Some([]) => {
                return vec!["  tied parameters: none (no parameter has two sites), so the error is not a missing cross term".into()];
            }
            Some(tied) => {
                let names: Vec<String> = tied.iter().map(tied_name).collect();
                format!("  tied parameter: {}", names.join("; "))
            }
            None if share.is_finite() && share != 0.0 => {
                "  tied parameters: the model shares a parameter between sites".into()
            }
            None => return Vec::new(),
        };
        let mut lines = vec![head];
        let (t, n) = (e.true_norm, e.norm);
        if share.is_finite() && t > 0.0 && n.is_finite() {
            let short = 1.0 - (n / t) * (n / t);
            lines.push(format!(
                "    example {i}: the tied cross term is {} of the true squared norm n*²; the claimed n² = n*² {}",
                signed_percent(share, 3),
                signed_percent(-short, 3)
            ));
            if share != 0.0 && (short - share).abs() <= 0.1 * share.abs() + 4.0 * e.bound {
                lines.push("    the claim is the truth without the cross term: the clipper summed the tied uses as if they were separate parameters (standard ghost clipping, or a copy of the model with the parameter untied)".into());
            }
        }
        lines
    }

    /// The explanation when the step decided the verdict: each failing check of the step, the
    /// parameter and the figure that decided it, σ_eff and ε, the norms, and per example the
    /// true and implied coefficients.
    fn step_decided(&self, c: &ClipperAudit, k: &CaseMetrics, s: &StepMetrics) -> Vec<String> {
        let mut lines = vec![format!(
            "ghost-oracle: clipper `{}`: {} in the step{}",
            c.name,
            c.verdict.name(),
            step_verdict_gloss(c.verdict)
        )];
        if self.several_cases(c) {
            lines.push(format!("  deciding case: {}", k.case));
        }
        lines.extend(self.step_checks(k, s));
        let p = &c.privacy;
        let sigma_eff = p.effective_noise_multiplier.unwrap_or(f64::NAN);
        let worst = s
            .contributions
            .iter()
            .copied()
            .reduce(f64::max)
            .unwrap_or(1.0);
        let mut why = Vec::new();
        if s.noise_fraction < 1.0 {
            why.push(format!(
                "some tensor got as little as {}·σ (the low end its χ² allows)",
                fixed(s.noise_fraction, 4)
            ));
        }
        if worst > 1.0 {
            let w = fixed(worst, 4);
            why.push(format!("σ / {w}: the largest contribution, each example weighed by the noise its tensors got, is {w}·C"));
        }
        let why = if why.is_empty() {
            String::new()
        } else {
            format!("; {}", why.join("; "))
        };
        lines.push(format!(
            "  σ_eff = {} (stated σ = {}{why})",
            fixed(sigma_eff, 4),
            general(k.noise_multiplier, 6)
        ));
        if let Some(d) = s.divisor.as_ref().filter(|d| d.data_dependent) {
            lines.push(format!(
                "  divisor: the update divides by the batch's drawn size ({}), not the stated {}: its normalization depends on the data",
                general(d.implied, 4),
                shortest(d.stated)
            ));
        }
        lines.extend(self.epsilon_line(p));
        lines.push(norms_line(k));
        lines.extend(self.tied_in_step(s));
        lines.extend(c.warnings.iter().map(|w| format!("  warning: {w}")));
        lines.extend(step_table(k, s));
        lines.extend(self.clipper_list());
        lines
    }

    /// The tied parameters among those the step's failing checks name: one tensor of the step.
    fn tied_in_step(&self, s: &StepMetrics) -> Vec<String> {
        let touched = |param: &str| {
            sums(s).any(|x| x.verdict != Verdict::Pass && x.worst_param == param)
                || s.noise.iter().any(|n| {
                    n.verdict != Verdict::Pass
                        && matches!(&n.scope, NoiseScope::Tensor(p) if p == param)
                })
        };
        self.tied
            .unwrap_or_default()
            .iter()
            .filter(|t| touched(&t.param))
            .map(|t| {
                format!(
                    "  `{}` is a tied parameter (sites {}): one tensor of the step, whose noise is one draw of N(0, σ²C²) per entry whatever its uses",
                    t.param,
                    tied_sites(t)
                )
            })
            .collect()
    }

    /// Each judged check of the step: the sums that are off with what the judge diagnosed, the
    /// noise (every failing tensor, else the whole update), the noisy update.
    fn step_checks(&self, k: &CaseMetrics, s: &StepMetrics) -> Vec<String> {
        let mut lines = Vec::new();
        for x in sums(s) {
            lines.extend(sum_lines(k, s, x));
        }
        let failing: Vec<_> = s
            .noise
            .iter()
            .filter(|n| n.verdict != Verdict::Pass)
            .collect();
        let shown = if failing.is_empty() {
            s.noise
                .iter()
                .filter(|n| n.scope == NoiseScope::Whole)
                .collect()
        } else {
            failing
        };
        for n in shown {
            let passed = n.verdict == Verdict::Pass;
            let what = match n.verdict {
                Verdict::PrivacyViolation => ": less noise than stated (missing, or divided twice)",
                Verdict::UtilityDistortion => {
                    ": more noise than stated (added once per use of a tied weight? a larger C?)"
                }
                Verdict::InvalidNorm => ": not finite",
                Verdict::Pass | Verdict::CannotJudge => "",
            };
            lines.push(format!(
                "  step: noise on {} ({} entries) {}: χ² = {} {} [{}, {}] (false alarms ≤ 1e-6 a step), σ̂/σ = {}{what}",
                n.scope,
                n.entries,
                n.verdict.name(),
                fixed(n.chi2, 1),
                if passed { "within" } else { "outside" },
                fixed(n.low, 1),
                fixed(n.high, 1),
                fixed(n.sigma_ratio, 4)
            ));
        }
        if let Some(u) = &s.noisy_update {
            let r = &u.residual;
            lines.push(format!(
                "  step: update under noise (no clipped sum) {}: implied coefficients χ² = {} on {} degrees of freedom (at most {}); residual noise χ² = {} against [{}, {}], σ̂/σ = {} ({})",
                u.verdict.name(),
                fixed(u.chi2, 2),
                u.dof,
                fixed(u.high, 2),
                fixed(r.chi2, 1),
                fixed(r.low, 1),
                fixed(r.high, 1),
                fixed(r.sigma_ratio, 4),
                r.verdict.name()
            ));
            lines.push(format!(
                "    from one noisy update this test sees signal errors of {} of ‖S*‖ or more, not less: {} to judge the signal exactly",
                sci3(u.smallest_visible.unwrap_or(f64::NAN)),
                self.reader.give_clipped_sum()
            ));
        }
        if s.update_not_judged {
            lines.push("  step: the update is under noise and nothing separates its signal from its noise: not judged".into());
        }
        lines
    }
}

/// The step's sum checks present: the clipped sum, then the update × divisor.
fn sums(s: &StepMetrics) -> impl Iterator<Item = &SumCheck> {
    [&s.clipped_sum, &s.update].into_iter().flatten()
}

/// Two figures equal to a millionth (an update that only carries the clipped sum's error).
fn close(a: Option<f64>, b: Option<f64>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) if a.is_finite() && b.is_finite() => {
            (a - b).abs() <= 1e-6 * a.abs().max(b.abs()).max(1e-300)
        }
        _ => false,
    }
}

/// One sum check: how far off it is and, when it fails, what the judge read from it.
fn sum_lines(k: &CaseMetrics, s: &StepMetrics, x: &SumCheck) -> Vec<String> {
    let opt = |v: Option<f64>| sci3(v.unwrap_or(f64::NAN));
    let failed = |c: &SumCheck| c.verdict != Verdict::Pass;
    let what = x.what.name();
    if let (SumKind::Update, Some(kc)) = (x.what, &s.clipped_sum) {
        if failed(kc) && failed(x) && close(x.rel_err, kc.rel_err) && close(x.scale, kc.scale) {
            return vec![format!(
                "  step: {what} {}: off by {} of S* (rounding allows {}), as the clipped sum is: the update carries the clipped sum's error",
                x.verdict.name(),
                opt(x.rel_err),
                opt(x.bound)
            )];
        }
    }
    let mut lines = vec![format!(
        "  step: {what} {}: off by {} of the exact clipped sum S* = Σ c*_i g*_i (rounding allows {}); worst parameter `{}` (off by {} of its own)",
        x.verdict.name(),
        opt(x.rel_err),
        opt(x.bound),
        x.worst_param,
        opt(x.worst_param_rel_err)
    )];
    if !failed(x) {
        return lines;
    }
    if x.invalid {
        lines.push("    it holds NaN or infinite values".into());
    }
    lines.push(format!(
        "    implied coefficients ĉ = G⁺⟨g*_i, X⟩: contributions ĉ_i·n*_i/C up to {}·C{}",
        fixed(x.implied_sensitivity, 4),
        if x.verdict == Verdict::PrivacyViolation {
            " (above C: that example's privacy is spent faster than σ buys)"
        } else {
            ""
        }
    ));
    let unexplained = x.unexplained.unwrap_or(f64::NAN);
    let missing = &x.missing_examples;
    if !missing.is_empty() {
        let several = missing.len() > 1;
        lines.push(format!(
            "    {} {} of {} {} missing from it (implied coefficient under half the true one){}",
            if several { "examples" } else { "example" },
            joined(missing),
            k.examples.len(),
            if several { "are" } else { "is" },
            if unexplained <= 0.1 {
                ": a lost micro-batch?"
            } else {
                ""
            }
        ));
    }
    lines.push(scale_line(s, x));
    if unexplained.is_finite() && unexplained > 1e-3 {
        lines.push(format!(
            "    unexplained: {} of it is no combination of this batch's gradients{}",
            sci3(unexplained),
            if unexplained > 0.1 {
                " (another batch's update?)"
            } else {
                ""
            }
        ));
    }
    if x.singular {
        lines.push("    the batch's Gram is singular: ĉ is the minimum-norm solution".into());
    }
    lines
}

/// ⟨X, S*⟩/‖S*‖², and what one shared scale means: a wrong divisor where the update alone is
/// scaled, else every example weighted by that scale.
fn scale_line(s: &StepMetrics, x: &SumCheck) -> String {
    let mut line = format!(
        "    scale ⟨X, S*⟩/‖S*‖² = {}",
        fixed(x.scale.unwrap_or(f64::NAN), 4)
    );
    let clipped_ok = s
        .clipped_sum
        .as_ref()
        .is_none_or(|c| c.verdict == Verdict::Pass);
    if x.scaled_by_divisor() && clipped_ok {
        line += ": the update is the exact sum scaled by it";
        if let Some(d) = &s.divisor {
            line += &format!(
                "; implied divisor D/scale = {} against the stated D = {}",
                general(d.implied, 6),
                general(d.stated, 6)
            );
        }
        line += if s.clipped_sum.is_some() {
            " (the clipped sum is right: the divisor is wrong)"
        } else {
            " (a wrong divisor, or a clipped sum scaled by it)"
        };
    } else if x.shared_scale {
        line += ": every example's implied coefficient is the true one times it";
    }
    line
}

/// Whether the norms, too, are off.
fn norms_line(k: &CaseMetrics) -> String {
    let b = k.examples.len();
    if k.max_err_units <= 1.0 && k.invalid_examples.is_empty() {
        format!(
            "  norms: the {b} claimed norms are within rounding of the true ones (largest error {}× the bound): the step went wrong after the norms",
            general(k.max_err_units, 3)
        )
    } else {
        let i = k.worst_example;
        let e = &k.examples[i];
        format!(
            "  norms: also off: worst example {i} of {b}, claimed {}, true {} ({}× the bound)",
            general(e.norm, 6),
            general(e.true_norm, 6),
            general(e.err_units, 3)
        )
    }
}

/// The implied coefficients of every failing sum (and of a noisy update beyond its interval)
/// beside the true ones, per example.
fn step_table(k: &CaseMetrics, s: &StepMetrics) -> Vec<String> {
    let b = k.examples.len();
    let mut cols: Vec<(&str, &[f64])> = sums(s)
        .filter(|x| x.verdict != Verdict::Pass)
        .map(|x| (x.what.name(), x.implied_coefficients.as_slice()))
        .collect();
    if let Some(u) = s.noisy_update.as_ref().filter(|u| u.chi2 > u.high) {
        cols.push(("noisy update", &u.implied_coefficients));
    }
    if cols.is_empty() {
        return Vec::new();
    }
    let head: String = cols
        .iter()
        .map(|(w, _)| format!("  {:>24}  {:>8}", format!("ĉ ({w})"), "ĉ·n*/C"))
        .collect();
    let first = if b > ROWS {
        format!(" (the first {ROWS} of {b})")
    } else {
        String::new()
    };
    let mut lines = vec![
        format!("  per example{first}:"),
        format!("        i      true norm        c*{head}"),
    ];
    for i in 0..b.min(ROWS) {
        let n = k.examples[i].true_norm;
        let mut row = format!(
            "    {i:>5}  {:>13}  {:>8}",
            exp(n, 6),
            fixed(s.true_coefficients[i], 5)
        );
        for (_, ci) in &cols {
            row += &format!(
                "  {:>24}  {:>8}",
                fixed(ci[i], 5),
                fixed(ci[i] * n / k.max_grad_norm, 4)
            );
        }
        lines.push(row);
    }
    lines
}

/// Per example: claimed and true norm, error, coefficients, contribution and cross share; the
/// largest errors first chosen where the batch has more than a table's rows.
fn example_table(k: &CaseMetrics) -> Vec<String> {
    let b = k.examples.len();
    let mut order: Vec<usize> = (0..b).collect();
    let mut note = String::new();
    if b > ROWS {
        // NaN ranks above every error, an infinite one just below it.
        let key = |i: usize| {
            let u = k.examples[i].err_units;
            if u.is_nan() {
                f64::INFINITY
            } else {
                u.min(f64::MAX)
            }
        };
        order.sort_by(|&a, &b| key(b).total_cmp(&key(a)));
        order.truncate(ROWS);
        order.sort_unstable();
        note = format!(" ({ROWS} of {b}: the largest errors)");
    }
    let mut lines = vec![
        format!("  per example{note}:"),
        "        i        claimed           true    rel err   err/bound  coef claimed/true  contribution  cross/n²".into(),
    ];
    for j in order {
        let e = &k.examples[j];
        let cross = e
            .cross_share
            .filter(|c| c.is_finite())
            .map_or("n/a".into(), |c| signed_percent(c, 2));
        lines.push(format!(
            "    {j:>5}  {:>13}  {:>13}  {:>9}  {:>10}  {:>8}/{:<8}  {:>12}  {cross:>8}{}",
            exp(e.norm, 6),
            exp(e.true_norm, 6),
            exp(e.norm_rel_err, 2),
            general(e.err_units, 3),
            fixed(e.coefficient, 5),
            fixed(e.true_coefficient, 5),
            fixed(e.sensitivity, 5),
            if j == k.worst_example {
                "  <- worst"
            } else {
                ""
            }
        ));
    }
    lines
}

/// What a verdict of the norms means, after its name.
fn norms_verdict_gloss(v: Verdict) -> &'static str {
    match v {
        Verdict::Pass => " (every claimed norm is within the rounding bound of the truth)",
        Verdict::UtilityDistortion => " (norms off beyond rounding, but no example's clipped contribution exceeds C: privacy holds, training signal is lost)",
        Verdict::CannotJudge => " (the rounding bound at this precision is over a tenth of some norm, or would let a claim within it clip an example above C·(1 + δ): a claim that far off would pass too, so no norm of those examples can be judged right or wrong)",
        Verdict::PrivacyViolation => " (an example's clipped contribution exceeds C: the DP guarantee does not hold at the stated noise)",
        Verdict::InvalidNorm => " (a NaN, infinite or negative norm or coefficient: the claim cannot be used)",
    }
}

/// What a verdict of the step means, after its name.
fn step_verdict_gloss(v: Verdict) -> &'static str {
    match v {
        Verdict::Pass => "",
        Verdict::UtilityDistortion => " (the clipped sum or the update is off beyond rounding, or its noise is larger than stated; no example's contribution exceeds C and the noise is not below the stated: privacy holds, training signal is lost)",
        Verdict::PrivacyViolation => " (the update gives some example more weight than C, or some tensor less noise than σC: the DP guarantee does not hold at the stated noise)",
        Verdict::InvalidNorm => " (a NaN or infinite value in the step's clipped sum or update)",
        Verdict::CannotJudge => " (the step cannot be judged at this precision)",
    }
}

fn joined(xs: &[usize]) -> String {
    xs.iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// "`wte` (embedding) and `lm_head.weight` (linear)".
fn tied_sites(t: &TiedParameter) -> String {
    t.sites
        .iter()
        .map(|(name, kind)| format!("`{name}` ({})", kind.name()))
        .collect::<Vec<_>>()
        .join(" and ")
}

fn tied_name(t: &TiedParameter) -> String {
    format!("`{}` (sites {})", t.param, tied_sites(t))
}

/// The kill matrix in words: the clippers whose check failed, and what failed.
pub fn kill_matrix_explanation(m: &KillMatrix) -> String {
    let mut lines = vec![format!(
        "ghost-oracle kill matrix: {}",
        if m.ok() {
            "pass"
        } else {
            "detection-check-failed"
        }
    )];
    for r in m.rows.iter().filter(|r| !r.problems.is_empty()) {
        lines.push(format!("  {}: {}", r.clipper, r.problems.join("; ")));
    }
    if m.ok() {
        lines.push(format!("  {}", super::kill_matrix_verdict_line(m)));
    }
    lines.join("\n")
}
