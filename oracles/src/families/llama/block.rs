//! A Llama layer's forward and backward passes, and the sites its backward records, in the
//! order of [`LAYER`].

use super::params::{LlamaLayer, LlamaParams, Module, EMBED_TOKENS, LAYER};
use super::Llama;
use crate::decoder::{DecoderModel, ParamSet};
use crate::layers::{
    gelu_new, gelu_new_grad, silu, silu_grad, Attention, Linear, NormCache, RmsNorm, Rope, Sites,
};
use crate::stored::StoredBlocks;
use crate::trace::SiteRecord;
use ndarray::{Array2, ArrayView2};

/// A scalar function (an activation or its derivative).
type Scalar = fn(f64) -> f64;

impl Llama {
    fn attention(&self, layer: usize) -> Attention {
        let c = &self.config;
        Attention {
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            scale: c.attention_scale(),
            softcap: c.attn_logit_softcapping,
            window: c.window(layer),
        }
    }

    fn rope(&self, layer: usize, t_len: usize) -> Rope {
        Rope::new(&self.config.layer_inverse_frequencies(layer), t_len)
    }

    /// The reference computes in f64, so √d is not rounded further.
    fn embedding_scale(&self) -> f64 {
        self.config.embedding_scale(|x| x)
    }

    fn norm_offset(&self) -> f64 {
        self.config.flavor.norm_offset()
    }

    /// The MLP's activation and its derivative: GeGLU's tanh gelu for Gemma, SwiGLU's silu else.
    fn activation(&self) -> (Scalar, Scalar) {
        if self.config.flavor.is_gemma() {
            (gelu_new, gelu_new_grad)
        } else {
            (silu, silu_grad)
        }
    }

    /// An RMSNorm over each head of `x` (T×(heads·hd)): the rows of its cache are the T·heads
    /// (position, head) pairs, position-major, as HF's `view(…, -1, head_dim)` lays them out.
    fn head_norm_forward(&self, norm: &RmsNorm, x: Array2<f64>) -> (NormCache, Array2<f64>) {
        let shape = x.dim();
        let hd = self.config.head_dim;
        let rows = x
            .into_shape_with_order((shape.0 * shape.1 / hd, hd))
            .expect("a projection's output is contiguous");
        let (cache, y) = norm.forward(rows.view(), self.config.rms_norm_eps, self.norm_offset());
        let y = y
            .into_shape_with_order(shape)
            .expect("a norm's output is contiguous");
        (cache, y)
    }

    /// [`Self::head_norm_forward`] when the layer has the norm, `x` when it has not.
    fn optional_head_norm(
        &self,
        norm: Option<&RmsNorm>,
        x: Array2<f64>,
    ) -> (Option<NormCache>, Array2<f64>) {
        match norm {
            Some(n) => {
                let (c, y) = self.head_norm_forward(n, x);
                (Some(c), y)
            }
            None => (None, x),
        }
    }

    /// The per-head rows of a T×(heads·hd) gradient, as [`Self::head_norm_forward`] lays them out.
    fn head_rows(&self, dy: &Array2<f64>) -> Array2<f64> {
        let hd = self.config.head_dim;
        dy.as_standard_layout()
            .into_owned()
            .into_shape_with_order((dy.len() / hd, hd))
            .expect("owned standard layout")
    }
}

/// The backprops a layer's backward computes, by what they flow into: what its sites record.
struct LayerBackprops<'a> {
    /// Into the layer's output (the MLP-output norm).
    dh: &'a Array2<f64>,
    /// Into the residual stream between attention and MLP (the attention-output norm).
    dh_mid: &'a Array2<f64>,
    /// Into the attention's input norm, and from the q/k/v projections.
    da1: &'a Array2<f64>,
    dq: &'a Array2<f64>,
    dk: &'a Array2<f64>,
    dv: &'a Array2<f64>,
    /// Into the per-head q/k norms' outputs.
    dq_normed: &'a Array2<f64>,
    dk_normed: &'a Array2<f64>,
    d_o: &'a Array2<f64>,
    /// Into the MLP's input norm.
    da2: &'a Array2<f64>,
    dgate: &'a Array2<f64>,
    dup: &'a Array2<f64>,
    d_down: &'a Array2<f64>,
}

/// What a Llama layer keeps from its forward pass.
pub struct LlamaBlockCache {
    norm1: NormCache,
    a1: Array2<f64>,
    /// The per-head norms' caches, (T·heads) rows each.
    q_norm: Option<NormCache>,
    k_norm: Option<NormCache>,
    /// Queries and keys after the rotation.
    q: Array2<f64>,
    k: Array2<f64>,
    v: Array2<f64>,
    probs: Vec<Array2<f64>>,
    y: Array2<f64>,
    attn_out_norm: Option<NormCache>,
    norm2: NormCache,
    a2: Array2<f64>,
    gate: Array2<f64>,
    up: Array2<f64>,
    /// act(gate) ⊙ up, the input of down_proj.
    m: Array2<f64>,
    mlp_out_norm: Option<NormCache>,
}

/// `norm(x)` when the norm is present, `x` when it is not, with the cache of the one applied.
fn optional_norm(
    norm: Option<&RmsNorm>,
    x: Array2<f64>,
    eps: f64,
    offset: f64,
) -> (Option<NormCache>, Array2<f64>) {
    match norm {
        Some(n) => {
            let (c, y) = n.forward(x.view(), eps, offset);
            (Some(c), y)
        }
        None => (None, x),
    }
}

/// The backward of [`optional_norm`].
fn optional_norm_backward(
    norm: Option<&RmsNorm>,
    cache: Option<&NormCache>,
    dy: &Array2<f64>,
    offset: f64,
    g: Option<&mut RmsNorm>,
) -> Array2<f64> {
    match (norm, cache, g) {
        (Some(n), Some(c), Some(g)) => n.backward(dy.view(), c, offset, g),
        _ => dy.clone(),
    }
}

impl DecoderModel for Llama {
    type Params = LlamaParams;
    type BlockCache = LlamaBlockCache;

    fn params(&self) -> &LlamaParams {
        &self.params
    }

    fn params_mut(&mut self) -> &mut LlamaParams {
        &mut self.params
    }

    fn zero_gradient(&self) -> LlamaParams {
        LlamaParams::zeros(&self.config, false)
    }

    fn zero_stem_gradient(&self) -> LlamaParams {
        LlamaParams::zeros_of(&self.config, false, false, false)
    }

    fn zero_block(&self) -> LlamaLayer {
        LlamaLayer::zeros(&self.config)
    }

    fn stored_blocks(&self) -> Option<&StoredBlocks> {
        self.stored.as_ref()
    }

    /// Tensors carry their checkpoint names already.
    fn param_name(&self, local: &str) -> String {
        local.to_string()
    }

    fn layout(&self) -> Vec<(String, Vec<usize>)> {
        LlamaParams::layout(&self.config, !self.config.tie_word_embeddings)
    }

    fn embedding_local_name(&self) -> &'static str {
        EMBED_TOKENS
    }

    fn embedding_backprops(&self, ids: &[usize], dh: ArrayView2<f64>) -> Array2<f64> {
        let mut de = &dh * self.embedding_scale();
        if let Some(pad) = self.config.pad_token_id {
            for (t, &x) in ids.iter().enumerate() {
                if x == pad {
                    de.row_mut(t).fill(0.0);
                }
            }
        }
        de
    }

    fn final_logit_softcap(&self) -> Option<f64> {
        self.config.final_logit_softcapping
    }

    fn embed(&self, ids: &[usize]) -> Array2<f64> {
        let e = &self.params.embed_tokens;
        let scale = self.embedding_scale();
        let mut h = Array2::<f64>::zeros((ids.len(), self.config.hidden_size));
        for (t, &x) in ids.iter().enumerate() {
            h.row_mut(t).assign(&(&e.row(x) * scale));
        }
        h
    }

    fn block_cache_entries(&self, seq_len: usize) -> usize {
        let c = &self.config;
        let (d, q, kv) = (
            c.hidden_size,
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        // Two norms' x̂ and the optional output and per-head norms' (at most 4d + 2q more),
        // a1, a2; q (twice with its norm), k, v, y; gate, up, m; the attention probabilities.
        seq_len * (8 * d + 4 * q + 3 * kv + 3 * c.intermediate_size + 4)
            + c.num_attention_heads * seq_len * seq_len
    }

    fn block_forward(
        &self,
        layer: usize,
        b: &LlamaLayer,
        h: Array2<f64>,
    ) -> (LlamaBlockCache, Array2<f64>) {
        let (eps, off) = (self.config.rms_norm_eps, self.norm_offset());
        let (act, _) = self.activation();
        let rope = self.rope(layer, h.nrows());
        let (norm1, a1) = b.input_layernorm.forward(h.view(), eps, off);
        let q = b.q_proj.forward(a1.view());
        let k = b.k_proj.forward(a1.view());
        let v = b.v_proj.forward(a1.view());
        let (q_norm, mut q) = self.optional_head_norm(b.q_norm.as_ref(), q);
        let (k_norm, mut k) = self.optional_head_norm(b.k_norm.as_ref(), k);
        rope.rotate(&mut q, false);
        rope.rotate(&mut k, false);
        let (probs, y) = self.attention(layer).forward(q.view(), k.view(), v.view());
        let o = b.o_proj.forward(y.view());
        let (attn_out_norm, o) = optional_norm(b.attn_out_norm.as_ref(), o, eps, off);
        let h = h + o;
        let (norm2, a2) = b.mlp_norm.forward(h.view(), eps, off);
        let gate = b.gate_proj.forward(a2.view());
        let up = b.up_proj.forward(a2.view());
        let m = &gate.mapv(act) * &up;
        let down = b.down_proj.forward(m.view());
        let (mlp_out_norm, down) = optional_norm(b.mlp_out_norm.as_ref(), down, eps, off);
        let h = h + down;
        let cache = LlamaBlockCache {
            norm1,
            a1,
            q_norm,
            k_norm,
            q,
            k,
            v,
            probs,
            y,
            attn_out_norm,
            norm2,
            a2,
            gate,
            up,
            m,
            mlp_out_norm,
        };
        (cache, h)
    }

    fn block_backward(
        &self,
        layer: usize,
        b: &LlamaLayer,
        c: &LlamaBlockCache,
        dh: Array2<f64>,
        gb: &mut LlamaLayer,
        sites: Option<&mut Vec<SiteRecord>>,
    ) -> Array2<f64> {
        let off = self.norm_offset();
        let (act, act_grad) = self.activation();
        // MLP: h_out = h_mid + mlp_out_norm(down(act(gate(x)) ⊙ up(x))), x = mlp_norm(h_mid).
        let d_down = optional_norm_backward(
            b.mlp_out_norm.as_ref(),
            c.mlp_out_norm.as_ref(),
            &dh,
            off,
            gb.mlp_out_norm.as_mut(),
        );
        let dm = b
            .down_proj
            .backward(c.m.view(), d_down.view(), &mut gb.down_proj);
        let mut dgate = &dm * &c.up;
        dgate.zip_mut_with(&c.gate, |d, &x| *d *= act_grad(x));
        let dup = &dm * &c.gate.mapv(act);
        let da2 = b
            .gate_proj
            .backward(c.a2.view(), dgate.view(), &mut gb.gate_proj)
            + b.up_proj.backward(c.a2.view(), dup.view(), &mut gb.up_proj);
        let dh_mid = &dh
            + &b.mlp_norm
                .backward(da2.view(), &c.norm2, off, &mut gb.mlp_norm);
        // Attention: h_mid = h_in + attn_out_norm(o_proj(attn(rope(q'), rope(k'), v))), with
        // q' = q_norm(q(a1)), k' = k_norm(k(a1)), a1 = input_layernorm(h_in).
        let d_o = optional_norm_backward(
            b.attn_out_norm.as_ref(),
            c.attn_out_norm.as_ref(),
            &dh_mid,
            off,
            gb.attn_out_norm.as_mut(),
        );
        let dy = b.o_proj.backward(c.y.view(), d_o.view(), &mut gb.o_proj);
        let (mut dq_normed, mut dk_normed, dv) = self.attention(layer).backward(
            (c.q.view(), c.k.view(), c.v.view()),
            &c.probs,
            dy.view(),
        );
        let rope = self.rope(layer, dh.nrows());
        rope.rotate(&mut dq_normed, true);
        rope.rotate(&mut dk_normed, true);
        // Through the per-head norms: their rows are (position, head) pairs.
        let through_head_norm = |n: Option<&RmsNorm>,
                                 cache: Option<&NormCache>,
                                 g: Option<&mut RmsNorm>,
                                 d: &Array2<f64>|
         -> Array2<f64> {
            match (n, cache, g) {
                (Some(n), Some(cache), Some(g)) => {
                    let rows = self.head_rows(d);
                    n.backward(rows.view(), cache, off, g)
                        .into_shape_with_order(d.dim())
                        .expect("a norm's gradient is contiguous")
                }
                _ => d.clone(),
            }
        };
        let dq = through_head_norm(
            b.q_norm.as_ref(),
            c.q_norm.as_ref(),
            gb.q_norm.as_mut(),
            &dq_normed,
        );
        let dk = through_head_norm(
            b.k_norm.as_ref(),
            c.k_norm.as_ref(),
            gb.k_norm.as_mut(),
            &dk_normed,
        );
        let da1 = b.q_proj.backward(c.a1.view(), dq.view(), &mut gb.q_proj)
            + b.k_proj.backward(c.a1.view(), dk.view(), &mut gb.k_proj)
            + b.v_proj.backward(c.a1.view(), dv.view(), &mut gb.v_proj);
        let dh_in = &dh_mid
            + &b.input_layernorm
                .backward(da1.view(), &c.norm1, off, &mut gb.input_layernorm);

        let backprops = LayerBackprops {
            dh: &dh,
            dh_mid: &dh_mid,
            da1: &da1,
            dq: &dq,
            dk: &dk,
            dv: &dv,
            dq_normed: &dq_normed,
            dk_normed: &dk_normed,
            d_o: &d_o,
            da2: &da2,
            dgate: &dgate,
            dup: &dup,
            d_down: &d_down,
        };
        self.record_sites(layer, b, c, &backprops, Sites(sites));
        dh_in
    }

    fn final_norm(&self, h: ArrayView2<f64>) -> (NormCache, Array2<f64>) {
        self.params
            .norm
            .forward(h, self.config.rms_norm_eps, self.norm_offset())
    }

    fn final_norm_backward(
        &self,
        dy: ArrayView2<f64>,
        cache: &NormCache,
        g: &mut LlamaParams,
        sites: Option<&mut Vec<SiteRecord>>,
    ) -> Array2<f64> {
        Sites(sites).norm("model.norm", false, cache, dy);
        self.params
            .norm
            .backward(dy, cache, self.norm_offset(), &mut g.norm)
    }
}

impl Llama {
    /// The sites of layer `layer`'s backward, one per module in [`LAYER`] order (a linear map's
    /// bias site after its weight's).
    fn record_sites(
        &self,
        layer: usize,
        b: &LlamaLayer,
        c: &LlamaBlockCache,
        d: &LayerBackprops<'_>,
        mut sites: Sites<'_>,
    ) {
        if sites.on() {
            let p = LlamaParams::block_prefix(layer);
            for row in LAYER.iter().filter(|row| row.fits(b.norm_layout)) {
                let name = format!("{p}{}", row.name);
                let mut linear = |lin: &Linear, a: &Array2<f64>, bp: &Array2<f64>| {
                    sites.linear(&name, lin.bias.is_some(), a.view(), bp.view());
                };
                match row.module {
                    Module::InputNorm => sites.norm(&name, false, &c.norm1, d.da1.view()),
                    Module::Q => linear(&b.q_proj, &c.a1, d.dq),
                    Module::K => linear(&b.k_proj, &c.a1, d.dk),
                    Module::V => linear(&b.v_proj, &c.a1, d.dv),
                    // A per-head norm's rows are (position, head) pairs.
                    Module::QNorm => {
                        let bp = c.q_norm.as_ref().map(|_| self.head_rows(d.dq_normed));
                        sites.optional_norm(&name, c.q_norm.as_ref(), bp.as_ref());
                    }
                    Module::KNorm => {
                        let bp = c.k_norm.as_ref().map(|_| self.head_rows(d.dk_normed));
                        sites.optional_norm(&name, c.k_norm.as_ref(), bp.as_ref());
                    }
                    Module::O => linear(&b.o_proj, &c.y, d.d_o),
                    Module::AttnOutNorm => {
                        sites.optional_norm(&name, c.attn_out_norm.as_ref(), Some(d.dh_mid))
                    }
                    Module::MlpNorm => sites.norm(&name, false, &c.norm2, d.da2.view()),
                    Module::Gate => linear(&b.gate_proj, &c.a2, d.dgate),
                    Module::Up => linear(&b.up_proj, &c.a2, d.dup),
                    Module::Down => linear(&b.down_proj, &c.m, d.d_down),
                    Module::MlpOutNorm => {
                        sites.optional_norm(&name, c.mlp_out_norm.as_ref(), Some(d.dh))
                    }
                }
            }
        }
    }
}
