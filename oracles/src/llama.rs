//! The Llama family (HF `LlamaForCausalLM`, `Qwen2ForCausalLM`) as an instance of the decoder
//! skeleton: RMSNorm, rotary embeddings (rotate-half layout), causal attention with grouped-query
//! heads, a SwiGLU MLP, no position table. Tensors carry their full checkpoint names
//! (`model.layers.N.self_attn.q_proj.weight`, ...).

use crate::checkpoint::{read_checkpoint, write_checkpoint, FromCheckpoint};
use crate::decoder::{DecoderModel, Dims, HasDims, ParamSet, LM_HEAD};
use crate::error::{bail, Result};
use crate::layers::{silu, silu_grad, Attention, Linear, NormCache, RmsNorm, Rope, Sites};
use crate::llama_config::LlamaConfig;
use crate::rng::SplitMix64;
use crate::tensors;
use crate::trace::SiteRecord;
use ndarray::{Array2, ArrayView2, ArrayViewD, ArrayViewMutD};
use std::path::Path;

/// One decoder layer: `h += o_proj(attn(rope(q), rope(k), v))` on `input_layernorm(h)`, then
/// `h += down_proj(silu(gate_proj(x)) ⊙ up_proj(x))` on `x = post_attention_layernorm(h)`.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaLayer {
    pub input_layernorm: RmsNorm,
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    pub post_attention_layernorm: RmsNorm,
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
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
    pub params: LlamaParams,
}

pub const EMBED_TOKENS: &str = "model.embed_tokens.weight";
const FINAL_NORM: &str = "model.norm.weight";

/// The attention projections and the MLP projections of a layer, by module path relative to
/// `model.layers.N.`, in forward order.
const ATTN: [&str; 4] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
];
const MLP: [&str; 3] = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"];

impl LlamaLayer {
    /// The attention projections q, k, v, o with their module paths.
    fn attention_linears(&self) -> [(&'static str, &Linear); 4] {
        [
            (ATTN[0], &self.q_proj),
            (ATTN[1], &self.k_proj),
            (ATTN[2], &self.v_proj),
            (ATTN[3], &self.o_proj),
        ]
    }

    /// The MLP projections gate, up, down with their module paths.
    fn mlp_linears(&self) -> [(&'static str, &Linear); 3] {
        [
            (MLP[0], &self.gate_proj),
            (MLP[1], &self.up_proj),
            (MLP[2], &self.down_proj),
        ]
    }

    /// Names relative to `model.layers.N.` in forward order: input norm, q/k/v/o (weight, then
    /// bias when present), post-attention norm, gate/up/down.
    fn names(&self) -> Vec<String> {
        let linear = |out: &mut Vec<String>, (name, lin): (&str, &Linear)| {
            out.push(format!("{name}.weight"));
            if lin.bias.is_some() {
                out.push(format!("{name}.bias"));
            }
        };
        let mut out = vec!["input_layernorm.weight".to_string()];
        self.attention_linears()
            .into_iter()
            .for_each(|l| linear(&mut out, l));
        out.push("post_attention_layernorm.weight".into());
        self.mlp_linears()
            .into_iter()
            .for_each(|l| linear(&mut out, l));
        out
    }
}

/// A layer's tensors in `names()` order.
fn layer_views(l: &LlamaLayer) -> Vec<ArrayViewD<'_, f64>> {
    fn linear<'a>(out: &mut Vec<ArrayViewD<'a, f64>>, lin: &'a Linear) {
        out.push(lin.weight.view().into_dyn());
        out.extend(lin.bias.as_ref().map(|b| b.view().into_dyn()));
    }
    let mut out = vec![l.input_layernorm.weight.view().into_dyn()];
    for lin in [&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj] {
        linear(&mut out, lin);
    }
    out.push(l.post_attention_layernorm.weight.view().into_dyn());
    for lin in [&l.gate_proj, &l.up_proj, &l.down_proj] {
        linear(&mut out, lin);
    }
    out
}

/// A layer's tensors in `names()` order, mutable.
fn layer_views_mut(l: &mut LlamaLayer) -> Vec<ArrayViewMutD<'_, f64>> {
    fn linear<'a>(out: &mut Vec<ArrayViewMutD<'a, f64>>, lin: &'a mut Linear) {
        out.push(lin.weight.view_mut().into_dyn());
        out.extend(lin.bias.as_mut().map(|b| b.view_mut().into_dyn()));
    }
    let mut out = vec![l.input_layernorm.weight.view_mut().into_dyn()];
    for lin in [&mut l.q_proj, &mut l.k_proj, &mut l.v_proj, &mut l.o_proj] {
        linear(&mut out, lin);
    }
    out.push(l.post_attention_layernorm.weight.view_mut().into_dyn());
    for lin in [&mut l.gate_proj, &mut l.up_proj, &mut l.down_proj] {
        linear(&mut out, lin);
    }
    out
}

impl LlamaParams {
    pub fn zeros(cfg: &LlamaConfig, with_head: bool) -> Self {
        let (d, i) = (cfg.hidden_size, cfg.intermediate_size);
        let q = cfg.num_attention_heads * cfg.head_dim;
        let kv = cfg.num_key_value_heads * cfg.head_dim;
        let (qkv_b, o_b, mlp_b) = (cfg.qkv_bias(), cfg.o_proj_bias(), cfg.mlp_biases());
        LlamaParams {
            embed_tokens: Array2::zeros((cfg.vocab_size, d)),
            layers: (0..cfg.num_hidden_layers)
                .map(|_| LlamaLayer {
                    input_layernorm: RmsNorm::zeros(d),
                    q_proj: Linear::zeros(d, q, qkv_b),
                    k_proj: Linear::zeros(d, kv, qkv_b),
                    v_proj: Linear::zeros(d, kv, qkv_b),
                    o_proj: Linear::zeros(q, d, o_b),
                    post_attention_layernorm: RmsNorm::zeros(d),
                    gate_proj: Linear::zeros(d, i, mlp_b),
                    up_proj: Linear::zeros(d, i, mlp_b),
                    down_proj: Linear::zeros(i, d, mlp_b),
                })
                .collect(),
            norm: RmsNorm::zeros(d),
            lm_head: with_head.then(|| Array2::zeros((cfg.vocab_size, d))),
        }
    }

    /// (checkpoint name, shape) of every tensor of a config, in `tensors()` order, without
    /// allocating.
    pub fn layout(cfg: &LlamaConfig, with_head: bool) -> Vec<(String, Vec<usize>)> {
        let (v, d, i) = (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size);
        let q = cfg.num_attention_heads * cfg.head_dim;
        let kv = cfg.num_key_value_heads * cfg.head_dim;
        let mut out = vec![(EMBED_TOKENS.to_string(), vec![v, d])];
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}.");
            out.push((format!("{p}input_layernorm.weight"), vec![d]));
            let attn = [(d, q), (d, kv), (d, kv), (q, d)];
            let attn_bias = [
                cfg.qkv_bias(),
                cfg.qkv_bias(),
                cfg.qkv_bias(),
                cfg.o_proj_bias(),
            ];
            for ((name, (inp, o)), bias) in ATTN.iter().zip(attn).zip(attn_bias) {
                out.push((format!("{p}{name}.weight"), vec![o, inp]));
                if bias {
                    out.push((format!("{p}{name}.bias"), vec![o]));
                }
            }
            out.push((format!("{p}post_attention_layernorm.weight"), vec![d]));
            for (name, (inp, o)) in MLP.iter().zip([(d, i), (d, i), (i, d)]) {
                out.push((format!("{p}{name}.weight"), vec![o, inp]));
                if cfg.mlp_biases() {
                    out.push((format!("{p}{name}.bias"), vec![o]));
                }
            }
        }
        out.push((FINAL_NORM.into(), vec![d]));
        if with_head {
            out.push((LM_HEAD.into(), vec![v, d]));
        }
        out
    }
}

impl ParamSet for LlamaParams {
    fn tensors(&self) -> Vec<(String, ArrayViewD<'_, f64>)> {
        let mut out = vec![(
            EMBED_TOKENS.to_string(),
            self.embed_tokens.view().into_dyn(),
        )];
        for (l, layer) in self.layers.iter().enumerate() {
            let names = layer.names();
            for (n, t) in names.into_iter().zip(layer_views(layer)) {
                out.push((format!("model.layers.{l}.{n}"), t));
            }
        }
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
        for (l, layer) in self.layers.iter_mut().enumerate() {
            let names = layer.names();
            for (n, t) in names.into_iter().zip(layer_views_mut(layer)) {
                out.push((format!("model.layers.{l}.{n}"), t));
            }
        }
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
    /// A seeded model with no files. Matrices are N(0, init_std²); RMSNorm weights 1 + N(0, 0.1²)
    /// and biases N(0, 0.1²), so that every parameter has a generic gradient.
    pub fn random(config: LlamaConfig, seed: u64, init_std: f64) -> Self {
        let mut rng = SplitMix64::new(seed);
        let mut params = LlamaParams::zeros(&config, !config.tie_word_embeddings);
        for (name, mut t) in params.tensors_mut() {
            let is_norm = name.ends_with("norm.weight");
            let is_bias = name.ends_with(".bias");
            for v in t.iter_mut() {
                *v = if is_norm {
                    1.0 + 0.1 * rng.normal()
                } else if is_bias {
                    0.1 * rng.normal()
                } else {
                    init_std * rng.normal()
                };
            }
        }
        Llama { config, params }
    }

    /// Builds a model from a parsed config and the contents of `model.safetensors`.
    pub fn from_parts(config: LlamaConfig, bytes: &[u8], label: &str) -> Result<Self> {
        let st = tensors::parse(bytes, label)?;
        if !tensors::has(&st, EMBED_TOKENS) {
            bail!("{label}: tensor `{EMBED_TOKENS}` is missing; is this a {} checkpoint (LlamaForCausalLM / Qwen2ForCausalLM names)?", config.flavor.model_type());
        }
        let untied = !config.tie_word_embeddings;
        let params = read_checkpoint(
            &st,
            label,
            &LlamaParams::layout(&config, untied),
            || LlamaParams::zeros(&config, untied),
            // Non-persistent buffers that older exports still carry; recomputed from the config.
            |n| n.ends_with(".rotary_emb.inv_freq"),
            config.tie_word_embeddings.then(|| EMBED_TOKENS.to_string()),
            config.flavor.model_type(),
        )?;
        Ok(Llama { config, params })
    }

    /// Writes `config.json` and `model.safetensors` (f64 or f32) the way `save_pretrained` lays
    /// them out.
    pub fn save(&self, dir: &Path, f32_weights: bool) -> Result<()> {
        write_checkpoint(self, &self.config.to_json(), dir, f32_weights)
    }

    fn attention(&self) -> Attention {
        let c = &self.config;
        Attention {
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            scale: 1.0 / (c.head_dim as f64).sqrt(),
        }
    }

    fn rope(&self, t_len: usize) -> Rope {
        Rope::new(&self.config.inverse_frequencies(), t_len)
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

    fn build(config: LlamaConfig, bytes: &[u8], label: &str) -> Result<Llama> {
        Llama::from_parts(config, bytes, label)
    }
}

/// What a Llama layer keeps from its forward pass.
pub struct LlamaBlockCache {
    norm1: NormCache,
    a1: Array2<f64>,
    /// Queries and keys after the rotation.
    q: Array2<f64>,
    k: Array2<f64>,
    v: Array2<f64>,
    probs: Vec<Array2<f64>>,
    y: Array2<f64>,
    norm2: NormCache,
    a2: Array2<f64>,
    gate: Array2<f64>,
    up: Array2<f64>,
    /// silu(gate) ⊙ up, the input of down_proj.
    m: Array2<f64>,
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

    /// Tensors carry their checkpoint names already.
    fn param_name(&self, local: &str) -> String {
        local.to_string()
    }

    fn embedding_local_name(&self) -> &'static str {
        EMBED_TOKENS
    }

    fn embed(&self, ids: &[usize]) -> Array2<f64> {
        let e = &self.params.embed_tokens;
        let mut h = Array2::<f64>::zeros((ids.len(), self.config.hidden_size));
        for (t, &x) in ids.iter().enumerate() {
            h.row_mut(t).assign(&e.row(x));
        }
        h
    }

    fn embed_backward(
        &self,
        ids: &[usize],
        dh: ArrayView2<f64>,
        g: &mut LlamaParams,
        sites: Option<&mut Vec<SiteRecord>>,
    ) {
        for (t, &x) in ids.iter().enumerate() {
            let mut r = g.embed_tokens.row_mut(x);
            r += &dh.row(t);
        }
        Sites(sites).push(|| {
            SiteRecord::embedding(
                EMBED_TOKENS.into(),
                EMBED_TOKENS.into(),
                self.config.vocab_size,
                ids.to_vec(),
                dh.to_owned(),
            )
        });
    }

    fn block_forward(&self, layer: usize, h: Array2<f64>) -> (LlamaBlockCache, Array2<f64>) {
        let b = &self.params.layers[layer];
        let eps = self.config.rms_norm_eps;
        let rope = self.rope(h.nrows());
        let (norm1, a1) = b.input_layernorm.forward(h.view(), eps);
        let mut q = b.q_proj.forward(a1.view());
        let mut k = b.k_proj.forward(a1.view());
        let v = b.v_proj.forward(a1.view());
        rope.rotate(&mut q, false);
        rope.rotate(&mut k, false);
        let (probs, y) = self.attention().forward(q.view(), k.view(), v.view());
        let h = h + b.o_proj.forward(y.view());
        let (norm2, a2) = b.post_attention_layernorm.forward(h.view(), eps);
        let gate = b.gate_proj.forward(a2.view());
        let up = b.up_proj.forward(a2.view());
        let m = &gate.mapv(silu) * &up;
        let h = h + b.down_proj.forward(m.view());
        let cache = LlamaBlockCache {
            norm1,
            a1,
            q,
            k,
            v,
            probs,
            y,
            norm2,
            a2,
            gate,
            up,
            m,
        };
        (cache, h)
    }

    fn block_backward(
        &self,
        layer: usize,
        c: &LlamaBlockCache,
        dh: Array2<f64>,
        g: &mut LlamaParams,
        sites: Option<&mut Vec<SiteRecord>>,
    ) -> Array2<f64> {
        let b = &self.params.layers[layer];
        let gb = &mut g.layers[layer];
        // MLP: h_out = h_mid + down(silu(gate(x)) ⊙ up(x)), x = post_attention_layernorm(h_mid).
        let dm = b
            .down_proj
            .backward(c.m.view(), dh.view(), &mut gb.down_proj);
        let mut dgate = &dm * &c.up;
        dgate.zip_mut_with(&c.gate, |d, &x| *d *= silu_grad(x));
        let dup = &dm * &c.gate.mapv(silu);
        let da2 = b
            .gate_proj
            .backward(c.a2.view(), dgate.view(), &mut gb.gate_proj)
            + b.up_proj.backward(c.a2.view(), dup.view(), &mut gb.up_proj);
        let dh_mid = &dh
            + &b.post_attention_layernorm.backward(
                da2.view(),
                &c.norm2,
                &mut gb.post_attention_layernorm,
            );
        // Attention: h_mid = h_in + o_proj(attn(rope(q(a1)), rope(k(a1)), v(a1))).
        let dy = b.o_proj.backward(c.y.view(), dh_mid.view(), &mut gb.o_proj);
        let (mut dq, mut dk, dv) =
            self.attention()
                .backward((c.q.view(), c.k.view(), c.v.view()), &c.probs, dy.view());
        let rope = self.rope(dh.nrows());
        rope.rotate(&mut dq, true);
        rope.rotate(&mut dk, true);
        let da1 = b.q_proj.backward(c.a1.view(), dq.view(), &mut gb.q_proj)
            + b.k_proj.backward(c.a1.view(), dk.view(), &mut gb.k_proj)
            + b.v_proj.backward(c.a1.view(), dv.view(), &mut gb.v_proj);
        let dh_in = &dh_mid
            + &b.input_layernorm
                .backward(da1.view(), &c.norm1, &mut gb.input_layernorm);

        let mut sites = Sites(sites);
        if sites.on() {
            let p = format!("model.layers.{layer}.");
            sites.norm(&format!("{p}input_layernorm"), false, &c.norm1, da1.view());
            let attn_factors = [(&c.a1, &dq), (&c.a1, &dk), (&c.a1, &dv), (&c.y, &dh_mid)];
            for ((name, lin), (a, bp)) in b.attention_linears().into_iter().zip(attn_factors) {
                sites.linear(
                    &format!("{p}{name}"),
                    lin.bias.is_some(),
                    a.view(),
                    bp.view(),
                );
            }
            sites.norm(
                &format!("{p}post_attention_layernorm"),
                false,
                &c.norm2,
                da2.view(),
            );
            let mlp_factors = [(&c.a2, &dgate), (&c.a2, &dup), (&c.m, &dh)];
            for ((name, lin), (a, bp)) in b.mlp_linears().into_iter().zip(mlp_factors) {
                sites.linear(
                    &format!("{p}{name}"),
                    lin.bias.is_some(),
                    a.view(),
                    bp.view(),
                );
            }
        }
        dh_in
    }

    fn final_norm(&self, h: ArrayView2<f64>) -> (NormCache, Array2<f64>) {
        self.params.norm.forward(h, self.config.rms_norm_eps)
    }

    fn final_norm_backward(
        &self,
        dy: ArrayView2<f64>,
        cache: &NormCache,
        g: &mut LlamaParams,
        sites: Option<&mut Vec<SiteRecord>>,
    ) -> Array2<f64> {
        Sites(sites).norm("model.norm", false, cache, dy);
        self.params.norm.backward(dy, cache, &mut g.norm)
    }
}
