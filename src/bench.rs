//! Timing of per-example norm computation, and of the whole DP-SGD step (norms, the clipped sum
//! from the factors, noise and the division), from a trace: the tied embedding / LM-head pair at
//! GPT-2 shapes, or any trace file.

use crate::clippers::{Clipper, NoiseSpec};
use crate::error::Result;
use crate::options::ClipNorm;
use crate::trace::Trace;
use candle_core::{DType, Device, Tensor};
use ghost_oracle_reference::{SiteKind, SiteSpec};
use serde::Serialize;
use std::time::Instant;

/// The two sites of a tied GPT-2 head at the given shape, random values (N(0,1) backprops and
/// activations, ids uniform): what dominates every clipper's cost on GPT-2.
pub fn tied_head_trace(
    vocab: usize,
    hidden: usize,
    seq: usize,
    batch: usize,
    dtype: DType,
    device: &Device,
) -> Result<Trace> {
    let randn = |shape: (usize, usize, usize)| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 1.0, shape, device)?.to_dtype(dtype)?)
    };
    let ids = Tensor::rand(0f32, vocab as f32, (batch, seq), device)?
        .floor()?
        .clamp(0f32, (vocab - 1) as f32)?
        .to_dtype(DType::U32)?;
    let spec = |name: &str, kind, vocab| SiteSpec {
        name: name.into(),
        param: "wte.weight".into(),
        kind,
        vocab,
    };
    Ok(Trace {
        sites: vec![
            crate::trace::Site {
                spec: spec("wte.weight", SiteKind::Embedding, Some(vocab)),
                activations: None,
                ids: Some(ids),
                backprops: randn((batch, seq, hidden))?,
            },
            crate::trace::Site {
                spec: spec("lm_head.weight", SiteKind::Linear, None),
                activations: Some(randn((batch, seq, hidden))?),
                ids: None,
                backprops: randn((batch, seq, vocab))?,
            },
        ],
    })
}

/// One clipper's timings on a trace.
#[derive(Clone, Debug, Serialize)]
pub struct BenchResult {
    /// The clipper's name.
    pub clipper: String,
    /// Median wall time of one `norms` call.
    pub seconds: f64,
    /// Timed rounds after the warm-up: the medians are over these.
    pub runs: usize,
    /// Largest extra memory held during a call, as measured by the caller's probe.
    pub peak_bytes: u64,
    /// Median wall time of one `clip` (norms, coefficients and Σ c_i g_i from the factors: the
    /// second pass).
    pub clip_seconds: f64,
    /// Median wall time of one whole `step` (`clip`, then noise N(0, C²) on every entry and the
    /// division by B), and its peak memory.
    pub step_seconds: f64,
    /// Largest extra memory held during a `step`, as measured by the caller's probe.
    pub step_peak_bytes: u64,
}

/// Times `norms` and `step` of every clipper on the trace: one warm-up each, then `runs` rounds
/// in which every clipper runs each once (interleaved, so that drifting machine load hits all
/// alike); the median per clipper. The step clips at the median norm with σ = 1. `peak` resets
/// and reads a peak-memory probe (e.g. a counting allocator).
pub fn bench(
    clippers: &[Box<dyn Clipper>],
    trace: &Trace,
    runs: usize,
    peak: &mut dyn FnMut(bool) -> u64,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<Vec<BenchResult>> {
    let total = clippers.len() * (runs.max(1) + 1);
    let mut done = 0;
    let mut norms = Vec::new();
    for c in clippers {
        norms = c.norms(trace)?.norms;
        done += 1;
        progress(done, total, &format!("{} warm-up", c.name()));
    }
    let mut sorted: Vec<f64> = norms.iter().copied().filter(|n| n.is_finite()).collect();
    sorted.sort_by(f64::total_cmp);
    let c = sorted
        .get(sorted.len() / 2)
        .and_then(|&m| ClipNorm::new(m).ok())
        .unwrap_or(ClipNorm::new(1.0).expect("1 is a valid clipping norm"));
    let noise = NoiseSpec {
        std: c.get(),
        divisor: trace.batch_size() as f64,
        seed: 0xBE4C,
    };
    for cl in clippers {
        cl.step(trace, c, &noise)?;
    }
    let mut times = vec![(Vec::new(), Vec::new(), Vec::new()); clippers.len()];
    let mut peaks = vec![(0, 0); clippers.len()];
    for _ in 0..runs.max(1) {
        for (k, cl) in clippers.iter().enumerate() {
            peak(true);
            let t = Instant::now();
            let r = cl.norms(trace)?;
            times[k].0.push(t.elapsed().as_secs_f64());
            peaks[k].0 = peaks[k].0.max(peak(false));
            drop(r);
            let t = Instant::now();
            let r = cl.clip(trace, c)?;
            times[k].2.push(t.elapsed().as_secs_f64());
            drop(r);
            peak(true);
            let t = Instant::now();
            let r = cl.step(trace, c, &noise)?;
            times[k].1.push(t.elapsed().as_secs_f64());
            peaks[k].1 = peaks[k].1.max(peak(false));
            drop(r);
            done += 1;
            progress(done, total, &cl.name());
        }
    }
    let median = |mut t: Vec<f64>| {
        t.sort_by(|a, b| a.total_cmp(b));
        t[t.len() / 2]
    };
    Ok(clippers
        .iter()
        .zip(times)
        .zip(peaks)
        .map(
            |((cl, (norm_t, step_t, clip_t)), (peak_bytes, step_peak_bytes))| BenchResult {
                clipper: cl.name(),
                runs: norm_t.len(),
                seconds: median(norm_t),
                peak_bytes,
                clip_seconds: median(clip_t),
                step_seconds: median(step_t),
                step_peak_bytes,
            },
        )
        .collect())
}

/// Median wall time of the non-private gradient Σ_i g_i from the same factors (all coefficients
/// 1): what one ordinary backward pass spends on the weight gradients, the yardstick for the
/// step's second pass.
pub fn plain_gradient_seconds(trace: &Trace, runs: usize) -> Result<f64> {
    let ones = vec![1.0; trace.batch_size()];
    crate::clippers::clipped_sum(trace, &ones)?;
    let mut t: Vec<f64> = (0..runs.max(1))
        .map(|_| {
            let start = Instant::now();
            crate::clippers::clipped_sum(trace, &ones).map(|s| {
                drop(s);
                start.elapsed().as_secs_f64()
            })
        })
        .collect::<Result<_>>()?;
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}
