//! The Llama-shaped families (HF `LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`,
//! `GemmaForCausalLM`, `Gemma2ForCausalLM`, `Gemma3ForCausalLM`, `VaultGemmaForCausalLM`) on
//! candle: RMSNorm (x̂ ⊙ w, or x̂ ⊙ (1 + w) for Gemma), rotary embeddings in the rotate-half
//! layout (with the config's rope scaling; Gemma 3's windowed layers with their own base), causal
//! attention with grouped-query heads, optional soft-capping and sliding windows, a SwiGLU or
//! GeGLU MLP, no position table. The reference's flavor decides each difference.
//!
//! Sites, in forward order per layer: `input_layernorm` (kind `layernorm`, activations
//! x / rms(x)), q/k/v projections (kind `linear`, `y = W a`: activations a, backprops dL/dy),
//! each followed by its `bias` site when the config gives it one (Qwen2: q/k/v; Llama, Qwen3,
//! Gemma: `attention_bias`; Llama: `mlp_bias`), the per-head `q_norm` / `k_norm` (rows: the T·H
//! position-head pairs), o, Gemma 2/3's `post_attention_layernorm`, the norm before the MLP,
//! gate/up/down, Gemma 2/3's `post_feedforward_layernorm`.

use super::{
    causal_attention, decode, is_half, window_mask, Architecture, Attention, BatchShape, Core,
    ExtraEmbedding, Extracted, Taps,
};
use crate::error::Result;
use crate::trace::SiteKind;
use candle_core::{DType, Device, Tensor, D};
use ghost_oracle_reference::{Batch, Llama, LlamaConfig, NormLayout, Reduction};

/// The Llama-shaped families in candle, from the reference's weights: the trace a real training
/// step would export.
pub struct CandleLlama {
    config: LlamaConfig,
    pub(crate) core: Core,
}

/// Rotary tables for positions 0..T-1, T×head_dim in the rotate-half layout (each angle twice).
pub(crate) struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl CandleLlama {
    /// The reference's weights rounded to `dtype` on `device`.
    pub fn from_reference(model: &Llama, dtype: DType, device: &Device) -> Result<Self> {
        Ok(CandleLlama {
            config: model.config.clone(),
            core: Core::of(model, dtype, device)?,
        })
    }

    /// Runs the batch forward and backward (of the summed per-example losses) and returns the
    /// trace in this model's dtype and device.
    pub fn extract(&self, batch: &Batch, reduction: Reduction) -> Result<Extracted> {
        decode(self, batch, reduction)
    }

    /// RMSNorm `(offset + w) ⊙ x / sqrt(mean(x²) + eps)` over the last axis, tapped as a
    /// `layernorm` site (no bias) with activations x̂ = x / rms(x). A half-precision model
    /// normalizes in f32, as HF's norms do: Llama's rounds x̂ to its dtype before the weight,
    /// Gemma's scales by (1 + w) in f32 and rounds the output.
    fn rms_norm(&self, x: &Tensor, module: &str, taps: &mut Taps) -> Result<Tensor> {
        let dtype = x.dtype();
        let xf = if is_half(dtype) {
            x.to_dtype(DType::F32)?
        } else {
            x.clone()
        };
        let ms = xf.sqr()?.mean_keepdim(D::Minus1)?;
        let xhat_f = xf.broadcast_div(&(ms + self.config.rms_norm_eps)?.sqrt()?)?;
        let xhat = xhat_f.to_dtype(dtype)?;
        let weight = format!("{module}.weight");
        let w = self.core.w(&weight)?;
        let out = if self.config.flavor.is_gemma() {
            xhat_f
                .broadcast_mul(&(w.to_dtype(xhat_f.dtype())? + 1.0)?)?
                .to_dtype(dtype)?
        } else {
            xhat.broadcast_mul(w)?
        };
        taps.tap(out, weight, SiteKind::LayerNorm, &xhat, None)
    }

    /// A per-head RMSNorm of a B×T×(heads·hd) projection: its rows are the T·heads (position,
    /// head) pairs, as the reference lays them out. Returns B×heads×T×hd.
    fn head_norm(
        &self,
        x: &Tensor,
        module: &str,
        shape: &BatchShape,
        heads: usize,
        taps: &mut Taps,
    ) -> Result<Tensor> {
        let hd = self.config.head_dim;
        let rows = x.reshape((shape.b, shape.t * heads, hd))?;
        let y = self.rms_norm(&rows, module, taps)?;
        Self::heads(
            &y.reshape((shape.b, shape.t, heads * hd))?,
            shape,
            heads,
            hd,
        )
    }

    /// `nn.Linear` `y = a Wᵀ (+ b)` (W out×in), tapped as a `linear` site with activations a,
    /// and its bias site when `bias`.
    fn linear(&self, a: &Tensor, module: &str, bias: bool, taps: &mut Taps) -> Result<Tensor> {
        let weight = format!("{module}.weight");
        let mut out = a.broadcast_matmul(&self.core.w(&weight)?.t()?)?;
        let bias = bias.then(|| format!("{module}.bias"));
        if let Some(b) = &bias {
            out = out.broadcast_add(self.core.w(b)?)?;
        }
        taps.tap(out, weight, SiteKind::Linear, a, bias)
    }

    /// `silu(x) = x / (1 + e^(-x))` from primitive ops.
    fn silu(x: &Tensor) -> Result<Tensor> {
        Ok((x / (x.neg()?.exp()? + 1.0)?)?)
    }

    /// Gemma's `gelu_pytorch_tanh`, 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), from primitive
    /// ops.
    fn gelu_tanh(x: &Tensor) -> Result<Tensor> {
        let inner = ((x + (x.powf(3.0)? * 0.044715)?)? * (2.0 / std::f64::consts::PI).sqrt())?;
        Ok(((x * 0.5)? * (inner.tanh()? + 1.0)?)?)
    }

    fn activation(&self, x: &Tensor) -> Result<Tensor> {
        if self.config.flavor.is_gemma() {
            Self::gelu_tanh(x)
        } else {
            Self::silu(x)
        }
    }

    /// B×T×(heads·hd) → B×heads×T×hd.
    fn heads(x: &Tensor, shape: &BatchShape, heads: usize, hd: usize) -> Result<Tensor> {
        Ok(x.reshape((shape.b, shape.t, heads, hd))?
            .transpose(1, 2)?
            .contiguous()?)
    }

    /// Rotates every head (B×H×T×hd): x·cos + rotate_half(x)·sin, rotate_half(x) = (−x₂, x₁).
    fn rotate(x: &Tensor, rope: &Rope) -> Result<Tensor> {
        let half = x.dim(D::Minus1)? / 2;
        let x1 = x.narrow(D::Minus1, 0, half)?;
        let x2 = x.narrow(D::Minus1, half, half)?;
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
        Ok((x.broadcast_mul(&rope.cos)? + rotated.broadcast_mul(&rope.sin)?)?)
    }

    /// Grouped-query attention: key/value head j serves query heads j·g .. j·g + g − 1 (HF's
    /// `repeat_kv`). B×kv×T×hd → B×(kv·g)×T×hd; the backward sums over the group.
    fn repeat_kv(x: &Tensor, group: usize) -> Result<Tensor> {
        if group == 1 {
            return Ok(x.clone());
        }
        let (b, kv, t, hd) = x.dims4()?;
        Ok(x.unsqueeze(2)?
            .broadcast_as((b, kv, group, t, hd))?
            .contiguous()?
            .reshape((b, kv * group, t, hd))?)
    }
}

/// What every block reads: the rotary tables of full-attention layers and, where they differ, of
/// sliding-window layers, and each window's mask.
pub(crate) struct LlamaContext {
    rope: Rope,
    local_rope: Option<Rope>,
    /// (window, T×T additive mask) for every window a layer uses.
    windows: Vec<(usize, Tensor)>,
}

impl CandleLlama {
    /// The rotary tables of these inverse frequencies in f64, rounded to the model's dtype.
    fn rope_tables(&self, inv: &[f64], shape: &BatchShape) -> Result<Rope> {
        let half = inv.len();
        let dim = 2 * half;
        let (mut cos, mut sin) = (vec![0.0; shape.t * dim], vec![0.0; shape.t * dim]);
        for t in 0..shape.t {
            for (i, f) in inv.iter().enumerate() {
                let angle = t as f64 * f;
                for j in [i, i + half] {
                    cos[t * dim + j] = angle.cos();
                    sin[t * dim + j] = angle.sin();
                }
            }
        }
        let table =
            |v: Vec<f64>| -> Result<Tensor> {
                Ok(Tensor::from_vec(v, (shape.t, dim), &self.core.device)?
                    .to_dtype(self.core.dtype)?)
            };
        Ok(Rope {
            cos: table(cos)?,
            sin: table(sin)?,
        })
    }
}

impl Architecture for CandleLlama {
    type Context = LlamaContext;

    fn core(&self) -> &Core {
        &self.core
    }

    fn context(&self, shape: &BatchShape) -> Result<LlamaContext> {
        let cfg = &self.config;
        let rope = self.rope_tables(&cfg.inverse_frequencies(), shape)?;
        let sliding = (0..cfg.num_hidden_layers).find(|&l| cfg.window(l).is_some());
        let local_rope = match (sliding, cfg.local_rope_theta) {
            (Some(l), Some(_)) => Some(self.rope_tables(&cfg.layer_inverse_frequencies(l), shape)?),
            (None, _) | (_, None) => None,
        };
        let mut windows: Vec<(usize, Tensor)> = Vec::new();
        for l in 0..cfg.num_hidden_layers {
            if let Some(w) = cfg.window(l) {
                if windows.iter().all(|(x, _)| *x != w) {
                    windows.push((w, window_mask(w, shape, &self.core)?));
                }
            }
        }
        Ok(LlamaContext {
            rope,
            local_rope,
            windows,
        })
    }

    /// No position table: the token embedding, times √d rounded to the model's dtype for Gemma
    /// (HF's `embed_scale.to(weight.dtype)`), is the first block's input.
    fn embed(&self, tokens: Tensor, _: &BatchShape) -> Result<(Tensor, Vec<ExtraEmbedding>)> {
        if !self.config.flavor.is_gemma() {
            return Ok((tokens, Vec::new()));
        }
        let scale = Tensor::new(self.config.embedding_scale(|x| x), &self.core.device)?
            .to_dtype(self.core.dtype)?;
        Ok((tokens.broadcast_mul(&scale)?, Vec::new()))
    }

    fn pad_token(&self) -> Option<usize> {
        self.config.pad_token_id
    }

    fn final_logit_softcap(&self) -> Option<f64> {
        self.config.final_logit_softcapping
    }

    fn block(
        &self,
        l: usize,
        x: Tensor,
        shape: &BatchShape,
        ctx: &LlamaContext,
        taps: &mut Taps,
    ) -> Result<Tensor> {
        let cfg = &self.config;
        let (h, kv, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let p = |s: &str| format!("model.layers.{l}.{s}");
        let (qkv_b, o_b, mlp_b) = (cfg.qkv_bias(), cfg.o_proj_bias(), cfg.mlp_biases());
        let layout = cfg.flavor.norm_layout();
        let sandwich = layout == NormLayout::Sandwich;
        let window = cfg.window(l);
        let rope = match (window, &ctx.local_rope) {
            (Some(_), Some(local)) => local,
            (None, _) | (Some(_), None) => &ctx.rope,
        };
        // h += attn_out_norm(o_proj(attn(rope(q'), rope(k'), v))), q' = q_norm(q(a1)),
        // k' = k_norm(k(a1)), a1 = input_layernorm(h).
        let a1 = self.rms_norm(&x, &p("input_layernorm"), taps)?;
        let q = self.linear(&a1, &p("self_attn.q_proj"), qkv_b, taps)?;
        let k = self.linear(&a1, &p("self_attn.k_proj"), qkv_b, taps)?;
        let v = self.linear(&a1, &p("self_attn.v_proj"), qkv_b, taps)?;
        let (q, k) = if cfg.flavor.head_norms() {
            (
                self.head_norm(&q, &p("self_attn.q_norm"), shape, h, taps)?,
                self.head_norm(&k, &p("self_attn.k_norm"), shape, kv, taps)?,
            )
        } else {
            (
                Self::heads(&q, shape, h, hd)?,
                Self::heads(&k, shape, kv, hd)?,
            )
        };
        let q = Self::rotate(&q, rope)?;
        let k = Self::rotate(&k, rope)?;
        let v = Self::heads(&v, shape, kv, hd)?;
        let group = cfg.group_size();
        let (k, v) = (Self::repeat_kv(&k, group)?, Self::repeat_kv(&v, group)?);
        let mask = match window {
            Some(w) => ctx
                .windows
                .iter()
                .find(|(x, _)| *x == w)
                .map(|(_, m)| m)
                .ok_or_else(|| crate::error::Error::internal(format!("no mask for window {w}")))?,
            None => &shape.mask,
        };
        let attention = Attention {
            scale: cfg.attention_scale(),
            softcap: cfg.attn_logit_softcapping,
            mask,
            softmax_f32: true,
        };
        let y = causal_attention(&q, &k, &v, &attention)?;
        let mut o = self.linear(&y, &p("self_attn.o_proj"), o_b, taps)?;
        if sandwich {
            o = self.rms_norm(&o, &p("post_attention_layernorm"), taps)?;
        }
        let x = (x + o)?;
        // h += mlp_out_norm(down(act(gate(a2)) ⊙ up(a2))), a2 = the MLP's norm of h.
        let mlp_norm = match layout {
            NormLayout::PreNorm => "post_attention_layernorm",
            NormLayout::Sandwich | NormLayout::PreFeedforward => "pre_feedforward_layernorm",
        };
        let a2 = self.rms_norm(&x, &p(mlp_norm), taps)?;
        let gate = self.linear(&a2, &p("mlp.gate_proj"), mlp_b, taps)?;
        let up = self.linear(&a2, &p("mlp.up_proj"), mlp_b, taps)?;
        let m = (self.activation(&gate)? * up)?;
        let mut down = self.linear(&m, &p("mlp.down_proj"), mlp_b, taps)?;
        if sandwich {
            down = self.rms_norm(&down, &p("post_feedforward_layernorm"), taps)?;
        }
        Ok((x + down)?)
    }

    fn final_norm(&self, x: &Tensor, taps: &mut Taps) -> Result<Tensor> {
        self.rms_norm(x, "model.norm", taps)
    }
}
