//! Timing of per-example norm computation from a trace: the tied embedding / LM-head pair at
//! GPT-2 shapes, or any trace file.

use crate::clippers::Clipper;
use crate::error::Result;
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

#[derive(Clone, Debug, Serialize)]
pub struct BenchResult {
    pub clipper: String,
    /// Median wall time of one `norms` call.
    pub seconds: f64,
    pub runs: usize,
    /// Largest extra memory held during a call, as measured by the caller's probe.
    pub peak_bytes: u64,
}

/// Times `norms` of every clipper on the trace: one warm-up each, then `runs` rounds in which
/// every clipper runs once (interleaved, so that drifting machine load hits all alike); the
/// median per clipper. `peak` resets and reads a peak-memory probe (e.g. a counting allocator).
pub fn bench(
    clippers: &[Box<dyn Clipper>],
    trace: &Trace,
    runs: usize,
    peak: &mut dyn FnMut(bool) -> u64,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<Vec<BenchResult>> {
    let total = clippers.len() * (runs.max(1) + 1);
    let mut done = 0;
    for c in clippers {
        c.norms(trace)?;
        done += 1;
        progress(done, total, &format!("{} warm-up", c.name()));
    }
    let mut times = vec![Vec::with_capacity(runs); clippers.len()];
    let mut peaks = vec![0; clippers.len()];
    for _ in 0..runs.max(1) {
        for (k, c) in clippers.iter().enumerate() {
            peak(true);
            let t = Instant::now();
            let r = c.norms(trace)?;
            times[k].push(t.elapsed().as_secs_f64());
            peaks[k] = peaks[k].max(peak(false));
            drop(r);
            done += 1;
            progress(done, total, &c.name());
        }
    }
    Ok(clippers
        .iter()
        .zip(times)
        .zip(peaks)
        .map(|((c, mut t), peak_bytes)| {
            t.sort_by(|a, b| a.total_cmp(b));
            BenchResult {
                clipper: c.name(),
                seconds: t[t.len() / 2],
                runs: t.len(),
                peak_bytes,
            }
        })
        .collect())
}
