//! A trace file is mapped, not read whole (`read_trace_within`): each tensor's pages are dropped
//! from the process once it has been widened or copied. What is read that way is the trace the
//! same bytes give read whole (`read_trace_bytes`), for a /1 and a /2 (conv) trace; the memory
//! budget counts the file's largest tensor instead of the whole file, by a count made here by
//! hand; and a malformed file is refused with the message its bytes get.

use ghost_oracle_reference::{
    read_trace, read_trace_bytes, read_trace_bytes_within, read_trace_within, write_trace,
    ConvGeometry, ConvInput, Floats, MemoryBudget, ModelRounding, Precision, Site, SiteKind,
    SiteSpec, StepClaim, Trace, TraceMeta,
};
use ndarray::{Array2, Array3};
use std::path::{Path, PathBuf};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "ghost-oracle-trace-mapped-{}-{name}",
        std::process::id()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d.join("t.safetensors")
}

fn spec(name: &str, param: &str, kind: SiteKind, vocab: Option<usize>) -> SiteSpec {
    SiteSpec {
        name: name.to_string(),
        param: param.to_string(),
        kind,
        vocab,
    }
}

/// Values that differ from tensor to tensor and entry to entry.
fn values(shape: (usize, usize, usize), seed: f64) -> Array3<f64> {
    Array3::from_shape_fn(shape, |(i, r, c)| {
        ((i * 131 + r * 17 + c) as f64 * 0.013 + seed).sin()
    })
}

/// The step's sums for every parameter of `trace`, in the dtype a library would hold them.
fn sums(trace: &Trace, seed: f32) -> Vec<(String, Floats)> {
    trace
        .params()
        .iter()
        .map(|(p, js)| {
            let (rows, cols) = trace.site_gradient_shape(js[0]);
            let v: Vec<f32> = (0..rows * cols)
                .map(|k| (k as f32 * 0.01 + seed).cos())
                .collect();
            (p.clone(), Floats::from(v))
        })
        .collect()
}

/// Claims, coefficients, a step and the model's rounding for a batch of `b`, factors in f32.
fn meta_for(trace: &Trace, b: usize) -> TraceMeta {
    let n = trace.sites.len();
    TraceMeta {
        claimed_coefficients: Some((0..b).map(|i| 0.5 + 0.1 * i as f64).collect()),
        step: Some(StepClaim {
            clipped_sum: Some(sums(trace, 0.3)),
            update: Some(sums(trace, 0.7)),
            batch_divisor: Some(b as f64),
            clip_stabilizer: 1e-6,
            clipping: ghost_oracle_reference::Clipping::Flat,
        }),
        model_rounding: Some(ModelRounding {
            method: "replay-float64".into(),
            per_example: (0..b).map(|i| 1e-9 * (i + 1) as f64).collect(),
        }),
        site_dtypes: vec![Precision::F32; n],
        site_compute_dtypes: vec![None; n],
        ..TraceMeta::norms(
            1.0,
            (0..b).map(|i| 1.0 + i as f64).collect(),
            Precision::F32,
        )
    }
}

/// A /1 trace: an embedding tied with a linear head, a layernorm and a linear layer, each
/// factor a few hundred KiB (past the 64 KiB spans a release works in).
fn format_1() -> (Trace, TraceMeta) {
    let (b, t, d, v) = (4, 64, 256, 11);
    let sites = vec![
        Site {
            spec: spec("wte", "wte.weight", SiteKind::Embedding, Some(v)),
            activations: None,
            ids: Some(Array2::from_shape_fn((b, t), |(i, k)| {
                ((i * 5 + k * 3) % v) as i64
            })),
            backprops: values((b, t, d), 0.1),
            conv: None,
        },
        Site {
            spec: spec("ln", "ln.weight", SiteKind::LayerNorm, None),
            activations: Some(values((b, t, d), 0.2)),
            ids: None,
            backprops: values((b, t, d), 0.3),
            conv: None,
        },
        Site {
            spec: spec("fc", "fc.weight", SiteKind::Linear, None),
            activations: Some(values((b, t, d), 0.4)),
            ids: None,
            backprops: values((b, t, 64), 0.5),
            conv: None,
        },
        Site {
            spec: spec("head", "wte.weight", SiteKind::Linear, None),
            activations: Some(values((b, t, d), 0.6)),
            ids: None,
            backprops: values((b, t, v), 0.7),
            conv: None,
        },
    ];
    let trace = Trace { sites };
    let meta = meta_for(&trace, b);
    (trace, meta)
}

/// A /2 trace: a 3×3 convolution over 16 channels at 32×32 stored as its input, padding 1,
/// and a linear layer after it.
fn format_2() -> (Trace, TraceMeta) {
    let (b, c_in, c_out, side) = (4, 16, 8, 32);
    let geometry = ConvGeometry {
        kernel: vec![3, 3],
        stride: vec![1, 1],
        dilation: vec![1, 1],
        padding: vec![(1, 1), (1, 1)],
        groups: 1,
        input_size: vec![side, side],
    };
    let sites = vec![
        Site {
            spec: spec("conv", "conv.weight", SiteKind::Linear, None),
            activations: None,
            ids: None,
            backprops: values((b, side * side, c_out), 0.8),
            conv: Some(ConvInput {
                geometry,
                inputs: values((b, c_in, side * side), 0.9),
            }),
        },
        Site {
            spec: spec("fc", "fc.weight", SiteKind::Linear, None),
            activations: Some(values((b, 1, 512), 1.0)),
            ids: None,
            backprops: values((b, 1, 10), 1.1),
            conv: None,
        },
    ];
    let trace = Trace { sites };
    let meta = meta_for(&trace, b);
    (trace, meta)
}

fn format_of(bytes: &[u8]) -> String {
    let (_, header) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
    header.metadata().as_ref().unwrap()["format"].clone()
}

#[track_caller]
fn assert_same(mapped: &(Trace, TraceMeta), whole: &(Trace, TraceMeta), what: &str) {
    assert_eq!(mapped.1, whole.1, "{what}: meta");
    assert_eq!(mapped.0.sites.len(), whole.0.sites.len(), "{what}");
    for (a, b) in mapped.0.sites.iter().zip(&whole.0.sites) {
        let n = &a.spec.name;
        assert_eq!(a.spec, b.spec, "{what}: {n}");
        assert_eq!(a.activations, b.activations, "{what}: {n}");
        assert_eq!(a.ids, b.ids, "{what}: {n}");
        assert_eq!(a.backprops, b.backprops, "{what}: {n}");
        assert_eq!(
            a.conv.as_ref().map(|c| (&c.geometry, &c.inputs)),
            b.conv.as_ref().map(|c| (&c.geometry, &c.inputs)),
            "{what}: {n}"
        );
    }
}

#[test]
fn a_mapped_trace_reads_as_its_bytes_read_whole_in_format_1_and_2() {
    for (what, (trace, meta), format) in [
        ("format 1", format_1(), "ghost-oracle-trace/1"),
        ("format 2 (conv)", format_2(), "ghost-oracle-trace/2"),
    ] {
        let path = tmp(&what.replace(' ', "-"));
        write_trace(&path, &trace, &meta).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(format_of(&bytes), format, "{what}");
        let label = path.display().to_string();
        let whole = read_trace_bytes(&bytes, &label).unwrap();
        let mapped = read_trace(&path).unwrap();
        assert_same(&mapped, &whole, what);
        // and both are what was written (f32 factors round each value once).
        assert_eq!(mapped.1, meta, "{what}");
        for (got, want) in mapped.0.sites.iter().zip(&trace.sites) {
            let rounded = want.backprops.mapv(|x| Precision::F32.round(x));
            assert_eq!(got.backprops, rounded, "{what}: {}", want.spec.name);
        }
        // Reading it twice through the mapping (its pages released the first time) gives the
        // same again.
        assert_same(&read_trace(&path).unwrap(), &whole, what);
    }
}

/// `k` embeddings of `v`-row tables, B×T×D f32 backprops each: a file of k·(B·T·D·4) bytes
/// and some, whose largest tensor is one table's backprops.
fn tables(path: &Path, k: usize, (b, t, d, v): (usize, usize, usize, usize)) {
    let trace = Trace {
        sites: (0..k)
            .map(|j| Site {
                spec: spec(
                    &format!("wte{j}"),
                    &format!("wte{j}.weight"),
                    SiteKind::Embedding,
                    Some(v),
                ),
                activations: None,
                ids: Some(Array2::from_shape_fn((b, t), |(i, s)| {
                    ((i + s + j) % v) as i64
                })),
                backprops: values((b, t, d), j as f64),
                conv: None,
            })
            .collect(),
    };
    let meta = TraceMeta::norms(1.0, vec![1.0; b], Precision::F32);
    write_trace(path, &trace, &meta).unwrap();
}

#[test]
fn the_budget_counts_the_largest_tensor_of_a_mapped_file_not_the_whole_file() {
    let (k, b, t, d, v) = (4usize, 4usize, 64usize, 512usize, 10usize);
    let path = tmp("budget");
    tables(&path, k, (b, t, d, v));
    let bytes = std::fs::read(&path).unwrap();
    let (n, _) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    // What the judge holds, by hand: every site's factors widened to f64 and its ids
    // (B·T·(D + 1) values of 8 bytes each), one table's blocks (V rows of D f64 values for
    // each of the B examples, one site's apart, their sum and the step's two targets), and the
    // claimed norms as stored.
    let factors = (k * b * t * (d + 1) * 8) as u64;
    let one_table = (v * d * 8 * (b + 3)) as u64;
    let claims = (b * 8) as u64;
    // Of the file, mapped: the header, the largest tensor (one table's f32 backprops), and a
    // 64 KiB span at each end of each of its 2k + 1 tensors (ids, backprops, claimed norms)
    // and one more.
    let largest = (b * t * d * 4) as u64;
    let spans = (64 << 10) * (2 * (2 * k as u64 + 1) + 1);
    let of_file = 8 + n as u64 + largest + spans;
    assert!(
        of_file < bytes.len() as u64,
        "{of_file} of {} bytes",
        bytes.len()
    );
    let needed = of_file + factors + one_table + claims;

    let (trace, _) = read_trace_within(&path, MemoryBudget::bytes(needed)).unwrap();
    assert_eq!(trace.sites.len(), k);
    let e = read_trace_within(&path, MemoryBudget::bytes(needed - 1))
        .unwrap_err()
        .to_string();
    assert!(e.contains("the memory budget is"), "{e}");
    // The same bytes read whole count the whole file: that budget is too small for them.
    let e = read_trace_bytes_within(&bytes, "T", MemoryBudget::bytes(needed))
        .unwrap_err()
        .to_string();
    assert!(e.contains("the memory budget is"), "{e}");
    read_trace_bytes_within(
        &bytes,
        "T",
        MemoryBudget::bytes(needed - of_file + bytes.len() as u64),
    )
    .unwrap();
    // A budget short of the header is refused before the header is parsed, naming it.
    let e = read_trace_within(&path, MemoryBudget::bytes(8 + n as u64 - 1))
        .unwrap_err()
        .to_string();
    assert!(e.contains("the file's header (parsed before"), "{e}");
    // A budget short of the mapped part alone is refused naming the largest tensor.
    let e = read_trace_within(&path, MemoryBudget::bytes(of_file - 1))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("the file's largest tensor `wte") && e.contains(&format!("({largest} bytes)")),
        "{e}"
    );
}

#[test]
fn a_malformed_file_mapped_is_refused_as_its_bytes_are() {
    let (trace, meta) = format_1();
    let path = tmp("malformed");
    write_trace(&path, &trace, &meta).unwrap();
    let good = std::fs::read(&path).unwrap();
    let label = path.display().to_string();
    let mut header_too_long = good.clone();
    header_too_long[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let mut header_past_end = good.clone();
    header_past_end[..8].copy_from_slice(&(good.len() as u64).to_le_bytes());
    // A NaN in a factor, `fc.backprops`'s first value.
    let mut nan = good.clone();
    let (n, header) = safetensors::SafeTensors::read_metadata(&good).unwrap();
    let at = 8 + n + header.info("fc.backprops").unwrap().data_offsets.0;
    nan[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", Vec::new()),
        ("shorter than its header length", good[..5].to_vec()),
        ("truncated", good[..good.len() - 16].to_vec()),
        ("one byte too long", [good.as_slice(), &[0]].concat()),
        ("header longer than the file", header_too_long),
        ("header runs past the end", header_past_end),
        ("a NaN in a factor", nan),
    ];
    for (what, bytes) in cases {
        std::fs::write(&path, &bytes).unwrap();
        let whole = read_trace_bytes(&bytes, &label).unwrap_err().to_string();
        let mapped = read_trace(&path).unwrap_err().to_string();
        assert_eq!(mapped, whole, "{what}");
        assert!(mapped.contains(&label), "{what}: {mapped}");
    }
    let dir = path.parent().unwrap();
    let e = read_trace(dir).unwrap_err().to_string();
    assert!(e.contains("is not a file"), "{e}");
    let e = read_trace(&dir.join("absent.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot open trace"), "{e}");
}
