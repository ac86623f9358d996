//! A self-contained HTML report: inline SVG plots (plotters' SVG backend), no script or style
//! fetched from anywhere, and the same numbers as the text report.
//!
//! Every plot sits in a `<figure data-plot=… data-points=N>` holding one `<circle>` per plotted
//! example, so a browser test can check that what it rendered is what was plotted.

use super::{audit_tables, summary, xml_escape};
use crate::audit::ClipperAudit;
use crate::error::{Error, Result};
use crate::judge::Verdict;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;
use std::fmt::Write;
use std::ops::Range;

const WIDTH: u32 = 400;
const HEIGHT: u32 = 310;
/// Values at or below zero cannot sit on a log axis; they are drawn at this floor (and said so).
const LOG_FLOOR: f64 = 1e-17;

/// Colour of a verdict, in the tables and headings.
pub fn verdict_colour(v: Verdict) -> &'static str {
    match v {
        Verdict::Pass => "#2e7d32",
        Verdict::UtilityDistortion => "#ef6c00",
        Verdict::CannotJudge => "#546e7a",
        Verdict::PrivacyViolation => "#c62828",
        Verdict::InvalidNorm => "#6a1b9a",
    }
}

fn plot_error(e: impl std::fmt::Display) -> Error {
    Error::internal(format!("drawing a plot: {e}"))
}

/// A log range covering `values` (positive and finite), widened by a margin.
fn log_range(values: impl Iterator<Item = f64>) -> Range<f64> {
    let (lo, hi) = values
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold((f64::INFINITY, 0.0_f64), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if lo > hi {
        return 0.1..10.0;
    }
    (lo / 2.0)..(hi * 2.0)
}

/// One scatter plot as an SVG string: `points` as circles, `lines` as reference lines.
#[allow(clippy::too_many_arguments)]
fn scatter<X, Y>(
    title: &str,
    log_axes: bool,
    (x_desc, y_desc): (&str, &str),
    x: X,
    y: Y,
    points: &[(f64, f64, bool)],
    lines: &[Vec<(f64, f64)>],
) -> Result<String>
where
    X: AsRangedCoord<Value = f64>,
    Y: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 15))
            .margin(8)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(x, y)
            .map_err(plot_error)?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_desc)
            .x_labels(5)
            .y_labels(5)
            .x_label_formatter(&|v| tick(*v, log_axes))
            .y_label_formatter(&|v| tick(*v, log_axes))
            .draw()
            .map_err(plot_error)?;
        for line in lines {
            chart
                .draw_series(LineSeries::new(line.iter().copied(), BLACK.stroke_width(1)))
                .map_err(plot_error)?;
        }
        chart
            .draw_series(points.iter().map(|&(x, y, bad)| {
                let colour = if bad { RED } else { BLUE };
                Circle::new((x, y), 3, colour.mix(0.7).filled())
            }))
            .map_err(plot_error)?;
        root.present().map_err(plot_error)?;
    }
    Ok(svg)
}

/// An axis label: powers of ten as 1e-6 on log axes, plain numbers elsewhere.
fn tick(v: f64, log: bool) -> String {
    if log {
        format!("{v:.0e}")
    } else if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

fn figure(out: &mut String, plot: &str, points: usize, svg: &str, caption: &str) {
    let _ = write!(
        out,
        "<figure data-plot=\"{plot}\" data-points=\"{points}\">{svg}<figcaption>{}</figcaption></figure>",
        xml_escape(caption)
    );
}

/// The three plots of one clipper: claimed against true norm (in units of C), the clipped
/// contributions sorted, and the error against its bound.
fn clipper_plots(a: &ClipperAudit, index: usize) -> Result<String> {
    let mut norms = Vec::new();
    let mut contributions = Vec::new();
    let mut errors = Vec::new();
    let mut skipped = 0;
    for c in &a.cases {
        let cap = c.max_grad_norm;
        for e in &c.examples {
            if e.invalid || e.true_norm.is_nan() || e.true_norm <= 0.0 {
                skipped += 1;
                continue;
            }
            let off = e.err_units > 1.0;
            norms.push((e.true_norm / cap, e.norm.max(LOG_FLOOR) / cap, off));
            contributions.push((e.sensitivity, e.sensitivity > 1.0 + e.bound));
            errors.push((e.bound.max(LOG_FLOOR), e.norm_rel_err.max(LOG_FLOOR), off));
        }
    }
    contributions.sort_by(|x, y| x.0.total_cmp(&y.0));
    let contributions: Vec<(f64, f64, bool)> = contributions
        .iter()
        .enumerate()
        .map(|(k, &(s, bad))| (k as f64, s, bad))
        .collect();

    let mut out = String::from("<div class=\"plots\">");
    let nr = log_range(norms.iter().flat_map(|p| [p.0, p.1]));
    let diag = vec![(nr.start, nr.start), (nr.end, nr.end)];
    let svg = scatter(
        "claimed vs true norm (units of C)",
        true,
        ("true norm / C", "claimed norm / C"),
        nr.clone().log_scale(),
        nr.clone().log_scale(),
        &norms,
        &[
            diag,
            vec![(1.0, nr.start), (1.0, nr.end)],
            vec![(nr.start, 1.0), (nr.end, 1.0)],
        ],
    )?;
    figure(
        &mut out,
        &format!("norms-{index}"),
        norms.len(),
        &svg,
        "One point per example and case; the lines are claimed = true and C (= 1). Red: error beyond the bound.",
    );

    let top = contributions
        .iter()
        .map(|p| p.1)
        .fold(1.0_f64, f64::max)
        .max(1.0)
        * 1.05;
    let n = contributions.len().max(1) as f64;
    let svg = scatter(
        "clipped contributions c·n*/C, sorted",
        false,
        ("example (sorted)", "c·n*/C"),
        -1.0..n,
        0.0..top,
        &contributions,
        &[vec![(-1.0, 1.0), (n, 1.0)]],
    )?;
    figure(
        &mut out,
        &format!("contributions-{index}"),
        contributions.len(),
        &svg,
        "Above the line at 1 an example contributes more than C: the DP guarantee fails at the stated σ.",
    );

    let er = log_range(errors.iter().flat_map(|p| [p.0, p.1]));
    let svg = scatter(
        "norm error vs tolerance bound",
        true,
        ("bound", "|n − n*| / n*"),
        er.clone().log_scale(),
        er.clone().log_scale(),
        &errors,
        &[vec![(er.start, er.start), (er.end, er.end)]],
    )?;
    figure(
        &mut out,
        &format!("errors-{index}"),
        errors.len(),
        &svg,
        "Above the diagonal the error exceeds the bound. Exact zeros are drawn at 1e-17.",
    );
    out.push_str("</div>");
    if skipped > 0 {
        let _ = write!(
            out,
            "<p class=\"note\">{skipped} example(s) with an invalid norm or a zero true norm are not plotted.</p>"
        );
    }
    Ok(out)
}

const STYLE: &str = "body{font-family:sans-serif;margin:24px;color:#222}\
h2{margin-top:36px}.verdict{color:#fff;padding:2px 8px;border-radius:4px;font-size:0.8em}\
.plots{display:flex;flex-wrap:wrap;gap:8px}figure{margin:0;border:1px solid #ddd}\
figcaption{font-size:0.75em;max-width:400px;padding:4px}pre{font-size:0.72em;overflow-x:auto;\
background:#f7f7f7;padding:8px}table.matrix td,table.matrix th{padding:2px 8px;text-align:center;\
font-size:0.8em}.note{font-size:0.8em;color:#555}";

/// Counts the circles each figure rendered and compares them with what was plotted: the
/// result lands in `body[data-plots]` ("ok" or the first mismatch), read by the browser test.
const CHECK: &str = "<script>\n(function(){var bad=[];document.querySelectorAll('figure[data-plot]').forEach(function(f){\
var n=f.querySelectorAll('svg circle').length;f.setAttribute('data-rendered',n);\
if(String(n)!==f.getAttribute('data-points')){bad.push(f.getAttribute('data-plot')+': '+n+' of '+f.getAttribute('data-points'));}});\
document.body.setAttribute('data-plots',bad.length?bad.join('; '):'ok');\
document.body.setAttribute('data-figures',document.querySelectorAll('figure[data-plot]').length);})();\n</script>";

/// A whole page around `body`.
pub fn page(title: &str, body: &str) -> String {
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title><style>{STYLE}</style></head>\n<body>\n<h1>{}</h1>\n{body}\n{CHECK}\n</body></html>\n",
        xml_escape(title),
        xml_escape(title)
    )
}

/// Per clipper: its verdict, its ε, three plots, and the text table.
pub fn audit_sections(audits: &[ClipperAudit], dtype: &str, device: &str) -> Result<String> {
    let mut body = format!("<pre>{}</pre>", xml_escape(summary(audits).trim()));
    for (k, a) in audits.iter().enumerate() {
        let _ = write!(
            body,
            "<h2>{} <span class=\"verdict\" style=\"background:{}\">{}</span></h2>",
            xml_escape(&a.name),
            verdict_colour(a.verdict),
            a.verdict.name()
        );
        let _ = write!(
            body,
            "<p>{}<br><span class=\"note\">{}</span></p>",
            xml_escape(&a.privacy.sentence()),
            xml_escape(&a.privacy.setting())
        );
        body.push_str(&clipper_plots(a, k)?);
    }
    let _ = write!(
        body,
        "<h2>The numbers</h2><pre>{}</pre>",
        xml_escape(&audit_tables(audits, dtype, device))
    );
    Ok(body)
}

/// The report of `audit` or `check` as one HTML page.
pub fn audit_html(audits: &[ClipperAudit], dtype: &str, device: &str) -> Result<String> {
    Ok(page(
        &format!("ghost-oracle audit ({dtype}, {device})"),
        &audit_sections(audits, dtype, device)?,
    ))
}
