//! Detection power: every mutant against the built-in suite, with the checks that make the
//! result trustworthy — every mutant caught, each with the right verdict class, and no correct
//! clipper flagged.

use super::{ExpectedVerdict, Mutant, MutantClipper};
use crate::audit::{run, AuditOptions, Case, ClipperAudit};
use crate::clippers::{Clipper, MaterializeClipper, TiedGhostClipper};
use crate::error::Result;
use crate::judge::{CaseMetrics, Verdict};
use crate::report::{audit_sections, page, verdict_colour, xml_escape};
use serde_json::{json, Value};
use std::fmt::Write;

pub struct Row {
    pub clipper: String,
    pub mutant: Option<Mutant>,
    /// Most severe verdict per base case (over its clipping norms).
    pub cells: Vec<Verdict>,
    pub problems: Vec<String>,
}

pub struct KillMatrix {
    pub cases: Vec<String>,
    pub rows: Vec<Row>,
    /// Every clipper's full audit, in row order.
    pub audits: Vec<ClipperAudit>,
}

impl KillMatrix {
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

fn check(mutant: Option<Mutant>, audit: &ClipperAudit) -> Vec<String> {
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
        Some(m) => {
            if flagged == 0 {
                problems.push("never caught".into());
            }
            match m.expected() {
                ExpectedVerdict::PrivacyViolation if privacy == 0 => {
                    problems.push("never a privacy-violation".into())
                }
                ExpectedVerdict::NeverPrivacyViolation if privacy > 0 => problems.push(format!(
                    "privacy-violation on {privacy} case(s), but it only over-estimates"
                )),
                _ => {}
            }
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

fn base_case(label: &str) -> &str {
    label.split('@').next().unwrap_or(label)
}

pub fn kill_matrix(
    cases: &[Case],
    opts: &AuditOptions,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<KillMatrix> {
    let mut clippers: Vec<(Option<Mutant>, Box<dyn Clipper>)> = Mutant::ALL
        .iter()
        .map(|&m| (Some(m), Box::new(MutantClipper(m)) as Box<dyn Clipper>))
        .collect();
    clippers.push((None, Box::new(TiedGhostClipper)));
    clippers.push((None, Box::new(MaterializeClipper)));
    let (kinds, boxes): (Vec<_>, Vec<_>) = clippers.into_iter().unzip();
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
                        .filter(|c| base_case(&c.case) == n)
                        .map(|c| c.verdict)
                        .max()
                        .unwrap_or(Verdict::Pass)
                })
                .collect();
            Row {
                clipper: a.name.clone(),
                mutant,
                cells,
                problems: check(mutant, a),
            }
        })
        .collect();
    Ok(KillMatrix {
        cases: names,
        rows,
        audits,
    })
}

fn cell(v: Verdict) -> &'static str {
    match v {
        Verdict::Pass => "-",
        Verdict::UtilityDistortion => "UTIL",
        Verdict::PrivacyViolation => "PRIV",
        Verdict::InvalidNorm => "NaN",
    }
}

pub fn kill_matrix_table(m: &KillMatrix) -> String {
    let mut s = String::new();
    let w = m.rows.iter().map(|r| r.clipper.len()).max().unwrap_or(10);
    let _ = writeln!(s, "cases:");
    for (k, c) in m.cases.iter().enumerate() {
        let _ = writeln!(s, "  c{k} = {c}");
    }
    let mut header = format!("\n{:<w$}", "clipper");
    for k in 0..m.cases.len() {
        let _ = write!(header, "  {:>4}", format!("c{k}"));
    }
    let _ = writeln!(s, "{header}  caught  check");
    for r in &m.rows {
        let mut line = format!("{:<w$}", r.clipper);
        for v in &r.cells {
            let _ = write!(line, "  {:>4}", cell(*v));
        }
        let caught = r.cells.iter().filter(|v| **v != Verdict::Pass).count();
        let check = if r.problems.is_empty() {
            "ok".to_string()
        } else {
            format!("FAILED: {}", r.problems.join("; "))
        };
        let _ = writeln!(s, "{line}  {:>3}/{:<2}  {check}", caught, m.cases.len());
    }
    let _ = writeln!(s, "\nPRIV = privacy-violation, UTIL = utility-distortion, - = pass (most severe over the case's clipping norms)");
    s
}

/// The kill matrix as a coloured HTML page, each clipper's plots below it.
pub fn kill_matrix_html(m: &KillMatrix, dtype: &str) -> Result<String> {
    let mut body = String::from("<table class=\"matrix\"><tr><th>clipper</th>");
    for c in &m.cases {
        let _ = write!(body, "<th>{}</th>", xml_escape(c));
    }
    body.push_str("<th>caught</th><th>check</th></tr>");
    for r in &m.rows {
        let _ = write!(body, "<tr><td>{}</td>", xml_escape(&r.clipper));
        for v in &r.cells {
            let _ = write!(
                body,
                "<td style=\"background:{};color:#fff\">{}</td>",
                verdict_colour(*v),
                cell(*v)
            );
        }
        let caught = r.cells.iter().filter(|v| **v != Verdict::Pass).count();
        let check = if r.problems.is_empty() {
            "ok".to_string()
        } else {
            format!("FAILED: {}", r.problems.join("; "))
        };
        let _ = write!(
            body,
            "<td>{caught}/{}</td><td>{}</td></tr>",
            m.cases.len(),
            xml_escape(&check)
        );
    }
    body.push_str("</table><pre>");
    body.push_str(&xml_escape(&kill_matrix_table(m)));
    body.push_str("</pre>");
    body.push_str(&audit_sections(&m.audits, dtype, "cpu")?);
    Ok(page(&format!("ghost-oracle kill matrix ({dtype})"), &body))
}

pub fn kill_matrix_json(m: &KillMatrix) -> Value {
    let rows: Vec<Value> = m
        .rows
        .iter()
        .map(|r| {
            let cells: serde_json::Map<String, Value> = m
                .cases
                .iter()
                .zip(&r.cells)
                .map(|(c, v)| (c.clone(), json!(v.name())))
                .collect();
            json!({
                "clipper": r.clipper,
                "mutant": r.mutant.is_some(),
                "reproduces": r.mutant.map(|m| m.reproduces()),
                "caught": r.cells.iter().filter(|v| **v != Verdict::Pass).count(),
                "ok": r.problems.is_empty(),
                "problems": r.problems,
                "cases": cells,
            })
        })
        .collect();
    json!({"ok": m.ok(), "rows": rows})
}
