//! A trace's factors held in the precision they are stored in (`read_stored_trace_within`): f32,
//! f16 and bf16 tensors as f32, f64 ones as f64. Each example widened back to f64 is, value for
//! value, the tensor widened whole (`read_trace_within`); and the memory budget counts the
//! factors at their stored width, by a count made here by hand.

use ghost_oracle_reference::{
    read_stored_trace_bytes_within, read_stored_trace_within, read_trace_within, write_trace,
    ConvGeometry, ConvInput, Factors, MemoryBudget, Precision, Site, SiteKind, SiteSpec,
    StoredFactors, Trace, TraceMeta,
};
use ndarray::{s, Array2, Array3};
use std::path::{Path, PathBuf};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "ghost-oracle-trace-stored-{}-{name}",
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

/// Values that differ from tensor to tensor and entry to entry, none exactly representable in
/// bf16 (so a bf16 file rounds them).
fn values(shape: (usize, usize, usize), seed: f64) -> Array3<f64> {
    Array3::from_shape_fn(shape, |(i, r, c)| {
        ((i * 131 + r * 17 + c) as f64 * 0.013 + seed).sin()
    })
}

/// An embedding, a layernorm, a linear layer and a grouped 3×3 convolution stored as its input.
fn trace() -> Trace {
    let (b, t, d, v) = (3, 5, 6, 7);
    let geometry = ConvGeometry {
        kernel: vec![3, 3],
        stride: vec![1, 1],
        dilation: vec![1, 1],
        padding: vec![(1, 1), (1, 1)],
        groups: 2,
        input_size: vec![4, 4],
    };
    Trace {
        sites: vec![
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
                backprops: values((b, t, 2), 0.5),
                conv: None,
            },
            Site {
                spec: spec("conv", "conv.weight", SiteKind::Linear, None),
                activations: None,
                ids: None,
                backprops: values((b, 16, 4), 0.6),
                conv: Some(ConvInput {
                    geometry,
                    inputs: values((b, 4, 16), 0.7),
                }),
            },
        ],
    }
}

fn write(path: &Path, trace: &Trace, dtype: Precision) {
    let b = trace.batch_size();
    write_trace(path, trace, &TraceMeta::norms(1.0, vec![1.0; b], dtype)).unwrap();
}

/// Every factor of `stored` widened an example (and a tile of rows) at a time against `wide`.
#[track_caller]
fn assert_widens_to(stored: &StoredFactors, wide: &Array3<f64>, what: &str) {
    assert_eq!(Factors::dim(stored), wide.dim(), "{what}");
    let (b, r, _) = wide.dim();
    for i in 0..b {
        let got = stored.example(i);
        let want = wide.slice(s![i, .., ..]);
        // Bit for bit (NaN-free values: == on f64 is bitwise here but for ±0, which
        // to_bits tells apart).
        let bits = |a: ndarray::ArrayView2<f64>| a.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(got.view()), bits(want), "{what}: example {i}");
        let tile = stored.example_rows(i, 1..r);
        assert_eq!(
            bits(tile.view()),
            bits(wide.slice(s![i, 1..r, ..])),
            "{what}: example {i}, rows 1.."
        );
    }
}

#[test]
fn narrow_factors_are_held_as_f32_and_widen_to_the_f64_reading_bit_for_bit() {
    let t = trace();
    for dtype in [
        Precision::F32,
        Precision::F16,
        Precision::BF16,
        Precision::F64,
    ] {
        let path = tmp(dtype.name());
        write(&path, &t, dtype);
        let budget = MemoryBudget::bytes(1 << 30);
        let (stored, stored_meta) = read_stored_trace_within(&path, budget).unwrap();
        let (wide, wide_meta) = read_trace_within(&path, budget).unwrap();
        assert_eq!(stored_meta, wide_meta, "{dtype:?}");
        for (a, w) in stored.sites.iter().zip(&wide.sites) {
            let n = format!("{dtype:?} {}", a.spec.name);
            let held_as = |f: &StoredFactors| match f {
                StoredFactors::F32(_) => Precision::F32,
                StoredFactors::F64(_) => Precision::F64,
            };
            let want = if dtype == Precision::F64 {
                Precision::F64
            } else {
                Precision::F32
            };
            assert_eq!(held_as(&a.backprops), want, "{n}");
            assert_widens_to(&a.backprops, &w.backprops, &format!("{n}.backprops"));
            if let (Some(x), Some(y)) = (&a.activations, &w.activations) {
                assert_eq!(held_as(x), want, "{n}");
                assert_widens_to(x, y, &format!("{n}.activations"));
            }
            assert_eq!(a.activations.is_some(), w.activations.is_some(), "{n}");
            if let (Some(x), Some(y)) = (&a.conv, &w.conv) {
                assert_eq!(x.geometry, y.geometry, "{n}");
                assert_widens_to(&x.inputs, &y.inputs, &format!("{n}.inputs"));
                // and the unfolded patches and padded grids built from them.
                for i in 0..t.batch_size() {
                    assert_eq!(x.unfold(i), y.unfold(i), "{n}: example {i}");
                    for j in 0..x.geometry.groups {
                        assert_eq!(x.padded_group(i, j), y.padded_group(i, j), "{n}: {i}, {j}");
                    }
                }
            }
            assert_eq!(a.ids, w.ids, "{n}");
            // The rows every consumer reads.
            for i in 0..t.batch_size() {
                let (ra, rw) = (a.rows(i), w.rows(i));
                assert_eq!(ra.backprops, rw.backprops, "{n}: example {i}");
                assert_eq!(ra.activations, rw.activations, "{n}: example {i}");
            }
        }
        // The brute-force norms of both are the same bits.
        let (ns, nw) = (
            stored.materialized_norms().unwrap(),
            wide.materialized_norms().unwrap(),
        );
        for (i, (x, y)) in ns.iter().zip(&nw).enumerate() {
            assert_eq!(
                x.total_sq.to_bits(),
                y.total_sq.to_bits(),
                "{dtype:?} example {i}"
            );
        }
        // and a bf16 file's values really are rounded (the test reads what the file holds).
        if dtype == Precision::BF16 {
            let w = &wide.sites[1].backprops;
            assert_ne!(w, &t.sites[1].backprops);
            assert_eq!(w, &t.sites[1].backprops.mapv(|x| Precision::BF16.round(x)));
        }
    }
}

/// `k` embeddings of `v`-row tables, B×T×D backprops each.
fn tables(path: &Path, k: usize, (b, t, d, v): (usize, usize, usize, usize), dtype: Precision) {
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
    write(path, &trace, dtype);
}

#[test]
fn the_budget_counts_factors_at_their_stored_width() {
    let (k, b, t, d, v) = (4usize, 4usize, 256usize, 512usize, 10usize);
    for (dtype, width) in [
        (Precision::F32, 4),
        (Precision::BF16, 4),
        (Precision::F64, 8),
    ] {
        let path = tmp(&format!("budget-{}", dtype.name()));
        tables(&path, k, (b, t, d, v), dtype);
        let bytes = std::fs::read(&path).unwrap();
        let (n, _) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        // What the judge holds, by hand: every site's factors at their stored width and its ids
        // in 8 bytes; each thread's one example of the widest site widened to f64 (T·D values);
        // one table's blocks (V rows of D f64 values for each of the B examples, one site's
        // apart, their sum and the step's two targets); the claimed norms as stored (f64).
        let factors = (k * b * t * (d * width + 8)) as u64;
        let threads = rayon::current_num_threads() as u64;
        let widened = threads * (t * d * 8) as u64;
        let one_table = (v * d * 8 * (b + 3)) as u64;
        let claims = (b * 8) as u64;
        // Of the file, mapped: the header, the largest tensor (one table's backprops), and a
        // 64 KiB span at each end of each of its 2k + 1 tensors and one more.
        let largest = (b * t * d * dtype.stored().bitsize() / 8) as u64;
        let spans = (64 << 10) * (2 * (2 * k as u64 + 1) + 1);
        let of_file = 8 + n as u64 + largest + spans;
        assert!(
            of_file < bytes.len() as u64,
            "{dtype:?}: the file is past its spans"
        );
        let needed = of_file + factors + widened + one_table + claims;

        let (trace, _) = read_stored_trace_within(&path, MemoryBudget::bytes(needed)).unwrap();
        assert_eq!(trace.sites.len(), k);
        let held: usize = trace.sites.iter().map(|s| s.backprops.held_bytes()).sum();
        assert_eq!(held, k * b * t * d * width, "{dtype:?}");
        let e = read_stored_trace_within(&path, MemoryBudget::bytes(needed - 1))
            .unwrap_err()
            .to_string();
        assert!(e.contains("the memory budget is"), "{dtype:?}: {e}");
        // The same bytes read whole count the whole file instead of its mapped part.
        let whole = needed - of_file + bytes.len() as u64;
        read_stored_trace_bytes_within(&bytes, "T", MemoryBudget::bytes(whole)).unwrap();
        let e = read_stored_trace_bytes_within(&bytes, "T", MemoryBudget::bytes(whole - 1))
            .unwrap_err()
            .to_string();
        assert!(e.contains("the memory budget is"), "{dtype:?}: {e}");
        // Held as stored, a narrow trace needs less than widened to f64: the f64 reading is
        // refused at the stored budget.
        if width == 4 {
            let e = read_trace_within(&path, MemoryBudget::bytes(needed))
                .unwrap_err()
                .to_string();
            assert!(e.contains("its factors widened to f64"), "{dtype:?}: {e}");
        }
    }
}

#[test]
fn a_non_finite_narrow_factor_is_refused_as_the_f64_reading_refuses_it() {
    let mut t = trace();
    let at = (2, 4, 5);
    t.sites[2].activations.as_mut().unwrap()[at] = f64::INFINITY;
    for dtype in [Precision::F32, Precision::BF16] {
        let path = tmp(&format!("nonfinite-{}", dtype.name()));
        write(&path, &t, dtype);
        let budget = MemoryBudget::bytes(1 << 30);
        let stored = read_stored_trace_within(&path, budget)
            .unwrap_err()
            .to_string();
        let wide = read_trace_within(&path, budget).unwrap_err().to_string();
        assert_eq!(stored, wide, "{dtype:?}");
        // The flat index of (2, 4, 5) in 3×5×6.
        assert!(
            stored.contains("`fc.activations` holds a non-finite value (inf) at flat index 89"),
            "{stored}"
        );
    }
}

#[test]
fn sites_that_read_one_tensor_hold_it_once_as_stored() {
    // A linear layer and its bias share their output's gradient: written once (format /3,
    // `backprops_of`), held once, and read as the f64 reading reads it.
    let bp = values((3, 5, 2), 0.5);
    let mut t = trace();
    t.sites.push(Site {
        spec: spec("fc.bias", "fc.bias", SiteKind::Bias, None),
        activations: None,
        ids: None,
        backprops: bp.clone(),
        conv: None,
    });
    t.sites[2].backprops = bp;
    let path = tmp("shared");
    write(&path, &t, Precision::F32);
    let bytes = std::fs::read(&path).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tensors: Vec<(String, ghost_oracle_reference::RawTensor)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != "fc.bias.backprops")
        .map(|(n, v)| {
            let raw = ghost_oracle_reference::RawTensor {
                dtype: v.dtype(),
                shape: v.shape().to_vec(),
                bytes: v.data().to_vec(),
            };
            (n, raw)
        })
        .collect();
    let mut meta = header.metadata().clone().unwrap();
    let mut sites: serde_json::Value = serde_json::from_str(&meta["sites"]).unwrap();
    let bias = sites
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|s| s["name"] == "fc.bias")
        .unwrap();
    bias["backprops_of"] = serde_json::Value::from("fc");
    meta.insert("sites".into(), sites.to_string());
    meta.insert("format".into(), "ghost-oracle-trace/3".into());
    let shared = tmp("shared-3");
    ghost_oracle_reference::write_raw(&shared, &tensors, Some(meta)).unwrap();

    let budget = MemoryBudget::bytes(1 << 30);
    let (stored, _) = read_stored_trace_within(&shared, budget).unwrap();
    let (wide, _) = read_trace_within(&shared, budget).unwrap();
    let (fc, fc_bias) = (&stored.sites[2], &stored.sites[4]);
    assert_eq!(fc_bias.spec.name, "fc.bias");
    match (&fc.backprops, &fc_bias.backprops) {
        (StoredFactors::F32(a), StoredFactors::F32(b)) => {
            assert!(std::sync::Arc::ptr_eq(a, b), "one tensor, held once")
        }
        other => panic!("f32 factors held as f32, not {other:?}"),
    }
    for (s, w) in stored.sites.iter().zip(&wide.sites) {
        assert_widens_to(&s.backprops, &w.backprops, &s.spec.name);
    }
    assert_eq!(wide.sites[4].backprops, wide.sites[2].backprops);
}
