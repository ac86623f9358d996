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
        "clippers", "mutants", "model", "audit", "report", "bench", "trace", "registry",
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
fn the_reference_names_no_clipper_kernel_library() {
    // Its Cargo.toml: candle, and the `gemm` crate whose f32 kernels the clippers run, are not
    // dependencies (faer links `gemm` only as its fallback where its own x86-64 f64 kernels
    // cannot run; docs/scale.md).
    let root = src().parent().unwrap().join("oracles");
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let deps = manifest
        .split("[dependencies]")
        .nth(1)
        .expect("oracles/Cargo.toml has dependencies");
    let deps = deps.split("\n[").next().unwrap();
    for line in deps.lines().filter(|l| !l.trim().is_empty()) {
        let name = line.split(['=', '.']).next().unwrap().trim();
        assert!(
            !name.starts_with("candle") && !name.starts_with("gemm"),
            "oracles/Cargo.toml depends on `{name}`, the clippers' kernel library"
        );
    }
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    assert!(files.len() >= 20, "{files:?}");
    for f in &files {
        let body = code(&std::fs::read_to_string(f).unwrap());
        for word in ["candle", "gemm::", "gemm_"] {
            assert!(
                !body.contains(word),
                "{} mentions `{word}`: the reference shares no kernel with the clippers",
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
            .is_none_or(|d| d.iter().all(|m| m == "accountant" || m == "options")),
        "{:?}",
        deps.get("judge")
    );
}

/// The stages in the order data flows through them: a file may name only stages of a lower
/// rank than its own (or its own). `cli` is the binary and names the library by its crate name.
const STAGE_RANKS: [(&str, usize); 15] = [
    ("accountant", 0),
    ("synthetic", 0),
    ("error", 1),
    ("options", 1),
    ("trace", 2),
    ("model", 3),
    ("clippers", 3),
    ("judge", 3),
    ("mutants", 4),
    ("registry", 5),
    ("bench", 5),
    ("audit", 6),
    ("report", 7),
    ("lib", 8),
    ("cli", 9),
];

fn rank(stage: &str) -> usize {
    STAGE_RANKS
        .iter()
        .find(|(s, _)| *s == stage)
        .unwrap_or_else(|| panic!("stage `{stage}` has no rank in tests/layout.rs: give it one"))
        .1
}

#[test]
fn every_import_runs_down_the_data_flow() {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let mut checked = 0;
    for f in &files {
        let s = stage(f);
        if s == "main" {
            continue;
        }
        for r in crate_refs(&std::fs::read_to_string(f).unwrap()) {
            // `crate::` inside the binary names the binary's own modules.
            if s == "cli" || r == s {
                continue;
            }
            assert!(
                rank(&r) < rank(&s) || r == "error",
                "{} (stage {s}) imports crate::{r}: that arrow runs back up the data flow",
                f.display()
            );
            checked += 1;
        }
    }
    assert!(
        checked > 30,
        "only {checked} imports seen: is the scan broken?"
    );
}

/// The three arrows that once ran the wrong way, named so that their return reads plainly.
#[test]
fn mutants_and_models_do_not_reach_up() {
    let refs = |path: &str| crate_refs(&std::fs::read_to_string(src().join(path)).unwrap());
    for m in ["audit", "report"] {
        assert!(
            !refs("mutants.rs").contains(m),
            "src/mutants.rs imports crate::{m}"
        );
    }
    let mut model = Vec::new();
    rust_files(&src().join("model"), &mut model);
    for f in &model {
        let text = std::fs::read_to_string(f).unwrap();
        assert!(
            !crate_refs(&text).contains("clippers"),
            "{} imports crate::clippers: the code that produces traces must not depend on the clipper kernels",
            f.display()
        );
    }
    assert!(!model.is_empty());
}

/// The reference crate's modules (one file each, named by its stem) import each other without
/// cycles: what every family shares (the checkpoint files, the config keys) sits below the
/// families, and the enum that chooses among them sits above.
#[test]
fn the_oracle_modules_import_each_other_without_cycles() {
    /// Every `crate::X` and `crate::{X, Y::..}` a file names, comments dropped.
    fn imports(text: &str) -> BTreeSet<String> {
        let code: String = text
            .lines()
            .map(|l| l.split("//").next().unwrap_or(""))
            .collect::<Vec<_>>()
            .join("\n");
        let ident = |s: &str| -> String {
            s.trim_start()
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect()
        };
        let mut out = BTreeSet::new();
        let mut rest = code.as_str();
        while let Some(i) = rest.find("crate::") {
            rest = &rest[i + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let (mut depth, mut start) = (0usize, 0usize);
                for (k, c) in group.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => {
                            out.insert(ident(&group[start..k]));
                            break;
                        }
                        '}' => depth -= 1,
                        ',' if depth == 0 => {
                            out.insert(ident(&group[start..k]));
                            start = k + 1;
                        }
                        _ => {}
                    }
                }
            } else {
                out.insert(ident(rest));
            }
        }
        out.remove("");
        out
    }
    fn visit<'a>(
        n: &'a str,
        deps: &'a BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
    ) {
        if done.contains(n) {
            return;
        }
        if let Some(i) = path.iter().position(|p| *p == n) {
            panic!(
                "import cycle in oracles/src: {} -> {n}",
                path[i..].join(" -> ")
            );
        }
        path.push(n);
        for d in deps.get(n).into_iter().flatten() {
            visit(d, deps, path, done);
        }
        path.pop();
        done.insert(n);
    }

    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("oracles/src");
    let mut texts = BTreeMap::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "rs") {
            let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
            texts.insert(stem, std::fs::read_to_string(&path).unwrap());
        }
    }
    // The crate root declares the modules; it is no module of its own.
    texts.remove("lib");
    let deps: BTreeMap<String, BTreeSet<String>> = texts
        .iter()
        .map(|(m, text)| {
            let refs = imports(text)
                .into_iter()
                .filter(|r| r != m && texts.contains_key(r))
                .collect();
            (m.clone(), refs)
        })
        .collect();
    let mut done = BTreeSet::new();
    for m in deps.keys() {
        visit(m, &deps, &mut Vec::new(), &mut done);
    }
    let edges: usize = deps.values().map(BTreeSet::len).sum();
    assert!(
        edges > 40,
        "only {edges} imports seen: is the scan broken? {deps:?}"
    );
}
