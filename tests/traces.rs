//! Trace files: the committed PyTorch/Opacus traces, export → check end to end, the round trip,
//! and every kind of malformed trace rejected with a message naming the site and tensor.

use crate::cli::{expect_input_error, golden, run, stderr, tmp};
use ghost_oracle::synthetic::{synthetic_trace, SyntheticSpec};
use ghost_oracle_reference::{read_trace, write_trace, ModelRounding, Precision, TraceMeta};
use proptest::prelude::*;
use std::path::{Path, PathBuf};

fn pytorch_trace(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("oracles/golden/traces")
        .join(format!("{name}.safetensors"))
}

fn check_json(path: &Path, gate_code: i32) -> serde_json::Value {
    let json = tmp(&format!(
        "check-{}",
        path.file_stem().unwrap().to_string_lossy()
    ))
    .join("c.json");
    let o = run(&[
        "check",
        path.to_str().unwrap(),
        "--gate",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(
        o.status.code(),
        Some(gate_code),
        "{}: {}",
        path.display(),
        stderr(&o)
    );
    serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap()
}

#[test]
fn pytorch_traces_exact_opacus_norms_pass_and_broken_claims_fail_with_the_right_verdict() {
    let doc = check_json(&pytorch_trace("opacus_per_sample"), 0);
    assert_eq!(doc["clippers"][0]["verdict"], "pass");
    assert_eq!(doc["clippers"][0]["name"], "opacus-grad-sample");
    for name in ["opacus_ghost_untied", "embedding_only", "batch_mean_loss"] {
        let doc = check_json(&pytorch_trace(name), 1);
        assert_eq!(doc["clippers"][0]["verdict"], "privacy-violation", "{name}");
        assert!(
            doc["clippers"][0]["max_sensitivity_ratio"]
                .as_f64()
                .unwrap()
                > 1.0
        );
    }
}

/// Under a failing result the CLI words the deciding case as the Python package does: Opacus's
/// ghost clipping on an untied copy of GPT-2 (how the trace was made) drops the tied cross
/// term, and the explanation names the tied parameter from the trace header and says so. A
/// passing trace gets no explanation.
#[test]
fn a_failing_check_ends_with_the_deciding_case_in_words() {
    let o = run(&[
        "check",
        pytorch_trace("opacus_ghost_untied").to_str().unwrap(),
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    let words = &out[out.find("\nghost-oracle: clipper `").expect(&out)..];
    for line in [
        "privacy-violation (an example's clipped contribution exceeds C: the DP guarantee does not hold at the stated noise)",
        "\n  worst example ",
        "\n  tied parameter: `transformer.wte.weight` (sites `transformer.wte.weight` (embedding) and `lm_head.weight` (linear))",
        "\n    the claim is the truth without the cross term",
        "a typical fine-tuning run; pass --sampling-rate, --steps, --delta for yours",
        "\n  per example:",
    ] {
        assert!(words.contains(line), "{line}\n{words}");
    }
    let o = run(&[
        "check",
        pytorch_trace("opacus_per_sample").to_str().unwrap(),
    ]);
    assert!(!String::from_utf8_lossy(&o.stdout).contains("ghost-oracle: clipper"));
}

#[test]
fn exported_traces_round_trip_through_check() {
    let d = golden("tied_l2_h4_t33");
    let dir = tmp("export");
    for (clipper, code) in [
        ("ghost-tied", 0),
        ("materialize", 0),
        ("ghost", 1),
        ("mutant:batch-mean-loss", 1),
    ] {
        let out = dir.join(format!("{}.safetensors", clipper.replace(':', "_")));
        let o = run(&[
            "export-trace",
            "--model",
            d.to_str().unwrap(),
            "--batch",
            d.join("batch.safetensors").to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--clipper",
            clipper,
            "--max-grad-norm",
            "3.0",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        check_json(&out, code);
    }
}

fn spec_strategy() -> impl Strategy<Value = (SyntheticSpec, u64)> {
    ((1usize..4, 1usize..6, 1usize..5, 1usize..9), any::<u64>()).prop_map(
        |((batch, seq, width, vocab), seed)| {
            let spec = SyntheticSpec {
                batch,
                seq,
                width,
                vocab,
                id_range: vocab,
                cancellation: 0.0,
                leftover_log10: -3.0,
                scale_log10_range: 1.0,
            };
            (spec, seed)
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]
    #[test]
    fn trace_write_read_round_trip((spec, seed) in spec_strategy()) {
        let t = synthetic_trace(&spec, seed);
        let b = t.batch_size();
        let meta = TraceMeta {
            max_grad_norm: 1.25,
            noise_multiplier: Some(0.7),
            clipper: Some("prop".into()),
            claimed_norms: (0..b).map(|i| 1.0 + i as f64).collect(),
            claimed_coefficients: Some(vec![0.5; b]),
            dtype: Precision::F64,
            compute_dtype: Some(Precision::F32),
            // Every other site says it computed in bf16 (a matmul under autocast).
            site_compute_dtypes: (0..t.sites.len())
                .map(|j| (j % 2 == 1).then_some(Precision::BF16))
                .collect(),
            site_dtypes: vec![Precision::F64; t.sites.len()],
            step: None,
            model_rounding: Some(ModelRounding {
                method: "replay-float64".into(),
                per_example: (0..b).map(|i| 1e-9 * i as f64).collect(),
            }),
        };
        let path = tmp("roundtrip").join("t.safetensors");
        write_trace(&path, &t, &meta).unwrap();
        let (back, back_meta) = read_trace(&path).unwrap();
        prop_assert_eq!(&back_meta, &meta);
        let judged: Vec<Precision> = (0..t.sites.len())
            .map(|j| if j % 2 == 1 { Precision::BF16 } else { Precision::F32 })
            .collect();
        prop_assert_eq!(back_meta.site_precisions(), judged);
        prop_assert_eq!(back.sites.len(), t.sites.len());
        for (a, b) in back.sites.iter().zip(&t.sites) {
            prop_assert_eq!(&a.spec, &b.spec);
            prop_assert_eq!(&a.backprops, &b.backprops);
            prop_assert_eq!(&a.activations, &b.activations);
            prop_assert_eq!(&a.ids, &b.ids);
        }
    }
}

/// A valid trace file to corrupt, with its header and tensors editable.
struct RawTrace {
    meta: std::collections::HashMap<String, String>,
    tensors: Vec<(String, ghost_oracle_reference::RawTensor)>,
}

fn valid_raw() -> RawTrace {
    let spec = crate::common::tiny_synthetic_spec();
    let t = synthetic_trace(&spec, 5);
    let meta = TraceMeta::norms(1.0, vec![1.0, 2.0], Precision::F32);
    let path = tmp("valid-raw").join("t.safetensors");
    write_trace(&path, &t, &meta).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tensors = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            (
                n,
                ghost_oracle_reference::RawTensor {
                    dtype: v.dtype(),
                    shape: v.shape().to_vec(),
                    bytes: v.data().to_vec(),
                },
            )
        })
        .collect();
    RawTrace {
        meta: header.metadata().clone().unwrap(),
        tensors,
    }
}

impl RawTrace {
    fn write(&self, name: &str) -> PathBuf {
        let path = tmp(&format!("bad-trace-{name}")).join("t.safetensors");
        ghost_oracle_reference::write_raw(&path, &self.tensors, Some(self.meta.clone())).unwrap();
        path
    }
    fn drop(&mut self, name: &str) {
        self.tensors.retain(|(n, _)| n != name);
    }
    fn get(&mut self, name: &str) -> &mut ghost_oracle_reference::RawTensor {
        &mut self.tensors.iter_mut().find(|(n, _)| n == name).unwrap().1
    }
    fn sites(&self) -> serde_json::Value {
        serde_json::from_str(&self.meta["sites"]).unwrap()
    }
    fn set_sites(&mut self, v: serde_json::Value) {
        self.meta.insert("sites".into(), v.to_string());
    }
}

fn expect_check_error(path: &Path, needles: &[&str]) {
    expect_input_error(&["check", path.to_str().unwrap()], needles);
}

#[test]
fn malformed_traces_are_rejected_with_the_site_and_tensor_named() {
    let mut r = valid_raw();
    r.drop("conv.weight.activations");
    expect_check_error(
        &r.write("missing"),
        &["site `conv.weight`", "`conv.weight.activations` is missing"],
    );

    let mut r = valid_raw();
    let t = r.get("ln.bias.backprops");
    t.shape = vec![3, 2, t.shape[2]];
    expect_check_error(
        &r.write("bt"),
        &["site `ln.bias`", "is 3×2×", "site `emb` has batch 2"],
    );

    let mut r = valid_raw();
    let ids = r.get("emb.ids");
    ids.bytes[0..8].copy_from_slice(&9i64.to_le_bytes());
    expect_check_error(
        &r.write("ids"),
        &["site `emb`", "`emb.ids`[0][0] = 9", "vocab 0..4"],
    );

    let mut r = valid_raw();
    let mut sites = r.sites();
    sites[0]["vocab"] = 7.into();
    sites[0]["name"] = "emb".into();
    r.set_sites(sites);
    expect_check_error(
        &r.write("shapes"),
        &["parameter `tied`", "site `head`", "site `emb`"],
    );

    let mut r = valid_raw();
    let mut sites = r.sites();
    sites[2]["kind"] = "conv2d".into();
    r.set_sites(sites);
    expect_check_error(
        &r.write("kind"),
        &["site `conv.weight`", "unknown kind `conv2d`"],
    );

    let mut r = valid_raw();
    r.meta
        .insert("format".into(), "ghost-oracle-trace/9".into());
    expect_check_error(
        &r.write("version"),
        &["format", "ghost-oracle-trace/9", "ghost-oracle-trace/1"],
    );

    let mut r = valid_raw();
    let t = r.get("head.backprops");
    t.bytes[4..8].copy_from_slice(&f32::NAN.to_le_bytes());
    expect_check_error(&r.write("nan"), &["head.backprops", "non-finite"]);

    let mut r = valid_raw();
    r.drop("claimed.norms");
    expect_check_error(&r.write("noclaim"), &["`claimed.norms` is missing"]);

    let mut r = valid_raw();
    let mut sites = r.sites();
    sites[0]["vocab"] = serde_json::json!(1u64 << 40);
    r.set_sites(sites);
    expect_check_error(&r.write("hugevocab"), &["site `emb`", "vocab"]);

    // A header claiming more data than the file holds.
    let path = r.write("lying");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes.truncate(bytes.len() - 16);
    std::fs::write(&path, bytes).unwrap();
    expect_check_error(&path, &["t.safetensors", "not a valid safetensors file"]);
    expect_check_error(
        &path.with_file_name("absent.safetensors"),
        &["cannot open trace", "absent.safetensors"],
    );
}

/// A family trace's claims replaced by `norms`, written to a temporary file.
fn with_claims(family: &str, norms: &dyn Fn(&[f64]) -> Vec<f64>) -> PathBuf {
    let (trace, mut meta) = read_trace(&family_trace(family)).unwrap();
    meta.claimed_norms = norms(&meta.claimed_norms);
    meta.claimed_coefficients = None;
    let path = tmp(&format!("claims-{family}")).join("t.safetensors");
    write_trace(&path, &trace, &meta).unwrap();
    path
}

fn family_trace(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("oracles/golden/traces/families")
        .join(format!("{name}.safetensors"))
}

/// The families of python/scripts/make_family_traces.py, one trace each.
const FAMILIES: [&str; 13] = [
    "gpt2",
    "gpt_neo",
    "gpt_neox",
    "phi",
    "opt",
    "llama",
    "qwen2",
    "gemma",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "vaultgemma",
    "qwen3_moe",
];

#[test]
fn exported_traces_of_thirteen_model_families_with_exact_norms_pass_check() {
    // Tiny random HF models exported by python/scripts/make_family_traces.py, with torch.func's
    // exact per-example norms as the claim.
    for family in FAMILIES {
        let doc = check_json(&family_trace(family), 0);
        assert_eq!(doc["passed"], true, "{family}");
        assert_eq!(doc["clippers"][0]["verdict"], "pass", "{family}");
    }
    // The same claims without the tied cross term fail: the traces carry it.
    let (rt, meta) = read_trace(&family_trace("gemma")).unwrap();
    let m = rt.materialized_norms().unwrap();
    let dropped: Vec<f64> = m
        .iter()
        .map(|e| {
            let cross: f64 = e.shared_inner.values().map(|x| x[0][1]).sum();
            (e.total_sq - 2.0 * cross).sqrt()
        })
        .collect();
    assert_eq!(dropped.len(), meta.claimed_norms.len());
    let doc = check_json(&with_claims("gemma", &|_| dropped.clone()), 1);
    assert_ne!(doc["clippers"][0]["verdict"], "pass");
}

#[test]
fn a_per_head_norm_is_one_site_whose_rows_are_positions_times_heads_and_counts_in_the_norm() {
    // Qwen3's q/k norms act on B×T×H×head_dim, Gemma 3's on B×H×T×head_dim: one weight over
    // head_dim, shared by every head and position. Each is one site with T·H rows.
    for (family, heads) in [("qwen3", [4, 2]), ("gemma3_text", [2, 1])] {
        let (rt, meta) = read_trace(&family_trace(family)).unwrap();
        let t = rt.sites[0].backprops.dim().1;
        for (norm, h) in [("q_norm", heads[0]), ("k_norm", heads[1])] {
            let name = format!("model.layers.0.self_attn.{norm}.weight");
            let j = rt.sites.iter().position(|s| s.spec.name == name).unwrap();
            let site = &rt.sites[j];
            assert_eq!(site.backprops.dim().1, t * h, "{family} {name}");
            assert_eq!(rt.site_gradient_shape(j), (site.backprops.dim().2, 1));
        }
        // A clipper that leaves the per-head norm out (e.g. one that only reads B×T×features
        // inputs) is caught: its norms lack that site's part.
        let j = rt
            .sites
            .iter()
            .position(|s| s.spec.name == "model.layers.1.self_attn.q_norm.weight")
            .unwrap();
        let m = rt.materialized_norms().unwrap();
        let without: Vec<f64> = (0..meta.claimed_norms.len())
            .map(|i| {
                let g = rt.site_gradient(j, i).unwrap();
                (m[i].total_sq - g.iter().map(|x| x * x).sum::<f64>()).sqrt()
            })
            .collect();
        let doc = check_json(&with_claims(family, &|_| without.clone()), 1);
        assert_ne!(doc["clippers"][0]["verdict"], "pass", "{family}");
    }
}

#[test]
fn a_nan_or_infinite_claimed_norm_is_the_invalid_norm_verdict() {
    for (k, bad) in [f64::NAN, f64::INFINITY].into_iter().enumerate() {
        let path = with_claims("llama", &|n| {
            let mut n = n.to_vec();
            n[1] = bad;
            n
        });
        let doc = check_json(&path, 1);
        let c = &doc["clippers"][0];
        assert_eq!(c["verdict"], "invalid-norm", "case {k}");
        assert_eq!(c["cases"][0]["invalid_examples"], serde_json::json!([1]));
        assert_eq!(c["cases"][0]["worst_example"], 1);
        assert_eq!(c["privacy"]["actual_epsilon"], serde_json::Value::Null);
    }
}

#[test]
fn a_mixed_precision_trace_is_judged_at_its_least_precise_site() {
    let mut r = valid_raw();
    // Re-store one site's backprops in f16: the trace is only f16-accurate.
    let t = r.get("head.backprops");
    let values: Vec<f32> = t
        .bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    t.dtype = safetensors::Dtype::F16;
    t.bytes = values
        .iter()
        .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
        .collect();
    let (_, meta) = read_trace(&r.write("mixed")).unwrap();
    assert_eq!(meta.dtype, Precision::F16);
    let o = run(&["check", r.write("mixed2").to_str().unwrap()]);
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("(f16, trace file)"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
}
