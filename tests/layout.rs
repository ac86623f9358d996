//! The source tree's data flow, checked on the source itself: the judge imports nothing from the
//! code it judges, and no two stages import each other.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The top-level module a file belongs to (`src/judge/metrics.rs` → `judge`).
fn stage(path: &Path) -> String {
    let rel = path.strip_prefix(src()).unwrap();
    let first = rel
        .components()
        .next()
        .unwrap()
        .as_os_str()
        .to_string_lossy();
    first.trim_end_matches(".rs").to_string()
}

/// Lines that are code: comments and doc comments dropped.
fn code(text: &str) -> String {
    text.lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every `crate::X` a file names, X a top-level module.
fn crate_refs(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let code = code(text);
    let mut rest = code.as_str();
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            out.insert(name);
        }
    }
    out
}

#[test]
fn the_judge_imports_no_clipper_kernel_mutant_or_candle_code() {
    let mut files = Vec::new();
    rust_files(&src().join("judge"), &mut files);
    assert!(files.len() >= 4, "{files:?}");
    let forbidden_modules = [
        "clippers", "mutants", "model", "audit", "report", "bench", "trace",
    ];
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        for m in crate_refs(&text) {
            assert!(
                !forbidden_modules.contains(&m.as_str()),
                "{} imports crate::{m}: the judge must not depend on the code it judges",
                f.display()
            );
        }
        let body = code(&text);
        for word in ["candle_core", "gram::", "Factored", "Clipper"] {
            assert!(
                !body.contains(word),
                "{} mentions `{word}`: the judge must compute from the reference side only",
                f.display()
            );
        }
    }
}

#[test]
fn the_stages_import_each_other_without_cycles() {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let mut deps: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let stages: BTreeSet<String> = files.iter().map(|f| stage(f)).collect();
    for f in &files {
        let s = stage(f);
        let refs = crate_refs(&std::fs::read_to_string(f).unwrap());
        let entry = deps.entry(s.clone()).or_default();
        for r in refs {
            if r != s && stages.contains(&r) && r != "error" {
                entry.insert(r);
            }
        }
    }
    // Depth-first search for a back edge.
    fn visit(
        n: &str,
        deps: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) {
        if done.contains(n) {
            return;
        }
        if let Some(i) = path.iter().position(|p| p == n) {
            panic!("import cycle: {} -> {n}", path[i..].join(" -> "));
        }
        path.push(n.to_string());
        for d in deps.get(n).into_iter().flatten() {
            visit(d, deps, path, done);
        }
        path.pop();
        done.insert(n.to_string());
    }
    let mut done = BTreeSet::new();
    for s in deps.keys() {
        visit(s, &deps, &mut Vec::new(), &mut done);
    }
    // The judge sits upstream of everything that reports on it.
    assert!(deps["audit"].contains("judge") && deps["audit"].contains("clippers"));
    assert!(
        deps.get("judge")
            .is_none_or(|d| d.iter().all(|m| m == "accountant")),
        "{:?}",
        deps.get("judge")
    );
}
