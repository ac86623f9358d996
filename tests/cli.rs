//! The binary end to end: outputs against golden files, and every kind of bad input giving a
//! clear message and exit status 2 (never a panic).

use ghost_oracle_reference::{write_raw, Batch, Gpt2, Gpt2Config, Precision, RawTensor};
use ndarray::array;
use safetensors::Dtype;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ghost-oracle"))
}

pub fn golden(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("oracles/golden/cases")
        .join(case)
}

/// A fresh directory for one call: the process id and a counter make it its own, since tests run
/// in parallel threads of one process and two may ask for the same `name` (two tests once
/// shared `privacy-ghost-`, and one's clean-up removed the other's report as it was written).
pub fn tmp(name: &str) -> PathBuf {
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!(
        "ghost-oracle-test-{}-{call}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub fn run(args: &[&str]) -> Output {
    bin().args(args).output().unwrap()
}

/// `sub --model DIR --batch DIR/batch.safetensors ARGS...` on a golden checkpoint directory.
pub fn run_on_golden(sub: &str, case: &str, args: &[&str]) -> Output {
    let d = golden(case);
    let (model, batch) = (d.to_str().unwrap(), d.join("batch.safetensors"));
    let mut all = vec![sub, "--model", model, "--batch", batch.to_str().unwrap()];
    all.extend_from_slice(args);
    run(&all)
}

/// `audit --gate` of one clipper on a golden checkpoint at C = 1: the exit status.
pub fn gate_on_golden(case: &str, clipper: &str) -> Option<i32> {
    let d = golden(case);
    run(&[
        "audit",
        "--model",
        d.to_str().unwrap(),
        "--batch",
        d.join("batch.safetensors").to_str().unwrap(),
        "--clipper",
        clipper,
        "--max-grad-norm",
        "1.0",
        "--gate",
    ])
    .status
    .code()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Exit status 2, a message containing every `needle`, and no panic.
pub fn expect_input_error(args: &[&str], needles: &[&str]) {
    let o = run(args);
    let err = stderr(&o);
    assert_eq!(
        o.status.code(),
        Some(2),
        "args {args:?}: status {:?}, stderr: {err}",
        o.status
    );
    assert!(!err.contains("panicked"), "panic for {args:?}: {err}");
    for n in needles {
        assert!(err.contains(n), "args {args:?}: message lacks {n:?}: {err}");
    }
}

#[test]
fn reference_reproduces_torch_func_norms_on_a_save_pretrained_checkpoint() {
    for case in ["tied_l2_h4_t33", "untied_l2_h3_t8", "tied_f32_hub_names"] {
        let dir = golden(case);
        let out = tmp(&format!("ref-{case}")).join("r.json");
        let o = run_on_golden("reference", case, &["--json", out.to_str().unwrap()]);
        assert!(o.status.success(), "{}", stderr(&o));
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(
            stdout.contains("per-example gradient norms") && stdout.contains("per-parameter norms")
        );
        let got: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        let want: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap())
                .unwrap();
        assert_eq!(got["reduction"], "mean");
        let (g, w) = (
            got["examples"].as_array().unwrap(),
            want["examples"].as_array().unwrap(),
        );
        assert_eq!(g.len(), w.len());
        for (ge, we) in g.iter().zip(w) {
            let (a, b) = (ge["norm"].as_f64().unwrap(), we["norm"].as_f64().unwrap());
            assert!((a - b).abs() <= 1e-9 * b, "{case}: {a} vs {b}");
            for (name, v) in we["params"].as_object().unwrap() {
                let gv = ge["params"][name]
                    .as_f64()
                    .unwrap_or_else(|| panic!("{case}: {name} missing"));
                assert!((gv - v.as_f64().unwrap()).abs() <= 1e-9 * v.as_f64().unwrap().max(1e-300));
            }
            for (name, s) in we["shared"].as_object().unwrap() {
                for key in ["input_sq", "output_sq", "cross"] {
                    let (x, y) = (
                        ge["shared"][name][key].as_f64().unwrap(),
                        s[key].as_f64().unwrap(),
                    );
                    assert!((x - y).abs() <= 1e-9 * a * a, "{case}: {name}.{key}");
                }
            }
        }
    }
}

/// A small valid checkpoint + batch in a fresh directory, for corrupting one thing at a time.
fn valid_case(name: &str) -> (PathBuf, PathBuf) {
    let dir = tmp(name);
    Gpt2::random(Gpt2Config::tiny(11, 8, 8, 1, 2), 1, 0.3)
        .save(&dir, true)
        .unwrap();
    let batch = dir.join("batch.safetensors");
    Batch::new(array![[1_i64, 2, 3, 4]], None)
        .unwrap()
        .save(&batch)
        .unwrap();
    (dir, batch)
}

fn reference_args<'a>(dir: &'a Path, batch: &'a Path) -> Vec<&'a str> {
    vec![
        "reference",
        "--model",
        dir.to_str().unwrap(),
        "--batch",
        batch.to_str().unwrap(),
    ]
}

#[test]
fn missing_model_directory_and_batch_file() {
    let (dir, batch) = valid_case("missing");
    expect_input_error(
        &reference_args(&dir.join("nope"), &batch),
        &["model directory", "nope"],
    );
    expect_input_error(
        &reference_args(&dir, &dir.join("nope.safetensors")),
        &["batch file", "nope.safetensors"],
    );
    std::fs::remove_file(dir.join("config.json")).unwrap();
    expect_input_error(&reference_args(&dir, &batch), &["config", "config.json"]);
}

#[test]
fn unreadable_config_json() {
    let (dir, batch) = valid_case("badjson");
    std::fs::write(dir.join("config.json"), "{ not json").unwrap();
    expect_input_error(
        &reference_args(&dir, &batch),
        &["config.json", "not valid JSON"],
    );
}

#[test]
fn config_and_tensor_shapes_disagree() {
    let (dir, batch) = valid_case("shape");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    cfg["n_embd"] = 12.into();
    cfg["n_head"] = 3.into();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    expect_input_error(
        &reference_args(&dir, &batch),
        &["transformer.wte.weight", "shape", "config.json implies"],
    );
}

#[test]
fn unsupported_tensor_dtype() {
    let (dir, batch) = valid_case("dtype");
    let model: Gpt2 = ghost_oracle_reference::load(&dir).unwrap();
    let mut raw: Vec<(String, RawTensor)> = model
        .params
        .tensors()
        .into_iter()
        .map(|(n, t)| {
            (
                model.param_name(&n),
                RawTensor::from_f64(&t, Precision::F32),
            )
        })
        .collect();
    let ln = raw
        .iter_mut()
        .find(|(n, _)| n.ends_with("ln_f.bias"))
        .unwrap();
    ln.1 = RawTensor {
        dtype: Dtype::I32,
        shape: ln.1.shape.clone(),
        bytes: ln.1.bytes.clone(),
    };
    write_raw(&dir.join("model.safetensors"), &raw, None).unwrap();
    expect_input_error(
        &reference_args(&dir, &batch),
        &["transformer.ln_f.bias", "I32", "F32, F64, F16 or BF16"],
    );
}

#[test]
fn ids_outside_the_vocabulary() {
    let (dir, batch) = valid_case("ids");
    Batch::new(array![[1_i64, 2, 11, 4]], None)
        .unwrap()
        .save(&batch)
        .unwrap();
    expect_input_error(
        &reference_args(&dir, &batch),
        &["input_ids[0][2] = 11", "vocabulary"],
    );
    // A batch with a negative id cannot be built, only written.
    let ids = array![[1_i64, -3, 1, 4]].into_dyn();
    write_raw(
        &batch,
        &[("input_ids".into(), RawTensor::from_i64(&ids.view()))],
        None,
    )
    .unwrap();
    expect_input_error(&reference_args(&dir, &batch), &["input_ids[0][1] = -3"]);
}

#[test]
fn sequence_longer_than_n_positions() {
    let (dir, batch) = valid_case("long");
    Batch::new(ndarray::Array2::from_elem((1, 9), 1_i64), None)
        .unwrap()
        .save(&batch)
        .unwrap();
    expect_input_error(
        &reference_args(&dir, &batch),
        &["sequence length 9", "n_positions = 8"],
    );
}

#[test]
fn labels_all_ignored_for_an_example() {
    let (dir, batch) = valid_case("ignored");
    Batch::new(
        array![[1_i64, 2, 3, 4], [1, 2, 3, 4]],
        Some(array![[1_i64, 2, 3, 4], [5, -100, -100, -100]]),
    )
    .unwrap()
    .save(&batch)
    .unwrap();
    expect_input_error(
        &reference_args(&dir, &batch),
        &["example 1 has no target", "-100"],
    );
}

#[test]
fn non_finite_weights() {
    let (dir, batch) = valid_case("nan");
    let mut model: Gpt2 = ghost_oracle_reference::load(&dir).unwrap();
    model.params.blocks[0].c_fc.weight[(2, 3)] = f64::NAN;
    model.save(&dir, true).unwrap();
    expect_input_error(
        &reference_args(&dir, &batch),
        &["transformer.h.0.mlp.c_fc.weight", "non-finite"],
    );
    model.params.blocks[0].c_fc.weight[(2, 3)] = f64::INFINITY;
    model.save(&dir, false).unwrap();
    expect_input_error(
        &reference_args(&dir, &batch),
        &["transformer.h.0.mlp.c_fc.weight", "non-finite"],
    );
}

#[test]
fn safetensors_header_claiming_more_data_than_the_file_holds() {
    let (dir, batch) = valid_case("header");
    let header = br#"{"input_ids":{"dtype":"I64","shape":[1000000,1000000],"data_offsets":[0,8000000000000]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0u8; 64]);
    std::fs::write(&batch, &bytes).unwrap();
    expect_input_error(
        &reference_args(&dir, &batch),
        &["batch.safetensors", "not a valid safetensors file"],
    );
    // And a header length that runs past the end of the file.
    let mut bytes = (1u64 << 40).to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(dir.join("model.safetensors"), &bytes).unwrap();
    expect_input_error(
        &reference_args(&dir, &dir.join("batch.safetensors")),
        &["model.safetensors", "not a valid safetensors file"],
    );
    // A truncated checkpoint.
    let (dir2, batch2) = valid_case("truncated");
    let full = std::fs::read(dir2.join("model.safetensors")).unwrap();
    std::fs::write(dir2.join("model.safetensors"), &full[..full.len() - 10]).unwrap();
    expect_input_error(
        &reference_args(&dir2, &batch2),
        &["model.safetensors", "not a valid safetensors file"],
    );
}

#[test]
fn bad_flags_are_named() {
    let (dir, batch) = valid_case("flags");
    let mut args = reference_args(&dir, &batch);
    args.extend(["--reduction", "median"]);
    expect_input_error(&args, &["--reduction", "median"]);
    expect_input_error(
        &["audit", "--clipper", "fastest"],
        &["--clipper", "fastest", "ghost-tied"],
    );
    expect_input_error(&["audit", "--max-grad-norm", "-1"], &["--max-grad-norm"]);
    expect_input_error(&["audit", "--max-grad-norm", "nan"], &["--max-grad-norm"]);
    #[cfg(not(feature = "cuda"))]
    expect_input_error(
        &["audit", "--device", "cuda"],
        &["--device cuda", "--features cuda"],
    );
}

#[test]
fn unwritable_json_path() {
    let (dir, batch) = valid_case("unwritable");
    let mut args = reference_args(&dir, &batch);
    let bad = dir.join("no/such/dir/out.json");
    args.extend(["--json", bad.to_str().unwrap()]);
    expect_input_error(&args, &["--json", "out.json"]);
}

#[test]
fn a_config_claiming_a_huge_model_fails_on_the_header_not_on_allocation() {
    // 2^20 × 4096 f64 would be 32 GiB per table; the file holds a 11×8 table.
    let (dir, batch) = valid_case("huge-config");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    cfg["vocab_size"] = (1u64 << 20).into();
    cfg["n_embd"] = 4096.into();
    cfg["n_head"] = 64.into();
    cfg["n_inner"] = 16384.into();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    expect_input_error(
        &reference_args(&dir, &batch),
        &[
            "transformer.wte.weight",
            "has shape [11, 8]",
            "[1048576, 4096]",
        ],
    );
}

/// `bench ARGS --runs 1 --json FILE` (exit 0), and the JSON it wrote.
fn bench_json(name: &str, args: &[&str]) -> serde_json::Value {
    let json = tmp(name).join("b.json");
    let mut all = vec!["bench"];
    all.extend_from_slice(args);
    all.extend(["--runs", "1", "--json", json.to_str().unwrap()]);
    let o = run(&all);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap()
}

#[test]
fn bench_reports_every_clipper_and_materialize_holds_more_memory_than_ghost() {
    let doc = bench_json(
        "bench",
        &[
            "--vocab", "3000", "--hidden", "16", "--seq", "8", "--batch", "2",
        ],
    );
    assert_eq!(doc["shape"]["vocab"], 3000);
    assert_eq!(doc["shape"]["batch"], 2);
    assert_eq!(doc["dtype"], "f32");
    let results = doc["results"].as_array().unwrap();
    let names: Vec<&str> = results
        .iter()
        .map(|r| r["clipper"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["ghost", "ghost-tied", "materialize"]);
    let field = |name: &str, key: &str| {
        results.iter().find(|r| r["clipper"] == name).unwrap()[key]
            .as_f64()
            .unwrap()
    };
    for name in names {
        assert!(field(name, "seconds") > 0.0 && field(name, "runs") == 1.0);
    }
    // Materializing holds a V×d gradient per example (3000·16·4 bytes = 192 KB); ghost holds
    // T×T Grams (a few hundred bytes per example).
    assert!(
        field("materialize", "peak_bytes") > field("ghost", "peak_bytes") + 150_000.0,
        "{doc}"
    );
}

#[test]
fn a_closed_stdout_ends_the_report_quietly() {
    use std::io::Read;
    use std::process::Stdio;
    let mut child = bin()
        .args(["mutants", "--list"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read nothing: close the pipe before the program writes.
    drop(child.stdout.take());
    let status = child.wait().unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert_eq!(status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn sigma_zero_is_audited_with_a_warning() {
    let o = run(&[
        "check",
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("oracles/golden/traces/opacus_per_sample.safetensors")
            .to_str()
            .unwrap(),
        "--noise-multiplier",
        "0",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("no privacy"), "{}", stderr(&o));
}

#[test]
fn check_max_memory_refuses_a_trace_past_it_and_a_malformed_size_exit_2() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("oracles/golden/traces/opacus_per_sample.safetensors");
    let trace = path.to_str().unwrap();
    let len = std::fs::metadata(&path).unwrap().len();
    // Half the file: refused before it is read, naming the file and the flag.
    let half = (len / 2).to_string();
    let o = run(&["check", trace, "--max-memory", &half]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains(trace) && err.contains("--max-memory"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    for bad in ["8X", "0", "-1G", "lots"] {
        let o = run(&["check", trace, &format!("--max-memory={bad}")]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{bad}: {err}");
        assert!(
            err.contains("--max-memory") && err.contains(bad),
            "{bad}: {err}"
        );
    }
    // Enough: judged as without the flag.
    let o = run(&["check", trace, "--max-memory", "1G"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

/// `export-trace` of a Llama-family checkpoint (in f64, with the reduction its `expected.json`
/// was made with) with one clipper's claims, then `check --gate` of the written trace: the exit
/// status and the claimed norms.
fn export_and_gate(case: &str, clipper: &str) -> (Option<i32>, Vec<f64>) {
    let expected = expected_json(case);
    let out = tmp(&format!("export-{case}-{clipper}")).join("trace.safetensors");
    let o = run_on_golden(
        "export-trace",
        case,
        &[
            "--out",
            out.to_str().unwrap(),
            "--clipper",
            clipper,
            "--dtype",
            "f64",
            "--reduction",
            expected["reduction"].as_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{case} {clipper}: {}", stderr(&o));
    let (_, meta) = ghost_oracle_reference::read_trace(&out).unwrap();
    let o = run(&["check", out.to_str().unwrap(), "--gate"]);
    assert!(!stderr(&o).contains("panicked"), "{case}: {}", stderr(&o));
    (o.status.code(), meta.claimed_norms)
}

fn expected_json(case: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(golden(case).join("expected.json")).unwrap())
        .unwrap()
}

#[test]
fn export_trace_of_every_llama_family_checkpoint_passes_the_gate_with_exact_tied_norms_only() {
    for (case, tied) in [
        ("llama_tied_gqa_l2_t33", true),
        ("qwen2_tied_biases_t12", true),
        ("llama_untied_mha_biases_t8", false),
        // Per-head q/k norms; sliding windows shorter than T and soft-capping; Gemma's padding row.
        ("qwen3_tied_f32_t12", true),
        ("qwen3_untied_bias_ignored_t33", false),
        ("gemma_tied_pad_t12", true),
        ("gemma2_tied_window_softcap_t34", true),
        ("gemma3_tied_window_t40", true),
        ("vaultgemma_tied_window_softcap_t33", true),
    ] {
        let cfg: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(golden(case).join("config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(cfg["tie_word_embeddings"], tied, "{case}");
        let (code, norms) = export_and_gate(case, "ghost-tied");
        assert_eq!(code, Some(0), "{case}");
        // The norms agree with torch.func's per-example gradients of the HF model.
        let torch: Vec<f64> = expected_json(case)["examples"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["norm"].as_f64().unwrap())
            .collect();
        assert_eq!(norms.len(), torch.len(), "{case}");
        for (n, t) in norms.iter().zip(&torch) {
            assert!((n - t).abs() <= 1e-9 * t, "{case}: {n} vs torch {t}");
        }
        // Standard ghost clipping drops the cross term between the embedding and the tied head:
        // the gate fails on a tied model and passes on an untied one.
        let (code, _) = export_and_gate(case, "ghost");
        assert_eq!(code, Some(if tied { 1 } else { 0 }), "{case}");
    }
}

#[test]
fn bench_times_every_clipper_on_a_trace_exported_from_a_qwen2_checkpoint() {
    let case = "qwen2_tied_biases_t12";
    let d = golden(case);
    let dir = tmp("bench-trace-qwen2");
    let trace = dir.join("trace.safetensors");
    let o = run_on_golden("export-trace", case, &["--out", trace.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let doc = bench_json("bench-trace", &["--trace", trace.to_str().unwrap()]);
    assert_eq!(doc["trace"], trace.to_str().unwrap(), "{doc}");
    let results = doc["results"].as_array().unwrap();
    let names: Vec<&str> = results
        .iter()
        .map(|r| r["clipper"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["ghost", "ghost-tied", "materialize"], "{doc}");
    // Every Qwen2 site is timed: the trace holds the embedding, q/k/v weights and biases, o,
    // gate, up, down, both norms of each layer, the final norm and the tied head.
    let (rt, _) = ghost_oracle_reference::read_trace(&trace).unwrap();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
    let layers = cfg["num_hidden_layers"].as_u64().unwrap() as usize;
    assert_eq!(rt.sites.len(), 1 + 12 * layers + 2);
    for r in results {
        assert!(r["seconds"].as_f64().unwrap() > 0.0, "{doc}");
    }
}

/// `bench --trace` on traces of the 2025–26 families: Qwen3's per-head norm sites (T·H rows) and
/// Gemma 3's sandwich norms are timed like any other.
#[test]
fn bench_times_traces_exported_from_qwen3_and_gemma3_checkpoints() {
    for case in ["qwen3_tied_f32_t12", "gemma3_tied_window_t40"] {
        let trace = tmp(&format!("bench-trace-{case}")).join("trace.safetensors");
        let o = run_on_golden("export-trace", case, &["--out", trace.to_str().unwrap()]);
        assert!(o.status.success(), "{case}: {}", stderr(&o));
        let doc = bench_json(
            &format!("bench-{case}"),
            &["--trace", trace.to_str().unwrap()],
        );
        let results = doc["results"].as_array().unwrap();
        assert_eq!(results.len(), 3, "{doc}");
        for r in results {
            assert!(r["seconds"].as_f64().unwrap() > 0.0, "{case}: {doc}");
            assert!(r["step_seconds"].as_f64().unwrap() > 0.0, "{case}: {doc}");
        }
    }
}
