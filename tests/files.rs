//! The files the CLI reads and writes, whole or not at all: a truncated trace is refused naming
//! the file (exit 2, never a panic); a report or a trace that cannot be written leaves nothing
//! at its path and no temporary file beside it; an old report is replaced whole; and the same
//! input gives the same bytes (trace, JSON and HTML reports) run after run, on 1 thread or 2.

use crate::cli::{bin, golden, run, run_on_golden, stderr, tmp};
use std::path::{Path, PathBuf};

fn good_trace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("oracles/golden/traces/opacus_per_sample.safetensors")
}

/// The names in `dir`, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn assert_exit_2_naming(args: &[&str], needles: &[&str]) {
    let o = run(args);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: the message lacks {n:?}: {err}");
    }
}

#[test]
fn check_on_a_truncated_trace_exits_2_naming_the_file() {
    let bytes = std::fs::read(good_trace()).unwrap();
    let n = usize::try_from(u64::from_le_bytes(bytes[..8].try_into().unwrap())).unwrap();
    let dir = tmp("truncated-traces");
    let cuts = [
        ("empty", 0),
        ("in_length", 5),
        ("in_header", 8 + n / 2),
        ("after_header", 8 + n),
        ("in_data", 8 + n + (bytes.len() - 8 - n) / 2),
        ("last_byte", bytes.len() - 1),
    ];
    for (what, k) in cuts {
        let path = dir.join(format!("{what}.safetensors"));
        std::fs::write(&path, &bytes[..k]).unwrap();
        assert_exit_2_naming(
            &["check", path.to_str().unwrap()],
            &[path.to_str().unwrap()],
        );
    }
    // The fuzz corpus keeps truncated traces too (a smaller model's): each is refused by name.
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/trace_parser");
    let mut seen = 0;
    for entry in std::fs::read_dir(&corpus).unwrap() {
        let path = entry.unwrap().path();
        if path
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("truncated_")
        {
            assert_exit_2_naming(
                &["check", path.to_str().unwrap()],
                &[path.to_str().unwrap()],
            );
            seen += 1;
        }
    }
    assert!(seen >= 5, "the corpus holds {seen} truncated traces");
}

#[test]
fn a_report_that_cannot_be_written_leaves_nothing_behind() {
    let dir = tmp("unwritable-reports");
    let trace = good_trace();
    let trace = trace.to_str().unwrap();
    let missing = dir.join("no/such/dir/report.json");
    assert_exit_2_naming(
        &["check", trace, "--json", missing.to_str().unwrap()],
        &["--json", missing.to_str().unwrap(), "does not exist"],
    );
    // A directory where the file should go.
    std::fs::create_dir(dir.join("taken")).unwrap();
    let taken = dir.join("taken");
    assert_exit_2_naming(
        &["check", trace, "--html", taken.to_str().unwrap()],
        &["--html", taken.to_str().unwrap(), "is a directory"],
    );
    assert_eq!(listing(&dir), ["taken"]);
    assert!(listing(&taken).is_empty());
}

#[test]
fn a_report_replaces_an_old_one_whole_and_leaves_no_temporary_file() {
    let dir = tmp("replaced-report");
    let json = dir.join("report.json");
    std::fs::write(&json, "an old report, longer than nothing").unwrap();
    let o = run(&[
        "check",
        good_trace().to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(doc["clippers"].as_array().map(Vec::len), Some(1), "{doc}");
    assert_eq!(listing(&dir), ["report.json"]);
}

#[test]
fn export_trace_to_a_missing_directory_fails_naming_out_and_writes_nothing() {
    let dir = tmp("export-missing-dir");
    let out = dir.join("no/such/dir/trace.safetensors");
    let o = run_on_golden(
        "export-trace",
        "tied_l1_h2_t2",
        &["--out", out.to_str().unwrap()],
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    for n in ["--out", out.to_str().unwrap(), "does not exist"] {
        assert!(err.contains(n), "the message lacks {n:?}: {err}");
    }
    assert!(listing(&dir).is_empty());
}

/// `args` with RAYON_NUM_THREADS = `threads`; must succeed.
fn run_with_threads(threads: usize, args: &[&str]) {
    let o = bin()
        .env("RAYON_NUM_THREADS", threads.to_string())
        .args(args)
        .output()
        .unwrap();
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
}

#[test]
fn the_same_input_gives_the_same_trace_and_reports_byte_for_byte_on_1_or_2_threads() {
    let dir = tmp("determinism");
    let case = golden("tied_l1_h2_t2");
    let (model, batch) = (case.to_str().unwrap(), case.join("batch.safetensors"));
    let mut outputs: Vec<[Vec<u8>; 3]> = Vec::new();
    for (k, threads) in [1, 2, 1, 2].into_iter().enumerate() {
        // One folder a run, the same names in each: a report names its trace.
        let run_dir = dir.join(format!("run{k}"));
        std::fs::create_dir(&run_dir).unwrap();
        let trace = run_dir.join("trace.safetensors");
        let (json, html) = (run_dir.join("report.json"), run_dir.join("report.html"));
        run_with_threads(
            threads,
            &[
                "export-trace",
                "--model",
                model,
                "--batch",
                batch.to_str().unwrap(),
                "--out",
                trace.to_str().unwrap(),
                "--clipper",
                "ghost",
            ],
        );
        run_with_threads(
            threads,
            &[
                "check",
                trace.to_str().unwrap(),
                "--json",
                json.to_str().unwrap(),
                "--html",
                html.to_str().unwrap(),
            ],
        );
        let read = |p: &Path| std::fs::read(p).unwrap();
        outputs.push([read(&trace), read(&json), read(&html)]);
    }
    for (k, o) in outputs.iter().enumerate().skip(1) {
        for (what, (a, b)) in ["trace", "JSON report", "HTML report"]
            .iter()
            .zip(outputs[0].iter().zip(o))
        {
            assert!(a == b, "run {k}: the {what} differs from run 0's");
        }
    }
    // The runs wrote what they were asked to, nothing else.
    for k in 0..outputs.len() {
        assert_eq!(
            listing(&dir.join(format!("run{k}"))),
            ["report.html", "report.json", "trace.safetensors"]
        );
    }
}
