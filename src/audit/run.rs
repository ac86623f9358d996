//! Every clipper on every case: the reference once per case, each clipper's claim judged, and
//! one verdict per clipper with the ε its run really has.

use super::claim::{claim_of, produce, step_claim};
use super::prepare::{prepare, PreparedCase};
use super::{AuditOptions, Case};
use crate::clippers::Clipper;
use crate::error::{Error, Result};
use crate::judge::{Arithmetic, CaseLabel, CaseMetrics, PrivacyReport, Verdict};
use crate::options::{Accounting, ClipNorm, NoiseMultiplier};
use crate::trace::Precision;
use ghost_oracle_reference as reference;
use serde::Serialize;
use std::borrow::Borrow;

/// One clipper's results over every case, with the ε its run really has.
#[derive(Clone, Debug, Serialize)]
pub struct ClipperAudit {
    /// The clipper's name (a mutant's included).
    pub name: String,
    /// The most severe verdict over the cases.
    pub verdict: Verdict,
    /// Index into `cases` of the case that decides the verdict.
    pub worst_case: usize,
    /// Every case's figures, in audit order.
    pub cases: Vec<CaseMetrics>,
    /// What the clipper said a user must know (e.g. a shared parameter it ignores), once each.
    pub warnings: Vec<String>,
    /// The precision the tolerance assumed.
    pub precision: Precision,
    /// Stated and actual ε of the run.
    pub privacy: PrivacyReport,
}

impl ClipperAudit {
    /// The verdict, the deciding case and the ε, from the cases.
    pub(super) fn new(
        name: String,
        cases: Vec<CaseMetrics>,
        warnings: Vec<String>,
        precision: Precision,
        accounting: &Accounting,
        noise_multiplier: NoiseMultiplier,
    ) -> Result<Self> {
        let worst = worst_case(&cases);
        let verdict = cases.get(worst).map_or(Verdict::Pass, |c| c.verdict);
        // The run's ε is set by the worst overshoot in any case.
        let contribution = cases
            .iter()
            .map(|c| c.worst_contribution)
            .try_fold(1.0_f64, |acc, s| s.map(|s| acc.max(s)));
        // Below a privacy violation, any overshoot of C is within the rounding bound.
        let rounding_at = match verdict {
            Verdict::Pass | Verdict::UtilityDistortion | Verdict::CannotJudge => Some(precision),
            Verdict::PrivacyViolation | Verdict::InvalidNorm => None,
        };
        let privacy = PrivacyReport::new(
            accounting,
            noise_multiplier.get(),
            contribution,
            rounding_at,
        )?;
        Ok(ClipperAudit {
            name,
            verdict,
            worst_case: worst,
            cases,
            warnings,
            precision,
            privacy,
        })
    }
}

/// The case that decides a clipper's verdict: the most severe verdict, then the largest error.
pub fn worst_case(cases: &[CaseMetrics]) -> usize {
    let key = |c: &CaseMetrics| match c.verdict {
        Verdict::InvalidNorm => (c.verdict, c.invalid_examples.len() as f64),
        Verdict::PrivacyViolation => (c.verdict, c.max_sensitivity_ratio),
        Verdict::CannotJudge => (c.verdict, c.max_bound),
        Verdict::Pass | Verdict::UtilityDistortion => (c.verdict, c.max_err_units),
    };
    (0..cases.len())
        .max_by(|&a, &b| {
            let (ka, kb) = (key(&cases[a]), key(&cases[b]));
            ka.0.cmp(&kb.0).then(ka.1.total_cmp(&kb.1))
        })
        .unwrap_or(0)
}

/// One clipper's judged cases so far and its warnings, each once.
#[derive(Clone, Default)]
struct ClipperRun {
    metrics: Vec<CaseMetrics>,
    warnings: Vec<String>,
}

/// Progress steps of a case: the reference's passes, and one clipper's runs on it, each of
/// which counts as much as one example of the reference.
fn steps_of(case: &Case, opts: &AuditOptions) -> (usize, usize) {
    let start = reference::Progress::start(&case.model, &case.batch);
    let norms = match opts.max_grad_norm {
        Some(_) => 1,
        None => case.c_multipliers.len(),
    };
    let reference_steps = start.steps().1;
    (reference_steps, start.passes * norms)
}

/// Runs every clipper on every case. `progress(done, total, label)` after each step: a pass of
/// the reference through one block of one example, or a clipper's run on a case, which counts
/// as much as one example of the reference (on a checkpoint the two take about as long, and
/// alike steps let the mean so far predict the rest). Cases given by value are dropped one by
/// one as soon as their reference has run.
pub fn run<C: Borrow<Case>, I>(
    cases: I,
    clippers: &[Box<dyn Clipper>],
    opts: &AuditOptions,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<Vec<ClipperAudit>>
where
    I: IntoIterator<Item = C>,
    I::IntoIter: ExactSizeIterator,
{
    // Collected (moved, not copied) so that the steps of every case are known before the first.
    let cases: Vec<C> = cases.into_iter().collect();
    let mut runs = vec![ClipperRun::default(); clippers.len()];
    let total: usize = cases
        .iter()
        .map(|c| {
            let (r, per_clipper) = steps_of(c.borrow(), opts);
            r + per_clipper * clippers.len()
        })
        .sum();
    let mut done = 0;
    for case in cases {
        let name = case.borrow().name.clone();
        let (reference_steps, per_clipper) = steps_of(case.borrow(), opts);
        let prepared = prepare(case, opts, &mut |p| {
            // The last pass of the reference starts the judge's work on its factors.
            let label = if p.examples_done == p.examples {
                format!("{name}: reference done, the judge's truth and tolerances")
            } else {
                format!("{name}: reference, {}", p.describe())
            };
            progress(done + p.steps().0, total, &label)
        })?;
        done += reference_steps;
        for (run, clipper) in runs.iter_mut().zip(clippers) {
            for (label, c) in &prepared.clip_norms {
                progress(
                    done,
                    total,
                    &format!("{name}: clipper {} at C = {:.3e}", clipper.name(), c.get()),
                );
                judge_at(&prepared, clipper.as_ref(), label, *c, opts, run)?;
            }
            done += per_clipper;
            progress(
                done,
                total,
                &format!("{name}: clipper {} judged", clipper.name()),
            );
        }
    }
    runs.into_iter()
        .zip(clippers)
        .map(|(run, clipper)| {
            ClipperAudit::new(
                clipper.name(),
                run.metrics,
                run.warnings,
                opts.precision,
                &opts.accounting,
                opts.noise_multiplier,
            )
        })
        .collect()
}

/// One clipper on a prepared case at one C, judged: its claim, and its step when the step is
/// judged; the metrics and the warnings join those of its run. Each of its runs draws its own
/// seeded noise.
fn judge_at(
    prepared: &PreparedCase,
    clipper: &dyn Clipper,
    label: &CaseLabel,
    c: ClipNorm,
    opts: &AuditOptions,
    run: &mut ClipperRun,
) -> Result<()> {
    let noise_seed = opts.noise_seed ^ (run.metrics.len() as u64).wrapping_mul(0x9E37);
    let produced = produce(clipper, &prepared.trace, c, opts, noise_seed).map_err(|e: Error| {
        e.context(format!(
            "clipper {} on case {}",
            clipper.name(),
            label.label()
        ))
    })?;
    for w in &produced.clipped.report.warnings {
        if !run.warnings.contains(w) {
            run.warnings.push(w.clone());
        }
    }
    let mut claim = claim_of(produced.clipped)?;
    // With the step judged, its check compares the clipped sum at the clipper's coefficients
    // too, from the same rebuilt gradients: the claim is evaluated without it, and the sum moves
    // to the step (at 1 B parameters it is 4.9 GB).
    let sum = if produced.update.is_some() {
        claim.clipped_sum.take()
    } else {
        None
    };
    let mut m = prepared.judge.evaluate(
        label.clone(),
        &claim,
        c,
        opts.noise_multiplier,
        opts.precision,
    )?;
    if let Some(update) = produced.update {
        let step = step_claim(sum, update, produced.divisor)?;
        let arithmetic = Arithmetic::of(opts.precision, prepared.judge.tolerance.own.len());
        prepared
            .judge
            .judge_step_with_sum(&mut m, &step, c, opts.noise_multiplier, &arithmetic)?;
    }
    run.metrics.push(m);
    Ok(())
}
