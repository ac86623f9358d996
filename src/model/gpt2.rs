//! GPT-2 (HF `GPT2LMHeadModel`) on candle: learned positions, LayerNorm, fused-QKV Conv1D
//! attention and a `gelu_new` MLP. Sites: `conv1d` weights (in×out, activations the input,
//! backprops the output's gradient) with their `bias` sites, `layernorm` weights (activations
//! x̂) with their biases, and the position table `wpe` as a second embedding site.

use super::{
    causal_attention, decode, Architecture, Attention, BatchShape, Core, ExtraEmbedding, Extracted,
    Taps,
};
use crate::error::Result;
use crate::trace::SiteKind;
use candle_core::{DType, Device, Tensor, D};
use ghost_oracle_reference::{Batch, Gpt2, Gpt2Config, Reduction};

/// GPT-2 in candle, from the reference's weights: the trace a real training step would export.
pub struct CandleGpt2 {
    config: Gpt2Config,
    pub(crate) core: Core,
    /// `"transformer."` or `""`, as in the checkpoint.
    prefix: String,
}

impl CandleGpt2 {
    /// The reference's weights rounded to `dtype` on `device`.
    pub fn from_reference(model: &Gpt2, dtype: DType, device: &Device) -> Result<Self> {
        Ok(CandleGpt2 {
            config: model.config.clone(),
            core: Core::of(model, dtype, device)?,
            prefix: model.prefix.clone(),
        })
    }

    /// Runs the batch forward and backward (of the summed per-example losses) and returns the
    /// trace in this model's dtype and device.
    pub fn extract(&self, batch: &Batch, reduction: Reduction) -> Result<Extracted> {
        decode(self, batch, reduction)
    }

    /// Checkpoint name of a transformer-relative name.
    fn name(&self, local: &str) -> String {
        format!("{}{local}", self.prefix)
    }

    fn w(&self, local: &str) -> Result<&Tensor> {
        self.core.w(&self.name(local))
    }

    /// LayerNorm `x̂ ⊙ w + b`, tapped as a `layernorm` site with activations x̂ and its bias.
    fn layernorm(&self, x: &Tensor, local: &str, taps: &mut Taps) -> Result<Tensor> {
        let mean = x.mean_keepdim(D::Minus1)?;
        let centered = x.broadcast_sub(&mean)?;
        let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
        let xhat = centered.broadcast_div(&(var + self.config.layer_norm_epsilon)?.sqrt()?)?;
        let out = xhat
            .broadcast_mul(self.w(&format!("{local}.weight"))?)?
            .broadcast_add(self.w(&format!("{local}.bias"))?)?;
        taps.tap(
            out,
            self.name(&format!("{local}.weight")),
            SiteKind::LayerNorm,
            &xhat,
            Some(self.name(&format!("{local}.bias"))),
        )
    }

    /// HF Conv1D `x W + b` (W in×out), tapped with its bias.
    fn conv1d(&self, x: &Tensor, local: &str, taps: &mut Taps) -> Result<Tensor> {
        let out = x
            .broadcast_matmul(self.w(&format!("{local}.weight"))?)?
            .broadcast_add(self.w(&format!("{local}.bias"))?)?;
        taps.tap(
            out,
            self.name(&format!("{local}.weight")),
            SiteKind::Conv1d,
            x,
            Some(self.name(&format!("{local}.bias"))),
        )
    }

    /// gelu_new written from primitive ops (candle's built-in backward rounds its constants).
    fn gelu_new(x: &Tensor) -> Result<Tensor> {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let inner = ((x + (x.sqr()? * x)?.affine(0.044715, 0.0)?)?.affine(c, 0.0)?).tanh()?;
        Ok(((inner + 1.0)? * x)?.affine(0.5, 0.0)?)
    }
}

impl Architecture for CandleGpt2 {
    type Context = ();

    fn core(&self) -> &Core {
        &self.core
    }

    fn context(&self, _: &BatchShape) -> Result<()> {
        Ok(())
    }

    /// Token plus learned position embedding; `wpe` is a second embedding site whose ids are
    /// the positions.
    fn embed(&self, tokens: Tensor, shape: &BatchShape) -> Result<(Tensor, Vec<ExtraEmbedding>)> {
        let pos = Tensor::arange(0u32, shape.t as u32, &self.core.device)?;
        let x = tokens.broadcast_add(&self.w("wpe.weight")?.index_select(&pos, 0)?)?;
        let positions = ExtraEmbedding {
            name: self.name("wpe.weight"),
            vocab: self.config.n_positions,
            ids: pos
                .unsqueeze(0)?
                .broadcast_as((shape.b, shape.t))?
                .contiguous()?,
        };
        Ok((x, vec![positions]))
    }

    fn block(
        &self,
        l: usize,
        x: Tensor,
        shape: &BatchShape,
        _: &(),
        taps: &mut Taps,
    ) -> Result<Tensor> {
        let cfg = &self.config;
        let (b, t, d, h, hd) = (shape.b, shape.t, cfg.n_embd, cfg.n_head, cfg.head_dim());
        let p = |s: &str| format!("h.{l}.{s}");
        let a1 = self.layernorm(&x, &p("ln_1"), taps)?;
        let qkv = self.conv1d(&a1, &p("attn.c_attn"), taps)?;
        let heads = |k: usize| -> Result<Tensor> {
            Ok(qkv
                .narrow(2, k * d, d)?
                .reshape((b, t, h, hd))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
        let mut scale = 1.0;
        if cfg.scale_attn_weights {
            scale /= (hd as f64).sqrt();
        }
        if cfg.scale_attn_by_inverse_layer_idx {
            scale /= (l + 1) as f64;
        }
        let attention = Attention {
            scale,
            softcap: None,
            mask: &shape.mask,
            softmax_f32: false,
        };
        let y = causal_attention(&q, &k, &v, &attention)?;
        let x = (x + self.conv1d(&y, &p("attn.c_proj"), taps)?)?;
        let a2 = self.layernorm(&x, &p("ln_2"), taps)?;
        let f_pre = self.conv1d(&a2, &p("mlp.c_fc"), taps)?;
        let f = Self::gelu_new(&f_pre)?;
        Ok((x + self.conv1d(&f, &p("mlp.c_proj"), taps)?)?)
    }

    fn final_norm(&self, x: &Tensor, taps: &mut Taps) -> Result<Tensor> {
        self.layernorm(x, "ln_f", taps)
    }
}
