//! The kill matrix as people read it: a table, a JSON document and an HTML page.

use super::{audit_sections, page, verdict_colour, xml_escape};
use crate::audit::{KillMatrix, Row};
use crate::error::Result;
use crate::judge::Verdict;
use serde_json::{json, Value};
use std::fmt::Write;

fn cell(v: Verdict) -> &'static str {
    match v {
        Verdict::Pass => "-",
        Verdict::UtilityDistortion => "UTIL",
        Verdict::CannotJudge => "N/J",
        Verdict::PrivacyViolation => "PRIV",
        Verdict::InvalidNorm => "NaN",
    }
}

/// What the matrix's checks say of a row.
fn row_check(r: &Row, precision: &str) -> String {
    if !r.problems.is_empty() {
        format!("FAILED: {}", r.problems.join("; "))
    } else if r.invisible {
        format!("not visible at {precision}: within a correct {precision} clipper's rounding")
    } else {
        "ok".to_string()
    }
}

/// The kill matrix's one-line verdict, printed under its table: every seeded bug caught with the
/// verdict it must get and no correct clipper flagged, or the detection check failed.
pub fn kill_matrix_verdict_line(m: &KillMatrix) -> &'static str {
    if m.ok() {
        "every mutant caught with the right verdict; no false alarm"
    } else {
        "DETECTION CHECK FAILED"
    }
}

/// The kill matrix as a text table: a row per clipper, a column per case.
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
        let _ = writeln!(
            s,
            "{line}  {:>3}/{:<2}  {}",
            caught,
            m.cases.len(),
            row_check(r, &m.precision)
        );
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
        let check = row_check(r, &m.precision);
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

/// The kill matrix as JSON.
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
                "invisible_at_precision": r.invisible,
                "problems": r.problems,
                "cases": cells,
            })
        })
        .collect();
    json!({"ok": m.ok(), "rows": rows})
}
