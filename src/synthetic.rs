//! Random factored traces with known structure, for property tests, the false-alarm sweep and
//! fuzzing: every site kind, a tied embedding / head pair that can be made to cancel almost
//! exactly, a layer used three times (once on a single pooled row), a layer on more rows than
//! the sequence, repeated ids and a wide dynamic range.

use ghost_oracle_reference::{Site, SiteKind, SiteSpec, SplitMix64, Trace};
use ndarray::{Array2, Array3};

/// The shape of a synthetic trace. Every field is clamped to a sane range when used, so any
/// values (from a fuzzer, say) give a valid trace.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticSpec {
    /// B, the examples.
    pub batch: usize,
    /// T, the tokens per example.
    pub seq: usize,
    /// d, the width of the factors.
    pub width: usize,
    /// V, the rows of the tied table.
    pub vocab: usize,
    /// Ids are drawn from 0..min(id_range, vocab): small means many repeated tokens.
    pub id_range: usize,
    /// 0: the head's gradient is independent of the embedding's; 1: g_out = −g_in + noise·ε.
    pub cancellation: f64,
    /// log10 of the leftover ε when cancelling (e.g. -6).
    pub leftover_log10: f64,
    /// Each site's factors are scaled by 10^U(−range, range).
    pub scale_log10_range: f64,
}

impl SyntheticSpec {
    fn clamped(&self) -> SyntheticSpec {
        SyntheticSpec {
            batch: self.batch.clamp(1, 6),
            seq: self.seq.clamp(1, 16),
            width: self.width.clamp(1, 12),
            vocab: self.vocab.clamp(1, 24),
            id_range: self.id_range.clamp(1, 24),
            cancellation: if self.cancellation.is_finite() {
                self.cancellation.clamp(0.0, 1.0)
            } else {
                0.0
            },
            leftover_log10: if self.leftover_log10.is_finite() {
                self.leftover_log10.clamp(-8.0, 0.0)
            } else {
                -3.0
            },
            scale_log10_range: if self.scale_log10_range.is_finite() {
                self.scale_log10_range.clamp(0.0, 3.0)
            } else {
                0.0
            },
        }
    }
}

fn dense(rng: &mut SplitMix64, b: usize, t: usize, m: usize, scale: f64) -> Array3<f64> {
    Array3::from_shape_fn((b, t, m), |_| scale * rng.normal())
}

fn site(name: &str, param: &str, kind: SiteKind, vocab: Option<usize>) -> SiteSpec {
    SiteSpec {
        name: name.into(),
        param: param.into(),
        kind,
        vocab,
    }
}

/// A trace with sites: a tied embedding + linear head, a conv1d with its bias, a layernorm with
/// its bias, one linear layer used twice on T rows and once on one pooled row, and a linear layer
/// with its bias on 2T + 1 rows (a convolution's output positions).
pub fn synthetic_trace(spec: &SyntheticSpec, seed: u64) -> Trace {
    let s = spec.clamped();
    let mut rng = SplitMix64::new(seed);
    let (b, t, d, v) = (s.batch, s.seq, s.width, s.vocab);
    let scale =
        |rng: &mut SplitMix64| 10f64.powf(s.scale_log10_range * (2.0 * rng.uniform() - 1.0));
    let ids = Array2::from_shape_fn((b, t), |_| rng.below(s.id_range.min(v)) as i64);

    // Tied pair: G_in = Σ onehot(x_t) e_tᵀ; G_out = Σ δ_s h_sᵀ with h = e and
    // δ_s = −c·onehot(x_s) + (1 − c + ε)·noise, so that c = 1 leaves only ε·noise.
    let se = scale(&mut rng);
    let e = dense(&mut rng, b, t, d, se);
    let eps = 10f64.powf(s.leftover_log10);
    let mix = 1.0 - s.cancellation + eps;
    let mut delta = dense(&mut rng, b, t, v, mix);
    for i in 0..b {
        for tt in 0..t {
            delta[(i, tt, ids[(i, tt)] as usize)] -= s.cancellation;
        }
    }
    let mut sites = vec![
        Site {
            spec: site("emb", "tied", SiteKind::Embedding, Some(v)),
            activations: None,
            ids: Some(ids),
            backprops: e.clone(),
            conv: None,
        },
        Site {
            spec: site("head", "tied", SiteKind::Linear, None),
            activations: Some(e),
            ids: None,
            backprops: delta,
            conv: None,
        },
    ];
    let (p, q) = (d, (d + 3) % 12 + 1);
    let (sa, sb) = (scale(&mut rng), scale(&mut rng));
    let conv_bp = dense(&mut rng, b, t, q, sb);
    sites.push(Site {
        spec: site("conv.weight", "conv.weight", SiteKind::Conv1d, None),
        activations: Some(dense(&mut rng, b, t, p, sa)),
        ids: None,
        backprops: conv_bp.clone(),
        conv: None,
    });
    sites.push(Site {
        spec: site("conv.bias", "conv.bias", SiteKind::Bias, None),
        activations: None,
        ids: None,
        backprops: conv_bp,
        conv: None,
    });
    let sl = scale(&mut rng);
    let ln_bp = dense(&mut rng, b, t, d, sl);
    sites.push(Site {
        spec: site("ln.weight", "ln.weight", SiteKind::LayerNorm, None),
        activations: Some(dense(&mut rng, b, t, d, 1.0)),
        ids: None,
        backprops: ln_bp.clone(),
        conv: None,
    });
    sites.push(Site {
        spec: site("ln.bias", "ln.bias", SiteKind::Bias, None),
        activations: None,
        ids: None,
        backprops: ln_bp,
        conv: None,
    });
    for call in 0..2 {
        let (s1, s2) = (scale(&mut rng), scale(&mut rng));
        sites.push(Site {
            spec: site(
                &format!("shared_linear.call{call}"),
                "shared_linear.weight",
                SiteKind::Linear,
                None,
            ),
            activations: Some(dense(&mut rng, b, t, p, s1)),
            ids: None,
            backprops: dense(&mut rng, b, t, q, s2),
            conv: None,
        });
    }
    // Drawn last, so that a seed's T-row sites do not depend on these.
    let (s1, s2) = (scale(&mut rng), scale(&mut rng));
    sites.push(Site {
        spec: site(
            "shared_linear.pooled",
            "shared_linear.weight",
            SiteKind::Linear,
            None,
        ),
        activations: Some(dense(&mut rng, b, 1, p, s1)),
        ids: None,
        backprops: dense(&mut rng, b, 1, q, s2),
        conv: None,
    });
    let patches = 2 * t + 1;
    let (sa, sb) = (scale(&mut rng), scale(&mut rng));
    let patch_bp = dense(&mut rng, b, patches, d, sb);
    sites.push(Site {
        spec: site("patch.weight", "patch.weight", SiteKind::Linear, None),
        activations: Some(dense(&mut rng, b, patches, q, sa)),
        ids: None,
        backprops: patch_bp.clone(),
        conv: None,
    });
    sites.push(Site {
        spec: site("patch.bias", "patch.bias", SiteKind::Bias, None),
        activations: None,
        ids: None,
        backprops: patch_bp,
        conv: None,
    });
    Trace { sites }
}
