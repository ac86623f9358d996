//! Detection power: every mutant against the built-in suite, with the checks that make the
//! result trustworthy — every mutant caught, each with the right verdict class, and no correct
//! clipper flagged.

use super::{run, AuditOptions, Case, ClipperAudit};
use crate::clippers::Clipper;
use crate::error::Result;
use crate::judge::{CaseMetrics, Verdict};
use crate::mutants::{Corrupts, ExpectedVerdict, Mutant};
use crate::registry;

/// One clipper's row: its verdicts per case and what is wrong with them.
pub struct Row {
    /// The clipper's name.
    pub clipper: String,
    /// The bug seeded into it; `None` for a clipper as written.
    pub mutant: Option<Mutant>,
    /// Most severe verdict per base case (over its clipping norms).
    pub cells: Vec<Verdict>,
    /// What the row's verdicts say is wrong (a correct clipper failing, a mutant surviving).
    pub problems: Vec<String>,
    /// A seeded bug that this audit cannot see (no bug at its precision, or in a part of the step
    /// it does not judge): it is run and shown, and neither catching nor missing it is a problem.
    pub invisible: bool,
}

/// Every clipper (correct and mutated) against every case: which bugs the audit catches.
pub struct KillMatrix {
    /// The precision the clippers computed in (`f32`, `bf16`, ...).
    pub precision: String,
    /// The base cases, in column order.
    pub cases: Vec<String>,
    /// One row per clipper, correct ones first.
    pub rows: Vec<Row>,
    /// Every clipper's full audit, in row order.
    pub audits: Vec<ClipperAudit>,
}

impl KillMatrix {
    /// True when no row has a problem.
    pub fn ok(&self) -> bool {
        self.rows.iter().all(|r| r.problems.is_empty())
    }
}

/// Where the truth alone says dropping (or under-counting) a positive cross term must violate
/// privacy: an example whose cross share is well beyond the bound and whose true norm exceeds C.
fn cross_term_forces_violation(c: &CaseMetrics) -> bool {
    c.examples.iter().any(|e| {
        e.cross_share.is_some_and(|x| x > 4.0 * e.bound)
            && e.true_norm > c.max_grad_norm * (1.0 + 4.0 * e.bound)
    })
}

/// Whether an audit run with `opts` can see the bug: the precision keeps it a bug, and the audit
/// judges what it corrupts.
fn visible(m: Mutant, opts: &AuditOptions) -> bool {
    let judged = match m.corrupts() {
        Corrupts::Norms => true,
        Corrupts::Step => opts.judge_step,
        Corrupts::Noise => opts.judge_step && opts.noise_multiplier.get() > 0.0,
    };
    judged && m.visible_at(opts.precision)
}

fn check(mutant: Option<Mutant>, audit: &ClipperAudit, opts: &AuditOptions) -> Vec<String> {
    let mut problems = Vec::new();
    let flagged = audit
        .cases
        .iter()
        .filter(|c| c.verdict != Verdict::Pass)
        .count();
    let privacy = audit
        .cases
        .iter()
        .filter(|c| c.verdict == Verdict::PrivacyViolation)
        .count();
    match mutant {
        None => {
            if flagged > 0 {
                problems.push(format!("correct clipper flagged on {flagged} case(s)"));
            }
        }
        Some(m) if !visible(m, opts) => {}
        Some(m) => {
            if flagged == 0 {
                problems.push("never caught".into());
            }
            let wrong_class = match m.expected() {
                ExpectedVerdict::PrivacyViolation => {
                    (privacy == 0).then(|| "never a privacy-violation".to_string())
                }
                ExpectedVerdict::NeverPrivacyViolation => (privacy > 0).then(|| {
                    format!("privacy-violation on {privacy} case(s), but it only over-estimates")
                }),
                ExpectedVerdict::Flagged => None,
            };
            problems.extend(wrong_class);
            if m == Mutant::DropCross {
                for c in &audit.cases {
                    if cross_term_forces_violation(c) && c.verdict != Verdict::PrivacyViolation {
                        problems.push(format!(
                            "{}: positive cross term on a clipped example, verdict {}",
                            c.case,
                            c.verdict.name()
                        ));
                    }
                }
            }
        }
    }
    problems
}

/// Audits every built-in clipper and every mutant on `cases`; `progress` is told (done, total,
/// clipper) as each clipper finishes.
pub fn kill_matrix(
    cases: &[Case],
    opts: &AuditOptions,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<KillMatrix> {
    let (kinds, boxes): (Vec<Option<Mutant>>, Vec<Box<dyn Clipper>>) =
        registry::kill_matrix_clippers().into_iter().unzip();
    let audits = run(cases, &boxes, opts, progress)?;
    let names: Vec<String> = cases.iter().map(|c| c.name.clone()).collect();
    let rows = kinds
        .into_iter()
        .zip(&audits)
        .map(|(mutant, a)| {
            let cells = names
                .iter()
                .map(|n| {
                    a.cases
                        .iter()
                        .filter(|c| &c.base_case == n)
                        .map(|c| c.verdict)
                        .max()
                        .unwrap_or(Verdict::Pass)
                })
                .collect();
            Row {
                clipper: a.name.clone(),
                mutant,
                cells,
                problems: check(mutant, a, opts),
                invisible: mutant.is_some_and(|m| !visible(m, opts)),
            }
        })
        .collect();
    Ok(KillMatrix {
        precision: opts.precision.name().to_string(),
        cases: names,
        rows,
        audits,
    })
}
