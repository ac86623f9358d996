//! The source tree's data flow, checked on the source itself: the judge imports nothing from the
//! code it judges, no two stages import each other, and no two modules inside a stage do
//! (grouped imports, `use crate::{a, b::{c, d}}`, read like any other).

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

/// The paths a `use` tree names, from just after its first `::`: `a::b::C` is one,
/// `{a, b::{c, d}}` three (`a`, `b::c`, `b::d`). A path ends at the first character that is no
/// part of one (a `*`, `;`, `>`, `(`...).
fn use_tree(s: &str) -> Vec<Vec<String>> {
    let mut segments = Vec::new();
    let mut rest = s;
    loop {
        rest = rest.trim_start();
        if let Some(group) = rest.strip_prefix('{') {
            let mut out = Vec::new();
            let (mut depth, mut start) = (0usize, 0usize);
            for (k, c) in group.char_indices() {
                let end = match c {
                    '{' => {
                        depth += 1;
                        false
                    }
                    '}' if depth == 0 => true,
                    '}' => {
                        depth -= 1;
                        false
                    }
                    ',' => depth == 0,
                    _ => false,
                };
                if end {
                    for tail in use_tree(&group[start..k]) {
                        out.push(segments.iter().cloned().chain(tail).collect());
                    }
                    start = k + 1;
                    if c == '}' {
                        break;
                    }
                }
            }
            return out;
        }
        let ident: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if ident.is_empty() {
            return vec![segments];
        }
        rest = &rest[ident.len()..];
        segments.push(ident);
        match rest.trim_start().strip_prefix("::") {
            Some(r) => rest = r,
            None => return vec![segments],
        }
    }
}

/// Every path a file names from `crate::`, `super::` or `self::`, grouped imports expanded, as
/// written: its first segment is the prefix (`crate`, `super` or `self`).
fn named_paths(text: &str) -> Vec<Vec<String>> {
    let code = code(text);
    let mut out = Vec::new();
    for prefix in ["crate", "super", "self"] {
        let token = format!("{prefix}::");
        let mut from = 0;
        while let Some(i) = code[from..].find(&token) {
            let at = from + i;
            from = at + token.len();
            // The start of a path, not a later segment (`super::super::`) or another word's end.
            let before = code[..at].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            for tail in use_tree(&code[from..]) {
                out.push(std::iter::once(prefix.to_string()).chain(tail).collect());
            }
        }
    }
    out
}

/// A path as named in module `module`, made absolute (from the crate root).
fn absolute(module: &[String], path: &[String]) -> Vec<String> {
    match path.first().map(String::as_str) {
        Some("crate") => path[1..].to_vec(),
        Some("self") => module.iter().chain(&path[1..]).cloned().collect(),
        Some("super") => {
            let ups = path.iter().take_while(|s| *s == "super").count();
            let base = &module[..module.len().saturating_sub(ups)];
            base.iter().chain(&path[ups..]).cloned().collect()
        }
        _ => path.to_vec(),
    }
}

/// Every `crate::X` a file names, X a top-level module (grouped imports included).
fn crate_refs(text: &str) -> BTreeSet<String> {
    named_paths(text)
        .into_iter()
        .filter(|p| p[0] == "crate")
        .filter_map(|p| p.get(1).cloned())
        .filter(|s| s != "self")
        .collect()
}

/// A crate's modules, each with its source: the module path of every file under `root`
/// (`judge/step/sum.rs` → `judge::step::sum`, `judge/step/mod.rs` → `judge::step`). The crate
/// root files (`lib.rs`, `main.rs`) are left out: they declare modules.
fn modules(root: &Path) -> BTreeMap<Vec<String>, String> {
    let mut files = Vec::new();
    rust_files(root, &mut files);
    files
        .iter()
        .filter_map(|f| {
            let rel = f.strip_prefix(root).unwrap().with_extension("");
            let mut path: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if path.last().is_some_and(|s| s == "mod") {
                path.pop();
            }
            if path.len() == 1 && (path[0] == "lib" || path[0] == "main") {
                return None;
            }
            Some((path, std::fs::read_to_string(f).unwrap()))
        })
        .collect()
}

/// The module a path leads into: its longest prefix that is a module of `known`.
fn module_of<'a>(
    known: &'a BTreeMap<Vec<String>, String>,
    path: &[String],
) -> Option<&'a [String]> {
    (1..=path.len())
        .rev()
        .find_map(|n| known.get_key_value(&path[..n]).map(|(k, _)| k.as_slice()))
}

/// Per module (`judge::step`), the modules of the same top-level module (stage) it names: its
/// imports and any path written in its code. A module naming its own ancestors (a child using
/// what its parent declares, as `super::Trait`) is no arrow: the parent declares the child, and
/// a cycle through a parent would be every folder's facade. Arrows to siblings and to other
/// branches are.
fn arrows_within_stages(
    known: &BTreeMap<Vec<String>, String>,
) -> BTreeMap<String, BTreeSet<String>> {
    known
        .iter()
        .map(|(m, text)| {
            let targets = named_paths(text)
                .iter()
                .map(|p| absolute(m, p))
                .filter_map(|p| module_of(known, &p))
                .filter(|t| t[0] == m[0] && !m.starts_with(t))
                .map(|t| t.join("::"))
                .collect();
            (m.join("::"), targets)
        })
        .collect()
}

/// Depth-first search for a back edge; panics naming the cycle.
fn assert_acyclic(deps: &BTreeMap<String, BTreeSet<String>>, what: &str) {
    fn visit<'a>(
        n: &'a str,
        deps: &'a BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
        what: &str,
    ) {
        if done.contains(n) {
            return;
        }
        if let Some(i) = path.iter().position(|p| *p == n) {
            panic!("import cycle in {what}: {} -> {n}", path[i..].join(" -> "));
        }
        path.push(n);
        for d in deps.get(n).into_iter().flatten() {
            visit(d, deps, path, done, what);
        }
        path.pop();
        done.insert(n);
    }
    let mut done = BTreeSet::new();
    for n in deps.keys() {
        visit(n, deps, &mut Vec::new(), &mut done, what);
    }
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
    assert_acyclic(&deps, "src (between stages)");
    // The judge sits upstream of everything that reports on it.
    assert!(deps["audit"].contains("judge") && deps["audit"].contains("clippers"));
    assert!(
        deps.get("judge")
            .is_none_or(|d| d.iter().all(|m| m == "accountant" || m == "options")),
        "{:?}",
        deps.get("judge")
    );
}

/// Inside a stage, modules import each other without cycles too: what a folder's modules share
/// sits in a leaf below them, and whatever uses them sits above (`judge::metrics` holds the
/// step's metrics, so the step takes what it needs of the norms' metrics from a leaf, never
/// from `metrics`).
#[test]
fn the_modules_of_a_stage_import_each_other_without_cycles() {
    let known = modules(&src());
    let arrows = arrows_within_stages(&known);
    assert_acyclic(&arrows, "src (inside a stage)");
    let count: usize = arrows.values().map(BTreeSet::len).sum();
    assert!(
        count > 10,
        "only {count} arrows seen: is the scan broken? {arrows:?}"
    );
}

/// The stages in the order data flows through them: a file may name only stages of a lower
/// rank than its own (or its own). `cli` is the binary and names the library by its crate name.
const STAGE_RANKS: [(&str, usize); 16] = [
    ("accountant", 0),
    ("synthetic", 0),
    ("error", 1),
    ("options", 1),
    // files written whole or not at all: below the trace writer and the reports, above errors
    ("atomic", 2),
    ("trace", 3),
    ("model", 4),
    ("clippers", 4),
    ("judge", 4),
    ("mutants", 5),
    ("registry", 6),
    ("bench", 6),
    ("audit", 7),
    ("report", 8),
    ("lib", 9),
    ("cli", 10),
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

/// The reference crate's modules import each other without cycles: what every family shares
/// (the checkpoint files, the config keys) sits below the families, and the enum that chooses
/// among them sits above. A folder (`trace_file/`) is one module here, and its own modules are
/// checked among themselves as a stage's are.
#[test]
fn the_oracle_modules_import_each_other_without_cycles() {
    let known = modules(&Path::new(env!("CARGO_MANIFEST_DIR")).join("oracles/src"));
    let mut top: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, text) in &known {
        let targets = top.entry(m[0].clone()).or_default();
        for p in named_paths(text) {
            if let Some(t) = module_of(&known, &absolute(m, &p)) {
                if t[0] != m[0] {
                    targets.insert(t[0].clone());
                }
            }
        }
    }
    assert_acyclic(&top, "oracles/src");
    let edges: usize = top.values().map(BTreeSet::len).sum();
    assert!(
        edges > 40,
        "only {edges} imports seen: is the scan broken? {top:?}"
    );
    assert_acyclic(
        &arrows_within_stages(&known),
        "oracles/src (inside a module)",
    );
}

/// The scan reads what rustfmt writes: grouped and nested imports, paths in code, `super` chains.
#[test]
fn the_import_scan_reads_grouped_and_nested_paths() {
    let text = "use crate::{a, b::{c, d::E}};\nuse super::super::f::G;\n\
                // crate::commented\nfn x() -> Option<super::h::I> { self::j::k() }\n";
    let module: Vec<String> = ["s", "m", "n"].iter().map(|s| s.to_string()).collect();
    let paths: BTreeSet<Vec<String>> = named_paths(text)
        .iter()
        .map(|p| absolute(&module, p))
        .collect();
    let want: BTreeSet<Vec<String>> = [
        "a",
        "b::c",
        "b::d::E",
        "s::f::G",
        "s::m::h::I",
        "s::m::n::j::k",
    ]
    .iter()
    .map(|p| p.split("::").map(str::to_string).collect())
    .collect();
    assert_eq!(paths, want);
    assert_eq!(
        crate_refs(text),
        ["a", "b"].iter().map(|s| s.to_string()).collect()
    );
}
