//! The optional trace header keys `parameters` (the manifest of every trainable parameter) and
//! `compute_dtype` (the precision the model computed in): what they accept, and that every way a
//! manifest can disagree with the sites is an error naming the parameter; and the shape rule
//! every trace is held to, in memory and in a file alike.

use ghost_oracle_reference::{
    read_trace, read_trace_bytes, validate_shapes, write_raw, write_trace, Precision, RawTensor,
    Site, SiteKind, SiteSpec, Trace, TraceMeta,
};
use ndarray::{Array2, Array3};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

const B: usize = 2;
const T: usize = 3;
const V: usize = 5;
const D: usize = 4;

fn filled(shape: (usize, usize, usize), seed: f64) -> Array3<f64> {
    Array3::from_shape_fn(shape, |(b, t, k)| {
        ((b * 31 + t * 7 + k) as f64 * 0.37 + seed).sin()
    })
}

fn site(
    name: &str,
    param: &str,
    kind: SiteKind,
    vocab: Option<usize>,
    act: Option<usize>,
    out: usize,
) -> Site {
    Site {
        spec: SiteSpec {
            name: name.into(),
            param: param.into(),
            kind,
            vocab,
        },
        activations: act.map(|w| filled((B, T, w), 0.5)),
        ids: (kind == SiteKind::Embedding)
            .then(|| Array2::from_shape_fn((B, T), |(b, t)| ((b + 2 * t) % V) as i64)),
        backprops: filled((B, T, out), 1.5),
        conv: None,
    }
}

/// A tied embedding + head (one parameter, two sites), a linear layer with a bias and an RMSNorm
/// weight (kind `layernorm`).
fn trace() -> Trace {
    Trace {
        sites: vec![
            site("wte", "wte.weight", SiteKind::Embedding, Some(V), None, D),
            site(
                "norm.weight",
                "norm.weight",
                SiteKind::LayerNorm,
                None,
                Some(D),
                D,
            ),
            site("fc.weight", "fc.weight", SiteKind::Linear, None, Some(D), 3),
            site("fc.bias", "fc.bias", SiteKind::Bias, None, None, 3),
            site(
                "lm_head.weight",
                "wte.weight",
                SiteKind::Linear,
                None,
                Some(D),
                V,
            ),
        ],
    }
}

fn manifest() -> Value {
    json!({"wte.weight": V * D, "norm.weight": D, "fc.weight": 3 * D, "fc.bias": 3})
}

fn meta(compute_dtype: Option<Precision>) -> TraceMeta {
    TraceMeta {
        clipper: Some("manifest-test".into()),
        compute_dtype,
        ..TraceMeta::norms(1.0, vec![1.0, 2.0], Precision::F64)
    }
}

/// A fresh path per call: tests run in parallel.
fn tmp(name: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let k = NEXT.fetch_add(1, Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!(
        "ghost-oracle-trace-manifest-{}-{name}-{k}",
        std::process::id()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d.join("t.safetensors")
}

/// The valid trace's bytes with its header edited by `edit`.
fn with_header(edit: impl FnOnce(&mut HashMap<String, String>)) -> Vec<u8> {
    let path = tmp("base");
    write_trace(&path, &trace(), &meta(None)).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let mut m = header.metadata().clone().unwrap();
    edit(&mut m);
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tensors: Vec<(String, RawTensor)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            (
                n,
                RawTensor {
                    dtype: v.dtype(),
                    shape: v.shape().to_vec(),
                    bytes: v.data().to_vec(),
                },
            )
        })
        .collect();
    let out = tmp("edited");
    write_raw(&out, &tensors, Some(m)).unwrap();
    std::fs::read(&out).unwrap()
}

fn with_manifest(v: &Value) -> Vec<u8> {
    let text = v.to_string();
    with_header(|m| {
        m.insert("parameters".into(), text);
    })
}

fn expect_error(bytes: &[u8], needles: &[&str]) {
    let err = match read_trace_bytes(bytes, "T.safetensors") {
        Ok(_) => panic!("expected an error mentioning {needles:?}; the trace was accepted"),
        Err(e) => e.message().to_string(),
    };
    assert!(err.starts_with("T.safetensors: "), "{err}");
    for n in needles {
        assert!(err.contains(n), "error {err:?} lacks {n:?}");
    }
}

#[test]
fn a_complete_manifest_is_accepted_and_both_keys_are_optional() {
    let (t, m) = read_trace_bytes(&with_manifest(&manifest()), "T").unwrap();
    assert_eq!(t.sites.len(), 5);
    assert_eq!(m.compute_dtype, None);
    // Neither key: an old trace still reads.
    let (_, m) = read_trace_bytes(&with_header(|_| {}), "T").unwrap();
    assert_eq!(m.compute_dtype, None);
}

#[test]
fn compute_dtype_round_trips_and_unknown_values_are_refused() {
    for d in Precision::ALL {
        let path = tmp(&format!("rt-{d:?}"));
        write_trace(&path, &trace(), &meta(Some(d))).unwrap();
        let (_, back) = read_trace(&path).unwrap();
        assert_eq!(back.compute_dtype, Some(d));
        let sites = trace().sites.len();
        assert_eq!(back.site_dtypes, vec![Precision::F64; sites]);
        assert_eq!(back.site_compute_dtypes, vec![None; sites]);
        assert_eq!(
            TraceMeta {
                site_dtypes: Vec::new(),
                step: None,
                site_compute_dtypes: Vec::new(),
                ..back
            },
            meta(Some(d))
        );
        // Stored as f64 whatever the compute precision.
        assert_eq!(back.dtype, Precision::F64);
    }
    for (text, want) in [("f32", Precision::F32), ("bf16", Precision::BF16)] {
        let bytes = with_header(|m| {
            m.insert("compute_dtype".into(), text.into());
        });
        assert_eq!(
            read_trace_bytes(&bytes, "T").unwrap().1.compute_dtype,
            Some(want)
        );
    }
    for bad in ["F32", "float32", "f128", "i64", ""] {
        let bytes = with_header(|m| {
            m.insert("compute_dtype".into(), bad.into());
        });
        expect_error(
            &bytes,
            &[
                "`__metadata__.compute_dtype`",
                &format!("{bad:?}"),
                "f64, f32, f16, bf16",
            ],
        );
    }
}

#[test]
fn a_listed_parameter_without_a_site_is_an_error_naming_it() {
    let mut m = manifest();
    m["blocks.0.mlp.gate.weight"] = json!(16);
    expect_error(
        &with_manifest(&m),
        &[
            "`__metadata__.parameters`",
            "parameter `blocks.0.mlp.gate.weight`",
            "no site",
        ],
    );
}

#[test]
fn a_site_whose_parameter_is_not_listed_is_an_error_naming_it() {
    let mut m = manifest();
    m.as_object_mut().unwrap().remove("norm.weight");
    expect_error(
        &with_manifest(&m),
        &[
            "site `norm.weight`",
            "parameter `norm.weight`",
            "does not list",
        ],
    );
    // The tied parameter: both of its sites write `wte.weight`.
    let mut m = manifest();
    m.as_object_mut().unwrap().remove("wte.weight");
    expect_error(
        &with_manifest(&m),
        &["parameter `wte.weight`", "does not list"],
    );
    // An empty manifest lists nothing.
    expect_error(&with_manifest(&json!({})), &["does not list"]);
}

#[test]
fn a_gradient_size_that_differs_from_the_listed_count_is_an_error() {
    let mut m = manifest();
    m["fc.weight"] = json!(3 * D + 1);
    expect_error(
        &with_manifest(&m),
        &[
            "site `fc.weight`",
            "3×4 gradient (12 entries)",
            "parameter `fc.weight` with 13 elements",
        ],
    );
    // A tied parameter is checked at every site: the head (V×D) against the listed count too.
    let mut m = manifest();
    m["wte.weight"] = json!(V * D - 1);
    expect_error(
        &with_manifest(&m),
        &["site `wte`", "parameter `wte.weight` with 19 elements"],
    );
    let mut m = manifest();
    m["norm.weight"] = json!(0);
    expect_error(
        &with_manifest(&m),
        &["site `norm.weight`", "4×1", "with 0 elements"],
    );
}

#[test]
fn malformed_manifests_are_refused_with_the_key_named() {
    let cases: Vec<(String, Vec<&str>)> = vec![
        ("not json".into(), vec!["`__metadata__.parameters`"]),
        (
            "[1, 2]".into(),
            vec!["`__metadata__.parameters`", "JSON object"],
        ),
        (
            r#"{"fc.bias": 3, "fc.bias": 3}"#.into(),
            vec!["parameter `fc.bias` is listed twice"],
        ),
        (
            r#"{"fc.bias": -3}"#.into(),
            vec!["parameter `fc.bias`", "integer", "-3"],
        ),
        (
            r#"{"fc.bias": 3.5}"#.into(),
            vec!["parameter `fc.bias`", "integer"],
        ),
        (
            r#"{"fc.bias": "3"}"#.into(),
            vec!["parameter `fc.bias`", "integer"],
        ),
        (
            r#"{"fc.bias": 1e300}"#.into(),
            vec!["parameter `fc.bias`", "integer"],
        ),
        (
            r#"{"fc.bias": 18446744073709551615}"#.into(),
            vec!["parameter `fc.bias`", "integer"],
        ),
        (
            format!("{} trailing", manifest()),
            vec!["`__metadata__.parameters`", "trailing"],
        ),
    ];
    for (text, needles) in cases {
        let bytes = with_header(|m| {
            m.insert("parameters".into(), text.clone());
        });
        expect_error(&bytes, &needles);
    }
}

#[test]
fn an_absurd_manifest_is_refused_at_its_first_unknown_entry() {
    // A million names: refused at the first one no site writes, never held in full.
    let mut text = String::from("{");
    for k in 0..1_000_000 {
        if k > 0 {
            text.push(',');
        }
        text.push_str(&format!("\"p{k}\": 1"));
    }
    text.push('}');
    let bytes = with_header(|m| {
        m.insert("parameters".into(), text);
    });
    expect_error(&bytes, &["parameter `p0`", "no site"]);
}

/// The traces exported from PyTorch models of thirteen families carry both keys, and read.
#[test]
fn family_traces_carry_a_manifest_and_a_compute_dtype() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("golden/traces/families");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("safetensors") {
            continue;
        }
        n += 1;
        let bytes = std::fs::read(&path).unwrap();
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let meta = header.metadata().clone().unwrap();
        let listed: Value = serde_json::from_str(&meta["parameters"]).unwrap();
        let (t, m) = read_trace(&path).unwrap_or_else(|e| panic!("{e}"));
        assert!(m.compute_dtype.is_some(), "{}", path.display());
        let params: std::collections::BTreeSet<&str> =
            t.sites.iter().map(|s| s.spec.param.as_str()).collect();
        assert_eq!(
            params.len(),
            listed.as_object().unwrap().len(),
            "{}",
            path.display()
        );
    }
    assert!(
        n >= 13,
        "{} holds {n} traces; expected 13 families",
        dir.display()
    );
}

#[test]
fn the_shape_rule_names_the_site_and_the_tensor_at_fault_in_memory_and_in_a_file() {
    trace().validate().unwrap();
    let check = |edit: &dyn Fn(&mut Trace), want: &str| {
        let mut t = trace();
        edit(&mut t);
        let err = t.validate().unwrap_err().to_string();
        assert!(err.contains(want), "{err:?} lacks {want:?}");
        let path = tmp("shape");
        write_trace(&path, &t, &meta(None)).unwrap();
        let in_file = read_trace(&path).unwrap_err().to_string();
        assert_eq!(in_file, format!("{}: {err}", path.display()));
    };
    check(
        &|t| t.sites[1].activations = None,
        "site `norm.weight` (layernorm): tensor `norm.weight.activations` is missing",
    );
    check(
        &|t| t.sites[1].activations = Some(filled((B, T, D + 1), 0.5)),
        "`norm.weight.activations` has width 5 but `norm.weight.backprops` 4",
    );
    check(
        &|t| t.sites[3].backprops = filled((B + 1, T, 3), 0.5),
        "site `fc.bias`: `fc.bias.backprops` is 3×3×3 in batch × rows × features but site `wte` has batch 2",
    );
    check(
        &|t| t.sites[2].backprops = filled((B, T + 1, 3), 0.5),
        "site `fc.weight`: `fc.weight.activations` is 2×3 in batch × rows but `fc.weight.backprops` is 2×4",
    );
    check(
        &|t| t.sites[0].backprops = filled((B, T + 1, D), 0.5),
        "site `wte`: `wte.ids` is 2×3 in batch × rows but `wte.backprops` is 2×4",
    );
    check(
        &|t| t.sites[0].ids.as_mut().unwrap()[(1, 2)] = V as i64,
        "site `wte`: `wte.ids`[1][2] = 5 is outside the table's vocab 0..5",
    );
    check(
        &|t| t.sites[0].ids.as_mut().unwrap()[(0, 1)] = -1,
        "`wte.ids`[0][1] = -1 is outside",
    );
    check(
        &|t| t.sites[4].backprops = filled((B, T, V + 1), 0.5),
        "parameter `wte.weight`: site `lm_head.weight` writes a 6×4 gradient but site `wte` writes 5×4",
    );
    assert_eq!(
        validate_shapes(&[]).unwrap_err().to_string(),
        "trace has no sites"
    );
}
