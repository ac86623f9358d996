//! The Llama family (HF `LlamaForCausalLM`, `Qwen2ForCausalLM`) on candle: RMSNorm, rotary
//! embeddings in the rotate-half layout (with the config's rope scaling), causal attention with
//! grouped-query heads, a SwiGLU MLP, no position table.
//!
//! Sites, in forward order per layer: `input_layernorm` (kind `layernorm`, activations
//! x / rms(x)), q/k/v/o projections (kind `linear`, `y = W a`: activations a, backprops dL/dy),
//! each followed by its `bias` site when the config gives it one (Qwen2: q/k/v; Llama:
//! `attention_bias`, `mlp_bias`), `post_attention_layernorm`, then gate/up/down.

use super::{
    causal_attention, decode, is_half, Architecture, BatchShape, Core, ExtraEmbedding, Extracted,
    Taps,
};
use crate::error::Result;
use crate::trace::SiteKind;
use candle_core::{DType, Device, Tensor, D};
use ghost_oracle_reference::{Batch, Llama, LlamaConfig, LlamaFlavor, Reduction};

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
        let flavor = model.config.flavor;
        match flavor {
            LlamaFlavor::Llama | LlamaFlavor::Qwen2 => {}
            LlamaFlavor::Qwen3
            | LlamaFlavor::Gemma
            | LlamaFlavor::Gemma2
            | LlamaFlavor::Gemma3Text
            | LlamaFlavor::VaultGemma => {
                return Err(crate::error::Error::input(format!(
                    "the candle model does not implement `{}`; `reference` and `check` read it",
                    flavor.model_type()
                )))
            }
        }
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

    /// RMSNorm `w ⊙ x / sqrt(mean(x²) + eps)`, tapped as a `layernorm` site (no bias) with
    /// activations x̂ = x / rms(x). A half-precision model normalizes in f32 and rounds x̂ to its
    /// dtype, as HF's `LlamaRMSNorm` does.
    fn rms_norm(&self, x: &Tensor, module: &str, taps: &mut Taps) -> Result<Tensor> {
        let dtype = x.dtype();
        let xf = if is_half(dtype) {
            x.to_dtype(DType::F32)?
        } else {
            x.clone()
        };
        let ms = xf.sqr()?.mean_keepdim(D::Minus1)?;
        let xhat = xf
            .broadcast_div(&(ms + self.config.rms_norm_eps)?.sqrt()?)?
            .to_dtype(dtype)?;
        let weight = format!("{module}.weight");
        let out = xhat.broadcast_mul(self.core.w(&weight)?)?;
        taps.tap(out, weight, SiteKind::LayerNorm, &xhat, None)
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

impl Architecture for CandleLlama {
    type Context = Rope;

    fn core(&self) -> &Core {
        &self.core
    }

    /// The rotary tables in f64, rounded to the model's dtype.
    fn context(&self, shape: &BatchShape) -> Result<Rope> {
        let inv = self.config.inverse_frequencies();
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

    /// No position table: the token embedding is the first block's input.
    fn embed(&self, tokens: Tensor, _: &BatchShape) -> Result<(Tensor, Vec<ExtraEmbedding>)> {
        Ok((tokens, Vec::new()))
    }

    fn block(
        &self,
        l: usize,
        x: Tensor,
        shape: &BatchShape,
        rope: &Rope,
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
        // h += o_proj(attn(rope(q(a1)), rope(k(a1)), v(a1))), a1 = input_layernorm(h).
        let a1 = self.rms_norm(&x, &p("input_layernorm"), taps)?;
        let q = self.linear(&a1, &p("self_attn.q_proj"), qkv_b, taps)?;
        let k = self.linear(&a1, &p("self_attn.k_proj"), qkv_b, taps)?;
        let v = self.linear(&a1, &p("self_attn.v_proj"), qkv_b, taps)?;
        let q = Self::rotate(&Self::heads(&q, shape, h, hd)?, rope)?;
        let k = Self::rotate(&Self::heads(&k, shape, kv, hd)?, rope)?;
        let v = Self::heads(&v, shape, kv, hd)?;
        let group = cfg.group_size();
        let (k, v) = (Self::repeat_kv(&k, group)?, Self::repeat_kv(&v, group)?);
        let y = causal_attention(&q, &k, &v, 1.0 / (hd as f64).sqrt(), shape, true)?;
        let x = (x + self.linear(&y, &p("self_attn.o_proj"), o_b, taps)?)?;
        // h += down(silu(gate(a2)) ⊙ up(a2)), a2 = post_attention_layernorm(h).
        let a2 = self.rms_norm(&x, &p("post_attention_layernorm"), taps)?;
        let gate = self.linear(&a2, &p("mlp.gate_proj"), mlp_b, taps)?;
        let up = self.linear(&a2, &p("mlp.up_proj"), mlp_b, taps)?;
        let m = (Self::silu(&gate)? * up)?;
        Ok((x + self.linear(&m, &p("mlp.down_proj"), mlp_b, taps)?)?)
    }

    fn final_norm(&self, x: &Tensor, taps: &mut Taps) -> Result<Tensor> {
        self.rms_norm(x, "model.norm", taps)
    }
}
