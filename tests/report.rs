//! What a reader sees: the HTML report's plots hold what was plotted, every flag has a help
//! line, and the README's audit excerpt and quoted figures are the program's real output.

use crate::cli::{run, stderr, tmp};
use std::path::Path;

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn the_html_report_is_self_contained_and_plots_every_example() {
    let dir = tmp("html");
    let (html, json) = (dir.join("r.html"), dir.join("r.json"));
    let o = run(&[
        "audit",
        "--clipper",
        "ghost",
        "--clipper",
        "ghost-tied",
        "--html",
        html.to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let page = std::fs::read_to_string(&html).unwrap();
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    // Nothing is fetched: no external script, style, image or font.
    for needle in ["src=", "href=", "@import", "url("] {
        assert!(!page.contains(needle), "the page references `{needle}`");
    }
    let examples: usize = doc["clippers"][0]["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["examples"].as_array().unwrap().len())
        .sum();
    // Three figures per clipper, each with one circle per example of every case.
    let figures: Vec<&str> = page.split("<figure ").skip(1).collect();
    assert_eq!(figures.len(), 6);
    for f in figures {
        let f = &f[..f.find("</figure>").unwrap()];
        let declared: usize = f
            .split("data-points=\"")
            .nth(1)
            .and_then(|s| s.split('"').next())
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(declared, examples);
        assert_eq!(f.matches("<circle").count(), examples);
    }
    // The same numbers as the text report, and the verdicts in colour.
    assert!(page.contains("privacy-violation") && page.contains("#c62828"));
    assert!(page.contains("stated ε ="));
    assert!(page.contains("FAIL ghost"));
}

#[test]
fn every_flag_of_every_subcommand_has_a_help_line() {
    for sub in [
        "audit",
        "check",
        "reference",
        "export-trace",
        "bench",
        "mutants",
    ] {
        let o = run(&[sub, "--help"]);
        assert_eq!(o.status.code(), Some(0));
        let help = stdout(&o);
        let lines: Vec<&str> = help.lines().collect();
        let mut flags = 0;
        for (k, line) in lines.iter().enumerate() {
            let t = line.trim_start();
            let indent = line.len() - t.len();
            if !(t.starts_with("--") || (t.starts_with('-') && t.chars().nth(2) == Some(','))) {
                continue;
            }
            flags += 1;
            // The description follows the flag on its line, or on the next, further indented.
            let same_line = t.split("  ").skip(1).any(|s| !s.trim().is_empty());
            let next_line = lines.get(k + 1).is_some_and(|n| {
                let nt = n.trim_start();
                n.len() - nt.len() > indent && !nt.is_empty() && !nt.starts_with('-')
            });
            assert!(
                same_line || next_line,
                "`{sub} --help`: no description for `{t}`\n{help}"
            );
        }
        assert!(flags >= 2, "{sub}: {help}");
    }
}

/// The lines of the README between `<!-- NAME:start -->` and `<!-- NAME:end -->`.
fn readme_block(name: &str) -> Vec<String> {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let start = format!("<!-- {name}:start -->");
    let end = format!("<!-- {name}:end -->");
    let a = readme
        .find(&start)
        .unwrap_or_else(|| panic!("README has no {start}"));
    let b = readme
        .find(&end)
        .unwrap_or_else(|| panic!("README has no {end}"));
    readme[a + start.len()..b]
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn the_readme_audit_excerpt_and_its_figures_are_the_real_output() {
    let o = run(&["audit"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    let out_lines: Vec<&str> = out.lines().map(str::trim_end).collect();
    let excerpt = readme_block("audit-excerpt");
    let mut checked = 0;
    for line in &excerpt {
        let Some(code) = line.strip_prefix("    ") else {
            continue;
        };
        let code = code.trim_end();
        if code.trim().is_empty() || code.trim() == "..." {
            continue;
        }
        assert!(
            out_lines.contains(&code),
            "README excerpt line not in `audit` output:\n{code}\n\noutput:\n{out}"
        );
        checked += 1;
    }
    assert!(checked >= 8, "only {checked} excerpt lines");
    // Figures the README's prose quotes (in backticks) are in the output too.
    let prose = readme_block("audit-figures").join("\n");
    let mut figures = 0;
    for (k, piece) in prose.split('`').enumerate() {
        if k % 2 == 1 && piece.chars().any(|c| c.is_ascii_digit()) {
            assert!(
                out.contains(piece),
                "README quotes `{piece}`, not in the output"
            );
            figures += 1;
        }
    }
    assert!(figures >= 4, "only {figures} quoted figures");
}
