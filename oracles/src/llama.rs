//! The Llama-shaped families (HF `LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`,
//! `GemmaForCausalLM`, `Gemma2ForCausalLM`, `Gemma3ForCausalLM`, `VaultGemmaForCausalLM`) as one
//! instance of the decoder skeleton: RMSNorm, rotary embeddings (rotate-half layout), causal
//! attention with grouped-query heads, a gated MLP, no position table. What differs between them
//! is decided by the config's flavor ([`LlamaFlavor`]): where the norms sit, per-head q/k norms,
//! SwiGLU or GeGLU, the embedding scale, soft-capping, sliding windows, a second rope. Tensors
//! carry their full checkpoint names (`model.layers.N.self_attn.q_proj.weight`, ...).

use crate::checkpoint::{
    read_checkpoint, write_checkpoint, Blocks, CheckpointLayout, FromCheckpoint,
};
use crate::decoder::{
    prefixed_blocks, BlockParams, DecoderModel, Dims, HasDims, ParamSet, LM_HEAD,
};
use crate::error::{bail, Result};
use crate::layers::{
    gelu_new, gelu_new_grad, silu, silu_grad, Attention, Linear, NormCache, RmsNorm, Rope, Sites,
};
use crate::llama_config::{LlamaConfig, NormLayout};
use crate::rng::SplitMix64;
use crate::stored::StoredBlocks;
use crate::tensors::TensorSource;
use crate::trace::SiteRecord;
use ndarray::{Array2, ArrayView2, ArrayViewD, ArrayViewMutD};
use std::path::Path;

/// One decoder layer:
/// `h += attn_out_norm(o_proj(attn(rope(q_norm(q)), rope(k_norm(k)), v)))` on
/// `input_layernorm(h)`, then `h += mlp_out_norm(down_proj(act(gate_proj(x)) ⊙ up_proj(x)))` on
/// `x = mlp_norm(h)`; the optional pieces are absent where the flavor has none.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaLayer {
    /// Fixes the checkpoint name of `mlp_norm`.
    pub norm_layout: NormLayout,
    pub input_layernorm: RmsNorm,
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    /// `self_attn.q_norm` / `self_attn.k_norm` (Qwen3, Gemma 3): one RMSNorm over head_dim,
    /// applied to every head at every position.
    pub q_norm: Option<RmsNorm>,
    pub k_norm: Option<RmsNorm>,
    pub o_proj: Linear,
    /// `post_attention_layernorm` of the sandwich layout: on the attention's output.
    pub attn_out_norm: Option<RmsNorm>,
    /// The norm before the MLP: `post_attention_layernorm` in the Llama layout,
    /// `pre_feedforward_layernorm` in Gemma 2's and VaultGemma's.
    pub mlp_norm: RmsNorm,
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
    /// `post_feedforward_layernorm` of the sandwich layout: on the MLP's output.
    pub mlp_out_norm: Option<RmsNorm>,
}

/// The weights (or one example's gradient) of a Llama-family model.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaParams {
    /// `model.embed_tokens.weight`, V×d.
    pub embed_tokens: Array2<f64>,
    pub layers: Vec<LlamaLayer>,
    /// `model.norm.weight`.
    pub norm: RmsNorm,
    /// `lm_head.weight` (V×d); `None` for a tied model's weights.
    pub lm_head: Option<Array2<f64>>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Llama {
    pub config: LlamaConfig,
    /// The weights; their `layers` are empty when the blocks are `stored`.
    pub params: LlamaParams,
    /// The blocks in the checkpoint's dtype, widened one at a time ([`Llama::load_stored`]).
    pub stored: Option<StoredBlocks>,
}

/// A scalar function (an activation or its derivative).
type Scalar = fn(f64) -> f64;

pub const EMBED_TOKENS: &str = "model.embed_tokens.weight";
const FINAL_NORM: &str = "model.norm.weight";

/// Module paths relative to `model.layers.N.`.
const Q: &str = "self_attn.q_proj";
const K: &str = "self_attn.k_proj";
const V: &str = "self_attn.v_proj";
const O: &str = "self_attn.o_proj";
const Q_NORM: &str = "self_attn.q_norm";
const K_NORM: &str = "self_attn.k_norm";
const GATE: &str = "mlp.gate_proj";
const UP: &str = "mlp.up_proj";
const DOWN: &str = "mlp.down_proj";
const INPUT_NORM: &str = "input_layernorm";
const POST_ATTN_NORM: &str = "post_attention_layernorm";
const PRE_FFN_NORM: &str = "pre_feedforward_layernorm";
const POST_FFN_NORM: &str = "post_feedforward_layernorm";

/// The module path of the norm before the MLP.
fn mlp_norm_name(layout: NormLayout) -> &'static str {
    match layout {
        NormLayout::PreNorm => POST_ATTN_NORM,
        NormLayout::Sandwich | NormLayout::PreFeedforward => PRE_FFN_NORM,
    }
}

/// A layer's tensors in forward order, named relative to `model.layers.N.`: input norm, q/k/v
/// (weight, then bias when present), q/k norms, o, the attention-output norm, the MLP norm,
/// gate/up/down, the MLP-output norm. `$view` is `view` or `view_mut`, `$opt` `as_ref` or
/// `as_mut`, so that both borrows are listed by one text.
macro_rules! layer_tensors {
    ($l:expr, $layout:expr, $view:ident, $opt:ident) => {{
        let l = $l;
        let mut out = Vec::new();
        macro_rules! norm {
            ($name:expr, $n:expr) => {
                out.push((format!("{}.weight", $name), $n.weight.$view().into_dyn()))
            };
        }
        macro_rules! linear {
            ($name:expr, $lin:expr) => {
                out.push((format!("{}.weight", $name), $lin.weight.$view().into_dyn()));
                if let Some(b) = $lin.bias.$opt() {
                    out.push((format!("{}.bias", $name), b.$view().into_dyn()));
                }
            };
        }
        norm!(INPUT_NORM, l.input_layernorm);
        linear!(Q, l.q_proj);
        linear!(K, l.k_proj);
        linear!(V, l.v_proj);
        if let Some(n) = l.q_norm.$opt() {
            norm!(Q_NORM, n);
        }
        if let Some(n) = l.k_norm.$opt() {
            norm!(K_NORM, n);
        }
        linear!(O, l.o_proj);
        if let Some(n) = l.attn_out_norm.$opt() {
            norm!(POST_ATTN_NORM, n);
        }
        norm!(mlp_norm_name($layout), l.mlp_norm);
        linear!(GATE, l.gate_proj);
        linear!(UP, l.up_proj);
        linear!(DOWN, l.down_proj);
        if let Some(n) = l.mlp_out_norm.$opt() {
            norm!(POST_FFN_NORM, n);
        }
        out
    }};
}

/// (name relative to `model.layers.N.`, shape) of a layer of `cfg`, in [`layer_tensors`] order.
fn layer_layout(cfg: &LlamaConfig) -> Vec<(String, Vec<usize>)> {
    let (d, i, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
    let q = cfg.num_attention_heads * hd;
    let kv = cfg.num_key_value_heads * hd;
    let flavor = cfg.flavor;
    let layout = flavor.norm_layout();
    let sandwich = layout == NormLayout::Sandwich;
    let mut out = vec![(format!("{INPUT_NORM}.weight"), vec![d])];
    let linear = |out: &mut Vec<(String, Vec<usize>)>, name: &str, inp, o, bias: bool| {
        out.push((format!("{name}.weight"), vec![o, inp]));
        if bias {
            out.push((format!("{name}.bias"), vec![o]));
        }
    };
    linear(&mut out, Q, d, q, cfg.qkv_bias());
    linear(&mut out, K, d, kv, cfg.qkv_bias());
    linear(&mut out, V, d, kv, cfg.qkv_bias());
    if flavor.head_norms() {
        out.push((format!("{Q_NORM}.weight"), vec![hd]));
        out.push((format!("{K_NORM}.weight"), vec![hd]));
    }
    linear(&mut out, O, q, d, cfg.o_proj_bias());
    if sandwich {
        out.push((format!("{POST_ATTN_NORM}.weight"), vec![d]));
    }
    out.push((format!("{}.weight", mlp_norm_name(layout)), vec![d]));
    linear(&mut out, GATE, d, i, cfg.mlp_biases());
    linear(&mut out, UP, d, i, cfg.mlp_biases());
    linear(&mut out, DOWN, i, d, cfg.mlp_biases());
    if sandwich {
        out.push((format!("{POST_FFN_NORM}.weight"), vec![d]));
    }
    out
}

impl LlamaLayer {
    pub fn zeros(cfg: &LlamaConfig) -> Self {
        let (d, i, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
        let q = cfg.num_attention_heads * hd;
        let kv = cfg.num_key_value_heads * hd;
        let (qkv_b, o_b, mlp_b) = (cfg.qkv_bias(), cfg.o_proj_bias(), cfg.mlp_biases());
        let layout = cfg.flavor.norm_layout();
        let sandwich = layout == NormLayout::Sandwich;
        let head_norms = cfg.flavor.head_norms();
        LlamaLayer {
            norm_layout: layout,
            input_layernorm: RmsNorm::zeros(d),
            q_proj: Linear::zeros(d, q, qkv_b),
            k_proj: Linear::zeros(d, kv, qkv_b),
            v_proj: Linear::zeros(d, kv, qkv_b),
            q_norm: head_norms.then(|| RmsNorm::zeros(hd)),
            k_norm: head_norms.then(|| RmsNorm::zeros(hd)),
            o_proj: Linear::zeros(q, d, o_b),
            attn_out_norm: sandwich.then(|| RmsNorm::zeros(d)),
            mlp_norm: RmsNorm::zeros(d),
            gate_proj: Linear::zeros(d, i, mlp_b),
            up_proj: Linear::zeros(d, i, mlp_b),
            down_proj: Linear::zeros(i, d, mlp_b),
            mlp_out_norm: sandwich.then(|| RmsNorm::zeros(d)),
        }
    }
}

impl BlockParams for LlamaLayer {
    fn tensors(&self) -> Vec<(String, ArrayViewD<'_, f64>)> {
        layer_tensors!(self, self.norm_layout, view, as_ref)
    }

    fn tensors_mut(&mut self) -> Vec<(String, ArrayViewMutD<'_, f64>)> {
        let layout = self.norm_layout;
        layer_tensors!(self, layout, view_mut, as_mut)
    }
}

impl LlamaParams {
    /// Zero tensors of `cfg`; with `layers` false the blocks are left out (and the token
    /// embedding too, as a 0×d table, with `table` false).
    fn zeros_of(cfg: &LlamaConfig, with_head: bool, layers: bool, table: bool) -> Self {
        let d = cfg.hidden_size;
        LlamaParams {
            embed_tokens: Array2::zeros((if table { cfg.vocab_size } else { 0 }, d)),
            layers: if layers {
                (0..cfg.num_hidden_layers)
                    .map(|_| LlamaLayer::zeros(cfg))
                    .collect()
            } else {
                Vec::new()
            },
            norm: RmsNorm::zeros(d),
            lm_head: with_head.then(|| Array2::zeros((cfg.vocab_size, d))),
        }
    }

    pub fn zeros(cfg: &LlamaConfig, with_head: bool) -> Self {
        Self::zeros_of(cfg, with_head, true, true)
    }

    /// (checkpoint name, shape) of every tensor of a config, in `tensors()` order, without
    /// allocating.
    pub fn layout(cfg: &LlamaConfig, with_head: bool) -> Vec<(String, Vec<usize>)> {
        let (v, d) = (cfg.vocab_size, cfg.hidden_size);
        let mut out = vec![(EMBED_TOKENS.to_string(), vec![v, d])];
        let layer = layer_layout(cfg);
        for l in 0..cfg.num_hidden_layers {
            out.extend(
                layer
                    .iter()
                    .map(|(n, shape)| (format!("model.layers.{l}.{n}"), shape.clone())),
            );
        }
        out.push((FINAL_NORM.into(), vec![d]));
        if with_head {
            out.push((LM_HEAD.into(), vec![v, d]));
        }
        out
    }
}

impl ParamSet for LlamaParams {
    type Block = LlamaLayer;
    const STEM_TENSORS: usize = 1;

    fn block_prefix(layer: usize) -> String {
        format!("model.layers.{layer}.")
    }

    fn blocks(&self) -> &[LlamaLayer] {
        &self.layers
    }

    fn blocks_mut(&mut self) -> &mut [LlamaLayer] {
        &mut self.layers
    }

    fn tensors(&self) -> Vec<(String, ArrayViewD<'_, f64>)> {
        let mut out = vec![(
            EMBED_TOKENS.to_string(),
            self.embed_tokens.view().into_dyn(),
        )];
        out.extend(prefixed_blocks::<Self, _>(
            self.layers.iter().map(|b| b.tensors()),
        ));
        out.push((FINAL_NORM.into(), self.norm.weight.view().into_dyn()));
        if let Some(h) = &self.lm_head {
            out.push((LM_HEAD.into(), h.view().into_dyn()));
        }
        out
    }

    fn tensors_mut(&mut self) -> Vec<(String, ArrayViewMutD<'_, f64>)> {
        let mut out = vec![(
            EMBED_TOKENS.to_string(),
            self.embed_tokens.view_mut().into_dyn(),
        )];
        out.extend(prefixed_blocks::<Self, _>(
            self.layers.iter_mut().map(|b| b.tensors_mut()),
        ));
        out.push((FINAL_NORM.into(), self.norm.weight.view_mut().into_dyn()));
        if let Some(h) = &mut self.lm_head {
            out.push((LM_HEAD.into(), h.view_mut().into_dyn()));
        }
        out
    }

    fn token_embedding(&self) -> &Array2<f64> {
        &self.embed_tokens
    }

    fn token_embedding_mut(&mut self) -> &mut Array2<f64> {
        &mut self.embed_tokens
    }

    fn lm_head(&self) -> Option<&Array2<f64>> {
        self.lm_head.as_ref()
    }

    fn lm_head_mut(&mut self) -> &mut Option<Array2<f64>> {
        &mut self.lm_head
    }
}

impl Llama {
    /// A seeded model with no files. Matrices are N(0, init_std²); RMSNorm scales (w, or 1 + w
    /// for Gemma) 1 + N(0, 0.1²) and biases N(0, 0.1²), so that every parameter has a generic
    /// gradient.
    pub fn random(config: LlamaConfig, seed: u64, init_std: f64) -> Self {
        let mut rng = SplitMix64::new(seed);
        let mut params = LlamaParams::zeros(&config, !config.tie_word_embeddings);
        let norm_mean = 1.0 - config.flavor.norm_offset();
        for (name, mut t) in params.tensors_mut() {
            let is_norm = name.ends_with("norm.weight");
            let is_bias = name.ends_with(".bias");
            for v in t.iter_mut() {
                *v = if is_norm {
                    norm_mean + 0.1 * rng.normal()
                } else if is_bias {
                    0.1 * rng.normal()
                } else {
                    init_std * rng.normal()
                };
            }
        }
        Llama {
            config,
            params,
            stored: None,
        }
    }

    /// Builds a model from a parsed config and the contents of `model.safetensors`, every weight
    /// resident in f64.
    pub fn from_parts(config: LlamaConfig, bytes: &[u8], label: &str) -> Result<Self> {
        Self::build(config, bytes, label)
    }

    fn from_source(
        config: LlamaConfig,
        src: &dyn TensorSource,
        label: &str,
        blocks: Blocks,
    ) -> Result<Self> {
        if !src.has(EMBED_TOKENS) {
            bail!(
                "{label}: tensor `{EMBED_TOKENS}` is missing; is this a {} checkpoint ({} names)?",
                config.flavor.model_type(),
                config.flavor.class_name()
            );
        }
        let untied = !config.tie_word_embeddings;
        let spec = CheckpointLayout {
            layout: &LlamaParams::layout(&config, untied),
            layers: config.num_hidden_layers,
            block: layer_layout(&config),
            block_name: &|l, n| format!("{}{n}", LlamaParams::block_prefix(l)),
        };
        let (params, stored) = read_checkpoint(
            src,
            label,
            &spec,
            blocks,
            |layers| LlamaParams::zeros_of(&config, untied, layers, true),
            // Non-persistent buffers that older exports still carry; recomputed from the config.
            |n| n.ends_with(".rotary_emb.inv_freq"),
            config.tie_word_embeddings.then(|| EMBED_TOKENS.to_string()),
            config.flavor.model_type(),
        )?;
        Ok(Llama {
            config,
            params,
            stored,
        })
    }

    /// Writes `config.json` and `model.safetensors` (f64 or f32) the way `save_pretrained` lays
    /// them out.
    pub fn save(&self, dir: &Path, f32_weights: bool) -> Result<()> {
        write_checkpoint(self, &self.config.to_json(), dir, f32_weights)
    }

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

    /// The per-head rows of a T×(heads·hd) gradient, as [`Self::head_norm_forward`] lays them out.
    fn head_rows(&self, dy: &Array2<f64>) -> Array2<f64> {
        let hd = self.config.head_dim;
        dy.as_standard_layout()
            .into_owned()
            .into_shape_with_order((dy.len() / hd, hd))
            .expect("owned standard layout")
    }
}

impl HasDims for LlamaConfig {
    fn dims(&self) -> Dims {
        Dims {
            vocab_size: self.vocab_size,
            max_positions: self.max_position_embeddings,
            positions_key: "max_position_embeddings",
            hidden_size: self.hidden_size,
            layers: self.num_hidden_layers,
            tie_word_embeddings: self.tie_word_embeddings,
        }
    }
}

impl HasDims for Llama {
    fn dims(&self) -> Dims {
        self.config.dims()
    }
}

impl FromCheckpoint for Llama {
    type Config = LlamaConfig;

    fn parse_config(text: &str) -> Result<LlamaConfig> {
        LlamaConfig::from_json_str(text)
    }

    fn build_from(
        config: LlamaConfig,
        src: &dyn TensorSource,
        label: &str,
        blocks: Blocks,
    ) -> Result<Llama> {
        Llama::from_source(config, src, label, blocks)
    }
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
        let (q_norm, mut q) = match &b.q_norm {
            Some(n) => {
                let (c, y) = self.head_norm_forward(n, q);
                (Some(c), y)
            }
            None => (None, q),
        };
        let (k_norm, mut k) = match &b.k_norm {
            Some(n) => {
                let (c, y) = self.head_norm_forward(n, k);
                (Some(c), y)
            }
            None => (None, k),
        };
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

        let mut sites = Sites(sites);
        if sites.on() {
            let p = LlamaParams::block_prefix(layer);
            let linear =
                |sites: &mut Sites, name: &str, lin: &Linear, a: &Array2<f64>, bp: &Array2<f64>| {
                    sites.linear(
                        &format!("{p}{name}"),
                        lin.bias.is_some(),
                        a.view(),
                        bp.view(),
                    );
                };
            sites.norm(&format!("{p}{INPUT_NORM}"), false, &c.norm1, da1.view());
            linear(&mut sites, Q, &b.q_proj, &c.a1, &dq);
            linear(&mut sites, K, &b.k_proj, &c.a1, &dk);
            linear(&mut sites, V, &b.v_proj, &c.a1, &dv);
            if let Some(cache) = &c.q_norm {
                let bp = self.head_rows(&dq_normed);
                sites.norm(&format!("{p}{Q_NORM}"), false, cache, bp.view());
            }
            if let Some(cache) = &c.k_norm {
                let bp = self.head_rows(&dk_normed);
                sites.norm(&format!("{p}{K_NORM}"), false, cache, bp.view());
            }
            linear(&mut sites, O, &b.o_proj, &c.y, &d_o);
            if let Some(cache) = &c.attn_out_norm {
                sites.norm(&format!("{p}{POST_ATTN_NORM}"), false, cache, dh_mid.view());
            }
            let mlp_norm = mlp_norm_name(b.norm_layout);
            sites.norm(&format!("{p}{mlp_norm}"), false, &c.norm2, da2.view());
            linear(&mut sites, GATE, &b.gate_proj, &c.a2, &dgate);
            linear(&mut sites, UP, &b.up_proj, &c.a2, &dup);
            linear(&mut sites, DOWN, &b.down_proj, &c.m, &d_down);
            if let Some(cache) = &c.mlp_out_norm {
                sites.norm(&format!("{p}{POST_FFN_NORM}"), false, cache, dh.view());
            }
        }
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
