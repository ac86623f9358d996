//! What a trace may make the reader hold is bounded by a memory budget, checked before anything is
//! held: a header that lies (a few kilobytes claiming a table of 16.7 M rows) is refused naming
//! the parameter, and a file larger than the budget is refused before it is read. The allocator
//! of this test binary counts bytes, so "before" is measured, not assumed.

use ghost_oracle_reference::{
    read_trace_bytes_within, read_trace_within, write_raw, write_trace, MemoryBudget, Precision,
    RawTensor, Site, SiteKind, SiteSpec, Trace, TraceMeta,
};
use ndarray::{Array2, Array3};
use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Counts the bytes live and the peak since the last reset.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
/// The tests of this file measure one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
            PEAK.fetch_max(now, Ordering::SeqCst);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        System.dealloc(p, layout);
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
    }
}

#[global_allocator]
static A: Counting = Counting;

/// Bytes allocated above what was live when `f` started, at its peak.
fn peak_during<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let base = LIVE.load(Ordering::SeqCst);
    PEAK.store(base, Ordering::SeqCst);
    let r = f();
    (r, PEAK.load(Ordering::SeqCst) - base)
}

const B: usize = 2;
const T: usize = 3;
const D: usize = 64;
const V: usize = 10;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "ghost-oracle-trace-budget-{}-{name}",
        std::process::id()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d.join("t.safetensors")
}

/// An embedding of a V-row table, written honestly.
fn honest(path: &Path) {
    honest_tables(path, 1);
}

/// `k` embeddings of V-row tables (`wte`, `wte1`, ...), each its own parameter, written honestly.
fn honest_tables(path: &Path, k: usize) {
    let trace = Trace {
        sites: (0..k)
            .map(|i| {
                let name = if i == 0 {
                    "wte".to_string()
                } else {
                    format!("wte{i}")
                };
                Site {
                    spec: SiteSpec {
                        name: name.clone(),
                        param: format!("{name}.weight"),
                        kind: SiteKind::Embedding,
                        vocab: Some(V),
                    },
                    activations: None,
                    ids: Some(Array2::from_shape_fn((B, T), |(b, t)| {
                        ((b + t + i) % V) as i64
                    })),
                    backprops: Array3::from_shape_fn((B, T, D), |(b, t, c)| {
                        ((b * 7 + t * 3 + c + i) as f64).sin()
                    }),
                    conv: None,
                }
            })
            .collect(),
    };
    let meta = TraceMeta::norms(1.0, vec![1.0; B], Precision::F32);
    write_trace(path, &trace, &meta).unwrap();
}

/// The honest trace's bytes with its header claiming a table of `vocab` rows.
fn lying(vocab: usize) -> Vec<u8> {
    let path = tmp("honest");
    honest(&path);
    let bytes = std::fs::read(&path).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let mut m = header.metadata().clone().unwrap();
    let mut sites: serde_json::Value = serde_json::from_str(&m["sites"]).unwrap();
    sites[0]["vocab"] = serde_json::json!(vocab);
    m.insert("sites".into(), sites.to_string());
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tensors: Vec<(String, RawTensor)> = st
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
    let out = tmp("lying");
    write_raw(&out, &tensors, Some(m)).unwrap();
    std::fs::read(&out).unwrap()
}

#[test]
fn a_header_claiming_a_huge_table_in_a_small_file_is_refused_before_anything_is_held() {
    let _serial = SERIAL.lock().unwrap();
    // 2²⁴ rows × 64 columns: 8 GiB of gradient per example, in a file of a few kilobytes.
    let bytes = lying(1 << 24);
    assert!(bytes.len() < 8 << 10, "{} bytes", bytes.len());
    let budget = MemoryBudget::bytes(100 << 20);
    let (r, peak) = peak_during(|| read_trace_bytes_within(&bytes, "L.safetensors", budget));
    let e = r.expect_err("a 100 MiB budget cannot stream 2^24-row blocks of a batch of 2");
    let msg = e.to_string();
    for needle in [
        "L.safetensors",
        "parameter `wte.weight` (16777216×64)",
        "the memory budget is 100.00 MiB (--max-memory",
    ] {
        assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
    }
    assert!(peak < 1 << 20, "refusing took {peak} bytes");
    // The same lie within a budget that covers the blocks reads (the judge streams the table).
    let (r, peak) = peak_during(|| {
        read_trace_bytes_within(&bytes, "L.safetensors", MemoryBudget::bytes(1 << 30))
    });
    let (trace, _) = r.unwrap();
    assert_eq!(trace.sites[0].spec.vocab, Some(1 << 24));
    assert!(peak < 1 << 20, "reading took {peak} bytes");
}

#[test]
fn every_factor_widened_to_f64_counts_against_the_budget() {
    let _serial = SERIAL.lock().unwrap();
    let path = tmp("honest-widened");
    honest(&path);
    let bytes = std::fs::read(&path).unwrap();
    // The file fits; its f32 factors widened (B·T·D·8 = 3 KiB) and the ids do not.
    let budget = MemoryBudget::bytes(bytes.len() as u64 + 1024);
    let e = read_trace_bytes_within(&bytes, "W.safetensors", budget).unwrap_err();
    assert!(
        e.to_string()
            .contains("site `wte` (embedding): its factors widened to f64"),
        "{e}"
    );
    // A budget that covers them reads it.
    read_trace_bytes_within(&bytes, "W.safetensors", MemoryBudget::bytes(1 << 30)).unwrap();
}

#[test]
fn a_file_larger_than_the_budget_is_refused_before_it_is_read() {
    let _serial = SERIAL.lock().unwrap();
    let path = tmp("big");
    honest(&path);
    let len = std::fs::metadata(&path).unwrap().len();
    let (r, peak) = peak_during(|| read_trace_within(&path, MemoryBudget::bytes(len / 2)));
    let msg = r.unwrap_err().to_string();
    assert!(
        msg.contains(&path.display().to_string())
            && msg.contains("the file (held while it is read)"),
        "{msg}"
    );
    assert!(
        (peak as u64) < len,
        "refusing took {peak} bytes of a {len}-byte file"
    );
}

#[test]
fn the_judge_streams_one_parameter_at_a_time_so_only_the_largest_ones_blocks_count() {
    let _serial = SERIAL.lock().unwrap();
    let k = 8;
    let path = tmp("tables");
    honest_tables(&path, k);
    let bytes = std::fs::read(&path).unwrap();
    // What the judge holds, by hand: the file, every site's f32 factors widened to f64 and its
    // ids (B·T·(D + 1) values of 8 bytes each), and one table's blocks: V rows of D f64 values
    // for each of the B examples, one site's apart, their sum and the step's two targets.
    let factors = (k * B * T * (D + 1) * 8) as u64;
    let one_table = (V * D * 8 * (B + 3)) as u64;
    let needed = bytes.len() as u64 + factors + one_table;
    // Every table's blocks together would be 7 tables more than this budget allows.
    let budget = needed + one_table / 2;
    assert!(needed + (k as u64 - 1) * one_table > budget);
    let (trace, _) =
        read_trace_bytes_within(&bytes, "K.safetensors", MemoryBudget::bytes(budget)).unwrap();
    assert_eq!(trace.sites.len(), k);
    // and the largest table's blocks still count: a budget one byte short of them refuses
    let e = read_trace_bytes_within(&bytes, "K.safetensors", MemoryBudget::bytes(needed - 1))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("the blocks of its per-example gradients judged at a time"),
        "{e}"
    );
}
