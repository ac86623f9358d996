//! A site whose backprops are another site's (`backprops_of`, trace format /3,
//! docs/trace-format.md): a bias reads its weight's output gradient from the one tensor both
//! share. The shared file is the unshared one with each bias's copy left out and the key added,
//! built here by editing the unshared file's header, never by the crate's writer; the two must
//! read to the same trace (the same true norms, to the bit), the shared one smaller by exactly
//! the left-out tensors' bytes; and every malformed `backprops_of` is refused naming the file
//! and the site.

use ghost_oracle_reference::{
    read_trace, read_trace_bytes, write_raw, write_trace, ConvGeometry, ConvInput, Precision,
    RawTensor, Site, SiteKind, SiteSpec, Trace, TraceMeta,
};
use ndarray::{Array2, Array3};
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

const B: usize = 3;
const T: usize = 4;

fn filled(shape: (usize, usize, usize), seed: f64) -> Array3<f64> {
    Array3::from_shape_fn(shape, |(b, t, k)| {
        ((b * 31 + t * 7 + k) as f64 * 0.37 + seed).sin()
    })
}

fn spec(name: &str, kind: SiteKind, vocab: Option<usize>) -> SiteSpec {
    SiteSpec {
        name: name.into(),
        param: name.into(),
        kind,
        vocab,
    }
}

fn plain(name: &str, kind: SiteKind, activations: Option<Array3<f64>>, bp: &Array3<f64>) -> Site {
    Site {
        spec: spec(name, kind, None),
        activations,
        ids: None,
        backprops: bp.clone(),
        conv: None,
    }
}

/// An embedding, a linear layer with its bias, a LayerNorm with its bias and a 2-D convolution
/// stored as its input with its bias: each bias's backprops equal to its weight's, as the
/// layer's one output gradient is.
fn unshared() -> Trace {
    let (d, out) = (5, 6);
    let fc = filled((B, T, out), 0.3);
    let ln = filled((B, T, d), 0.7);
    // 2 → 4 channels, 3×3 kernel, padding 1 over 4×5: P = 20 positions.
    let geometry = ConvGeometry {
        kernel: vec![3, 3],
        stride: vec![1, 1],
        dilation: vec![1, 1],
        padding: vec![(1, 1), (1, 1)],
        groups: 1,
        input_size: vec![4, 5],
    };
    let conv = filled((B, 20, 4), 1.1);
    Trace {
        sites: vec![
            Site {
                spec: spec("wte", SiteKind::Embedding, Some(7)),
                activations: None,
                ids: Some(Array2::from_shape_fn((B, T), |(i, t)| {
                    ((i + 3 * t) % 7) as i64
                })),
                backprops: filled((B, T, d), 0.1),
                conv: None,
            },
            plain(
                "fc.weight",
                SiteKind::Linear,
                Some(filled((B, T, d), 0.2)),
                &fc,
            ),
            plain("fc.bias", SiteKind::Bias, None, &fc),
            plain(
                "ln.weight",
                SiteKind::LayerNorm,
                Some(filled((B, T, d), 0.5)),
                &ln,
            ),
            plain("ln.bias", SiteKind::Bias, None, &ln),
            Site {
                spec: spec("conv.weight", SiteKind::Linear, None),
                activations: None,
                ids: None,
                backprops: conv.clone(),
                conv: Some(ConvInput {
                    geometry,
                    inputs: Array3::from_shape_fn((B, 2, 20), |(i, c, s)| {
                        ((i * 5 + c * 3 + s) as f64 * 0.23).cos()
                    }),
                }),
            },
            plain("conv.bias", SiteKind::Bias, None, &conv),
        ],
    }
}

/// The biases and the weight each reads its backprops from.
const SHARED: [(&str, &str); 3] = [
    ("fc.bias", "fc.weight"),
    ("ln.bias", "ln.weight"),
    ("conv.bias", "conv.weight"),
];

/// A fresh directory's file: each call its own, the tests run in parallel.
fn tmp(name: &str) -> PathBuf {
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    let d = std::env::temp_dir().join(format!(
        "ghost-oracle-trace-shared-{}-{}-{name}",
        std::process::id(),
        CALLS.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d.join("trace.safetensors")
}

/// A trace file taken apart: its header and its tensors as stored.
struct Raw {
    meta: HashMap<String, String>,
    tensors: Vec<(String, RawTensor)>,
}

impl Raw {
    fn of(bytes: &[u8]) -> Self {
        let (_, header) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
        let st = safetensors::SafeTensors::deserialize(bytes).unwrap();
        let tensors = st
            .tensors()
            .into_iter()
            .map(|(n, v)| {
                let raw = RawTensor {
                    dtype: v.dtype(),
                    shape: v.shape().to_vec(),
                    bytes: v.data().to_vec(),
                };
                (n, raw)
            })
            .collect();
        Raw {
            meta: header.metadata().clone().unwrap(),
            tensors,
        }
    }

    /// The unshared trace's file, in `dtype`.
    fn unshared(dtype: Precision) -> (Self, Vec<u8>) {
        let path = tmp(&format!("unshared-{}", dtype.name()));
        let norms = vec![1.0, 2.0, 0.5];
        write_trace(&path, &unshared(), &TraceMeta::norms(1.0, norms, dtype)).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        (Raw::of(&bytes), bytes)
    }

    /// The same trace with every pair of `SHARED` written once: the bias's tensor left out and
    /// `backprops_of` in its entry, format /3.
    fn shared(dtype: Precision) -> Self {
        let (mut raw, _) = Raw::unshared(dtype);
        for (bias, weight) in SHARED {
            raw.tensors
                .retain(|(n, _)| *n != format!("{bias}.backprops"));
            raw.site(bias)["backprops_of"] = Value::from(weight);
        }
        raw.meta
            .insert("format".into(), "ghost-oracle-trace/3".into());
        raw
    }

    fn sites(&self) -> Vec<Value> {
        serde_json::from_str::<Value>(&self.meta["sites"])
            .unwrap()
            .as_array()
            .unwrap()
            .clone()
    }

    /// Edits site `name`'s entry in the header (through a guard that writes it back).
    fn site(&mut self, name: &str) -> SiteEntry<'_> {
        let sites = self.sites();
        let k = sites.iter().position(|s| s["name"] == name).unwrap();
        SiteEntry {
            raw: self,
            k,
            sites,
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let path = tmp("raw");
        write_raw(&path, &self.tensors, Some(self.meta.clone())).unwrap();
        std::fs::read(&path).unwrap()
    }

    fn read(&self) -> ghost_oracle_reference::Result<Trace> {
        read_trace_bytes(&self.bytes(), "t.safetensors").map(|(t, _)| t)
    }
}

struct SiteEntry<'a> {
    raw: &'a mut Raw,
    k: usize,
    sites: Vec<Value>,
}

impl std::ops::Index<&str> for SiteEntry<'_> {
    type Output = Value;
    fn index(&self, key: &str) -> &Value {
        &self.sites[self.k][key]
    }
}

impl std::ops::IndexMut<&str> for SiteEntry<'_> {
    fn index_mut(&mut self, key: &str) -> &mut Value {
        &mut self.sites[self.k][key]
    }
}

impl Drop for SiteEntry<'_> {
    fn drop(&mut self) {
        let text = Value::Array(std::mem::take(&mut self.sites)).to_string();
        self.raw.meta.insert("sites".into(), text);
    }
}

fn format_of(bytes: &[u8]) -> String {
    Raw::of(bytes).meta["format"].clone()
}

/// Two traces read the same: specs, factors, inputs and ids entry for entry, and the
/// reference's true norms bit for bit.
fn assert_same(a: &Trace, b: &Trace, what: &str) {
    assert_eq!(a.sites.len(), b.sites.len(), "{what}");
    for (x, y) in a.sites.iter().zip(&b.sites) {
        let n = &x.spec.name;
        assert_eq!(x.spec, y.spec, "{what}");
        assert_eq!(x.backprops, y.backprops, "{what}: site `{n}`'s backprops");
        assert_eq!(x.activations, y.activations, "{what}: site `{n}`");
        assert_eq!(x.ids, y.ids, "{what}: site `{n}`");
        assert_eq!(
            x.conv.as_ref().map(|c| (&c.geometry, &c.inputs)),
            y.conv.as_ref().map(|c| (&c.geometry, &c.inputs)),
            "{what}: site `{n}`"
        );
    }
    let (na, nb) = (
        a.materialized_norms().unwrap(),
        b.materialized_norms().unwrap(),
    );
    for (i, (x, y)) in na.iter().zip(&nb).enumerate() {
        assert_eq!(
            x.total_sq.to_bits(),
            y.total_sq.to_bits(),
            "{what}: example {i}'s true squared norm"
        );
    }
}

#[test]
fn a_shared_trace_reads_as_its_unshared_twin_and_is_smaller_by_the_shared_tensors() {
    for dtype in [Precision::F64, Precision::F32, Precision::BF16] {
        let what = dtype.name();
        let (unshared_raw, unshared_bytes) = Raw::unshared(dtype);
        assert_eq!(format_of(&unshared_bytes), "ghost-oracle-trace/2", "{what}");
        let shared = Raw::shared(dtype);
        let shared_bytes = shared.bytes();
        let (twin, twin_meta) = read_trace_bytes(&unshared_bytes, "u.safetensors").unwrap();
        let (read, read_meta) = read_trace_bytes(&shared_bytes, "s.safetensors").unwrap();
        assert_same(&read, &twin, what);
        assert_eq!(read_meta, twin_meta, "{what}");
        // The biases' backprops equal their weights' in the trace read, as in the one written.
        let site = |name: &str| read.sites.iter().find(|s| s.spec.name == name).unwrap();
        for (bias, weight) in SHARED {
            assert_eq!(
                site(bias).backprops,
                site(weight).backprops,
                "{what}: {bias}"
            );
        }
        // Mapped from disk (each tensor's pages handed back once read): the same trace.
        let path = tmp(&format!("mapped-{what}"));
        std::fs::write(&path, &shared_bytes).unwrap();
        let (mapped, _) = read_trace(&path).unwrap();
        assert_same(&mapped, &twin, what);
        // Smaller by the three left-out tensors' bytes, less the header's longer text.
        let left_out: usize = unshared_raw
            .tensors
            .iter()
            .filter(|(n, _)| SHARED.iter().any(|(b, _)| *n == format!("{b}.backprops")))
            .map(|(_, t)| t.bytes.len())
            .sum();
        let header = |bytes: &[u8]| 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let data = |bytes: &[u8]| bytes.len() - header(bytes);
        assert_eq!(
            data(&unshared_bytes) - data(&shared_bytes),
            left_out,
            "{what}"
        );
        // B×T×6, B×T×5 and B×20×4 entries.
        let entries = B * T * 6 + B * T * 5 + B * 20 * 4;
        assert_eq!(left_out, entries * dtype.stored().bitsize() / 8, "{what}");
        assert!(shared_bytes.len() < unshared_bytes.len(), "{what}");
    }
}

#[test]
fn old_traces_still_read() {
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("golden/traces");
    let bytes = std::fs::read(golden.join("opacus_per_sample.safetensors")).unwrap();
    assert_eq!(format_of(&bytes), "ghost-oracle-trace/1");
    let (trace, _) = read_trace_bytes(&bytes, "golden").unwrap();
    assert_eq!(trace.sites.len(), 17);
    // A /2 trace written as before: its unshared bytes read (the twin above) and hold the
    // bias's own tensor.
    let (raw, bytes) = Raw::unshared(Precision::F64);
    assert!(raw.tensors.iter().any(|(n, _)| n == "conv.bias.backprops"));
    assert!(!raw.meta["sites"].contains("backprops_of"));
    read_trace_bytes(&bytes, "u").unwrap();
}

#[test]
fn every_malformed_backprops_of_is_refused_naming_the_site() {
    type Spoil = Box<dyn Fn(&mut Raw)>;
    let cases: Vec<(Spoil, &[&str])> = vec![
        (
            Box::new(|r| r.site("fc.bias")["backprops_of"] = Value::from("fc.nothing")),
            &["site `fc.bias`", "names site `fc.nothing`", "does not list"],
        ),
        (
            Box::new(|r| r.site("fc.bias")["backprops_of"] = Value::from("fc.bias")),
            &["site `fc.bias`", "names the site itself"],
        ),
        (
            Box::new(|r| r.site("fc.bias")["backprops_of"] = Value::from(3)),
            &[
                "site `fc.bias`",
                "`backprops_of` must be the name of another site",
            ],
        ),
        (
            // A chain: fc.bias → ln.bias → ln.weight.
            Box::new(|r| r.site("fc.bias")["backprops_of"] = Value::from("ln.bias")),
            &[
                "site `fc.bias`",
                "names site `ln.bias`, which itself carries `backprops_of`",
            ],
        ),
        (
            Box::new(|r| {
                r.meta
                    .insert("format".into(), "ghost-oracle-trace/2".into());
            }),
            &[
                "carries `backprops_of`",
                "only format \"ghost-oracle-trace/3\"",
                "is \"ghost-oracle-trace/2\"",
            ],
        ),
        (
            Box::new(|r| {
                r.meta
                    .insert("format".into(), "ghost-oracle-trace/1".into());
            }),
            &[
                "site `fc.bias` carries `backprops_of`",
                "is \"ghost-oracle-trace/1\"",
            ],
        ),
        (
            Box::new(|r| {
                let (raw, _) = Raw::unshared(Precision::F64);
                let own = raw
                    .tensors
                    .into_iter()
                    .find(|(n, _)| n == "ln.bias.backprops")
                    .unwrap();
                r.tensors.push(own);
            }),
            &[
                "site `ln.bias`",
                "tensor `ln.bias.backprops` is given but the site carries `backprops_of`",
            ],
        ),
        (
            // The referenced site's own tensor gone: the referring site says so first.
            Box::new(|r| r.tensors.retain(|(n, _)| n != "fc.weight.backprops")),
            &[
                "site `fc.weight`",
                "tensor `fc.weight.backprops` is missing",
            ],
        ),
        (
            // A LayerNorm weight of width 5 reading the linear layer's B×T×6 backprops.
            Box::new(|r| {
                r.site("ln.bias")["backprops_of"] = Value::Null;
                let (raw, _) = Raw::unshared(Precision::F64);
                r.tensors.push(
                    raw.tensors
                        .into_iter()
                        .find(|(n, _)| n == "ln.bias.backprops")
                        .unwrap(),
                );
                r.tensors.retain(|(n, _)| n != "ln.weight.backprops");
                r.site("ln.weight")["backprops_of"] = Value::from("fc.weight");
            }),
            &[
                "site `ln.weight`",
                "has width 5",
                "its backprops are tensor `fc.weight.backprops`",
            ],
        ),
    ];
    for (k, (spoil, needles)) in cases.into_iter().enumerate() {
        let mut raw = Raw::shared(Precision::F64);
        spoil(&mut raw);
        let e = raw
            .read()
            .expect_err(&format!("case {k}: {needles:?} read"))
            .to_string();
        for n in needles {
            assert!(e.contains(n), "case {k}: message lacks {n:?}: {e}");
        }
        assert!(e.contains("t.safetensors"), "case {k}: {e}");
    }
}

#[test]
fn a_site_reading_backprops_of_another_row_count_is_refused() {
    // fc.weight's activations are B×T; conv.weight's backprops B×20.
    let mut raw = Raw::shared(Precision::F64);
    raw.tensors.retain(|(n, _)| n != "fc.weight.backprops");
    raw.site("fc.weight")["backprops_of"] = Value::from("conv.weight");
    raw.site("fc.bias")["backprops_of"] = Value::from("conv.weight");
    let e = raw.read().expect_err("read").to_string();
    for n in [
        "t.safetensors",
        "site `fc.weight`",
        "`fc.weight.activations` is 3×4",
        "its backprops are tensor `conv.weight.backprops`",
    ] {
        assert!(e.contains(n), "message lacks {n:?}: {e}");
    }
}
