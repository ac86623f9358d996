//! `bench`: clipper time and peak memory on a random tied LM head or a trace file.

use super::{out, to_json, write_file, DeviceArg, PrecisionArg, Progress};
use ghost_oracle::bench::{bench as bench_clippers, plain_gradient_seconds, tied_head_trace};
use ghost_oracle::trace::candle_dtype;
use ghost_oracle::{registry, Error, Precision, Trace};
use ghost_oracle_reference as reference;
use std::fmt::Write;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Vocabulary size V of the random tied head.
    #[arg(long, default_value_t = 50257)]
    vocab: usize,
    /// Hidden width d of the random tied head.
    #[arg(long, default_value_t = 768)]
    hidden: usize,
    /// Sequence length T.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// Batch size B.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Clipper to time (repeatable). Default: ghost, ghost-tied, materialize.
    #[arg(long = "clipper")]
    clippers: Vec<String>,
    /// Time on this trace file instead of a random tied head of the given shape.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Timed runs per clipper after one warm-up (the median is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Precision the clippers compute in.
    #[arg(long, value_enum, default_value = "f32")]
    dtype: PrecisionArg,
    /// Device the clippers run on (cuda needs a build with `--features cuda`).
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceArg,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Peak-memory measurement for `bench`: every allocation of the process is counted.
mod alloc {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

    pub struct Counting;
    static CURRENT: AtomicU64 = AtomicU64::new(0);
    static PEAK: AtomicU64 = AtomicU64::new(0);
    static BASE: AtomicU64 = AtomicU64::new(0);

    fn grow(n: usize) {
        let now = CURRENT.fetch_add(n as u64, Relaxed) + n as u64;
        PEAK.fetch_max(now, Relaxed);
    }

    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, l: Layout) -> *mut u8 {
            let p = unsafe { System.alloc(l) };
            if !p.is_null() {
                grow(l.size());
            }
            p
        }
        unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
            let p = unsafe { System.alloc_zeroed(l) };
            if !p.is_null() {
                grow(l.size());
            }
            p
        }
        unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
            unsafe { System.dealloc(p, l) };
            CURRENT.fetch_sub(l.size() as u64, Relaxed);
        }
        unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
            let q = unsafe { System.realloc(p, l, new) };
            if !q.is_null() {
                CURRENT.fetch_sub(l.size() as u64, Relaxed);
                grow(new);
            }
            q
        }
    }

    /// `reset = true`: start a measurement now; `false`: bytes above the start's level at peak.
    pub fn peak_probe(reset: bool) -> u64 {
        if reset {
            let now = CURRENT.load(Relaxed);
            BASE.store(now, Relaxed);
            PEAK.store(now, Relaxed);
            0
        } else {
            PEAK.load(Relaxed).saturating_sub(BASE.load(Relaxed))
        }
    }
}

#[global_allocator]
static ALLOCATOR: alloc::Counting = alloc::Counting;

pub fn run(a: Args) -> Result<ExitCode, Error> {
    for (flag, v) in [
        ("--vocab", a.vocab),
        ("--hidden", a.hidden),
        ("--seq", a.seq),
        ("--batch", a.batch),
        ("--runs", a.runs),
    ] {
        if v == 0 {
            return Err(Error::input(format!("{flag} must be at least 1")));
        }
    }
    // The fast clippers first: materializing is the slow baseline they are compared with.
    let names = if a.clippers.is_empty() {
        ["ghost", "ghost-tied", "materialize"]
            .map(String::from)
            .to_vec()
    } else {
        a.clippers.clone()
    };
    let clippers = registry::clippers(&names).map_err(|e| e.context("--clipper"))?;
    let device = a.device.device()?;
    let precision = Precision::from(a.dtype);
    let dtype = candle_dtype(precision);
    let (t, shape) = match &a.trace {
        Some(path) => {
            let (rt, _) = reference::read_trace(path)?;
            let t = Trace::from_reference(&rt, dtype, &device)?;
            (t, format!("trace {}", path.display()))
        }
        None => (
            tied_head_trace(a.vocab, a.hidden, a.seq, a.batch, dtype, &device)?,
            format!(
                "tied head V={} d={} T={} B={}",
                a.vocab, a.hidden, a.seq, a.batch
            ),
        ),
    };
    out(&format!(
        "{shape}, {}, {} timed runs after a warm-up; the step clips at the median norm, σ = 1\n{:<14} {:>12} {:>14} {:>12} {:>12} {:>14} {:>11}\n",
        precision.name(),
        a.runs,
        "clipper",
        "norms s",
        "norms MiB",
        "clip s",
        "step s",
        "step MiB",
        "step/norms"
    ))?;
    let progress = Progress::new();
    let results = bench_clippers(
        &clippers,
        &t,
        a.runs,
        &mut alloc::peak_probe,
        &mut |d, n, l| progress.update(d, n, l),
    )?;
    let mut s = String::new();
    for r in &results {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        let _ = writeln!(
            s,
            "{:<14} {:>12.4} {:>14.1} {:>12.4} {:>12.4} {:>14.1} {:>11.3}",
            r.clipper,
            r.seconds,
            mib(r.peak_bytes),
            r.clip_seconds,
            r.step_seconds,
            mib(r.step_peak_bytes),
            r.step_seconds / r.seconds
        );
    }
    let find = |n: &str| results.iter().find(|r| r.clipper == n);
    if let (Some(g), Some(gt)) = (find("ghost"), find("ghost-tied")) {
        let _ = writeln!(
            s,
            "ghost-tied / ghost: time {:.3}, peak memory {:.3}",
            gt.seconds / g.seconds,
            gt.peak_bytes as f64 / g.peak_bytes as f64
        );
    }
    let plain = plain_gradient_seconds(&t, a.runs)?;
    let _ = writeln!(
        s,
        "plain gradient Σ g_i from the same factors (an ordinary backward's weight gradients): {plain:.4} s"
    );
    if let Some(gt) = find("ghost-tied") {
        let _ = writeln!(
            s,
            "ghost-tied whole step / plain gradient: time {:.3}",
            gt.step_seconds / plain
        );
    }
    if let (Some(gt), Some(m)) = (find("ghost-tied"), find("materialize")) {
        let _ = writeln!(
            s,
            "materialize / ghost-tied: time {:.3}, peak memory {:.3}",
            m.seconds / gt.seconds,
            m.peak_bytes as f64 / gt.peak_bytes as f64
        );
    }
    if let Some(path) = &a.json {
        let doc = serde_json::json!({
            "shape": {"vocab": a.vocab, "hidden": a.hidden, "seq": a.seq, "batch": a.batch},
            "dtype": precision.name(),
            "trace": a.trace,
            "results": results,
        });
        write_file(path, &to_json(&doc), "--json")?;
    }
    out(&s)?;
    Ok(ExitCode::SUCCESS)
}
