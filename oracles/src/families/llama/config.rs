//! The hyper-parameters of the Llama-shaped families (`LlamaForCausalLM`, `Qwen2ForCausalLM`,
//! `Qwen3ForCausalLM` and the Gemma family, whose own keys `gemma_config.rs` reads) as Hugging
//! Face's `config.json` writes them, old (`rope_theta` + `rope_scaling`) and new
//! (`rope_parameters`) layouts alike. A value the reference does not model is an error naming the
//! key, never ignored.

use super::gemma_config::{self, GemmaKeys};
use crate::error::{bail, Error, Result};
use crate::keys::{check_parameter_count, Keys};
use serde_json::Value;

pub use super::flavor::{LayerType, LlamaFlavor, NormLayout};
use super::rope_config::rope;
pub use super::rope_config::RopeScaling;

/// The hyperparameters of a Llama-shaped model, as its `config.json` gives them.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Which family: sets the norm layout, the activation and the Gemma specifics.
    pub flavor: LlamaFlavor,
    /// V, the number of token ids.
    pub vocab_size: usize,
    /// d, the width of the residual stream.
    pub hidden_size: usize,
    /// Width of the gated MLP's hidden layer.
    pub intermediate_size: usize,
    /// Number of blocks.
    pub num_hidden_layers: usize,
    /// Query heads per block.
    pub num_attention_heads: usize,
    /// Grouped-query attention: each key/value head serves `num_attention_heads /
    /// num_key_value_heads` consecutive query heads.
    pub num_key_value_heads: usize,
    /// `head_dim` when the config gives it, else hidden_size / num_attention_heads.
    pub head_dim: usize,
    /// Longest sequence the model accepts.
    pub max_position_embeddings: usize,
    /// ε added to the mean square in every RMSNorm.
    pub rms_norm_eps: f64,
    /// Base of the rotary inverse frequencies.
    pub rope_theta: f64,
    /// How the rotary inverse frequencies are adjusted.
    pub rope_scaling: RopeScaling,
    /// Llama only (Qwen2's biases are fixed by the architecture).
    pub attention_bias: bool,
    /// Llama only.
    pub mlp_bias: bool,
    /// Whether the LM head is the token embedding.
    pub tie_word_embeddings: bool,
    /// Gemma 2, 3 and VaultGemma: attention scores are scaled by this^(-1/2) instead of
    /// head_dim^(-1/2).
    pub query_pre_attn_scalar: Option<f64>,
    /// Soft-capping of the scaled attention scores (Gemma 2, VaultGemma).
    pub attn_logit_softcapping: Option<f64>,
    /// Soft-capping of the final logits (Gemma 2, 3, VaultGemma).
    pub final_logit_softcapping: Option<f64>,
    /// Each layer's attention; `Sliding` layers see the last `sliding_window` positions.
    pub layer_types: Vec<LayerType>,
    /// Window, in positions, of the `Sliding` layers (`None` when no layer slides).
    pub sliding_window: Option<usize>,
    /// Gemma 3: the rope base of sliding-window layers (`rope_parameters.sliding_attention`, or
    /// the older `rope_local_base_freq`); `None` when every layer uses `rope_theta`.
    pub local_rope_theta: Option<f64>,
    /// HF builds the embedding as `nn.Embedding(…, padding_idx = pad_token_id)`: the padding
    /// token's row gets no gradient from the input path.
    pub pad_token_id: Option<usize>,
}

impl LlamaConfig {
    /// A small model for tests: `intermediate_size` = 2·hidden + 4, 64 positions, tied head, no
    /// biases, rope θ = 10000.
    pub fn tiny(
        flavor: LlamaFlavor,
        vocab_size: usize,
        hidden_size: usize,
        num_hidden_layers: usize,
        num_attention_heads: usize,
        num_key_value_heads: usize,
    ) -> Self {
        let mut cfg = LlamaConfig {
            flavor,
            vocab_size,
            hidden_size,
            intermediate_size: 2 * hidden_size + 4,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim: hidden_size / num_attention_heads,
            max_position_embeddings: 64,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::None,
            attention_bias: false,
            mlp_bias: false,
            tie_word_embeddings: true,
            query_pre_attn_scalar: None,
            attn_logit_softcapping: None,
            final_logit_softcapping: None,
            layer_types: vec![LayerType::Full; num_hidden_layers],
            sliding_window: None,
            local_rope_theta: None,
            pad_token_id: None,
        };
        // Gemma 2, 3 and VaultGemma as HF sets them up, sized for tests: layers alternate a
        // window (as long as the context, so inactive until a test shortens it) and full
        // attention; Gemma 3 rotates its windowed layers with a base of their own.
        match flavor {
            LlamaFlavor::Llama | LlamaFlavor::Qwen2 | LlamaFlavor::Qwen3 | LlamaFlavor::Gemma => {}
            LlamaFlavor::Gemma2 | LlamaFlavor::Gemma3Text | LlamaFlavor::VaultGemma => {
                cfg.query_pre_attn_scalar = Some(cfg.head_dim as f64);
                cfg.sliding_window = Some(cfg.max_position_embeddings);
                cfg.layer_types = (0..num_hidden_layers)
                    .map(|i| {
                        if i % 2 == 0 {
                            LayerType::Sliding
                        } else {
                            LayerType::Full
                        }
                    })
                    .collect();
                if flavor == LlamaFlavor::Gemma3Text {
                    cfg.rope_theta = 1e6;
                    cfg.local_rope_theta = Some(10000.0);
                }
            }
        }
        cfg
    }

    /// The same config with its own LM head.
    pub fn untied(mut self) -> Self {
        self.tie_word_embeddings = false;
        self
    }

    /// Whether (q_proj, k_proj and v_proj) and o_proj have biases: Qwen2 fixes them, every other
    /// member sets all four by `attention_bias`.
    fn attention_biases(&self) -> (bool, bool) {
        match self.flavor {
            LlamaFlavor::Qwen2 => (true, false),
            LlamaFlavor::Llama
            | LlamaFlavor::Qwen3
            | LlamaFlavor::Gemma
            | LlamaFlavor::Gemma2
            | LlamaFlavor::Gemma3Text
            | LlamaFlavor::VaultGemma => (self.attention_bias, self.attention_bias),
        }
    }

    /// Whether q_proj, k_proj and v_proj have biases.
    pub fn qkv_bias(&self) -> bool {
        self.attention_biases().0
    }

    /// Whether o_proj has a bias.
    pub fn o_proj_bias(&self) -> bool {
        self.attention_biases().1
    }

    /// Whether gate_proj, up_proj and down_proj have biases.
    pub fn mlp_biases(&self) -> bool {
        match self.flavor {
            LlamaFlavor::Llama => self.mlp_bias,
            LlamaFlavor::Qwen2
            | LlamaFlavor::Qwen3
            | LlamaFlavor::Gemma
            | LlamaFlavor::Gemma2
            | LlamaFlavor::Gemma3Text
            | LlamaFlavor::VaultGemma => false,
        }
    }

    /// The factor attention scores are scaled by.
    pub fn attention_scale(&self) -> f64 {
        1.0 / self
            .query_pre_attn_scalar
            .unwrap_or(self.head_dim as f64)
            .sqrt()
    }

    /// Layer `layer`'s window, when it is a sliding-window layer.
    pub fn window(&self, layer: usize) -> Option<usize> {
        match self.layer_types[layer] {
            LayerType::Full => None,
            LayerType::Sliding => self.sliding_window,
        }
    }

    /// The embedding scale √d, rounded to `precision`'s mantissa as Hugging Face's
    /// `embed_scale.to(weight.dtype)` does (1 for families that do not scale).
    pub fn embedding_scale(&self, round: impl Fn(f64) -> f64) -> f64 {
        if self.flavor.is_gemma() {
            round((self.hidden_size as f64).sqrt())
        } else {
            1.0
        }
    }

    /// Query heads per key/value head.
    pub fn group_size(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// Layer `layer`'s rotary inverse frequencies: Gemma 3's sliding-window layers have a base
    /// of their own, unscaled.
    pub fn layer_inverse_frequencies(&self, layer: usize) -> Vec<f64> {
        match (self.layer_types[layer], self.local_rope_theta) {
            (LayerType::Sliding, Some(theta)) => default_inverse_frequencies(theta, self.head_dim),
            (LayerType::Sliding, None) | (LayerType::Full, _) => self.inverse_frequencies(),
        }
    }

    /// The rotary inverse frequencies θ^(-2i/head_dim), i < head_dim/2, after the scaling of
    /// `rope_scaling` (Hugging Face's `_compute_llama3_parameters`, evaluated in f64).
    pub fn inverse_frequencies(&self) -> Vec<f64> {
        let base = default_inverse_frequencies(self.rope_theta, self.head_dim);
        match self.rope_scaling {
            RopeScaling::None => base,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old = original_max_position_embeddings as f64;
                let low_freq_wavelen = old / low_freq_factor;
                let high_freq_wavelen = old / high_freq_factor;
                base.into_iter()
                    .map(|inv| {
                        let wavelen = 2.0 * std::f64::consts::PI / inv;
                        if wavelen > low_freq_wavelen {
                            inv / factor
                        } else if wavelen < high_freq_wavelen {
                            inv
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * inv / factor + smooth * inv
                        }
                    })
                    .collect()
            }
        }
    }

    /// Parses the `config.json` of any flavor (by its `model_type`), with HF's defaults for the
    /// keys it leaves out; a key the reference does not model is an error.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let keys = Keys::parse(text)?;
        let accepted = LlamaFlavor::ALL
            .map(|f| format!("\"{}\"", f.model_type()))
            .join(", ");
        let flavor = match keys.value("model_type") {
            None => bail!("`model_type` is missing; expected one of {accepted}"),
            Some(v) => match v.as_str().and_then(LlamaFlavor::from_model_type) {
                Some(f) => f,
                None => bail!("`model_type` is {v}; this loader reads {accepted}"),
            },
        };
        let defaults = flavor.defaults();
        if flavor.is_gemma() {
            gemma_config::check_activation(&keys, flavor)?;
        } else {
            match keys.value("hidden_act") {
                None => {}
                Some(Value::String(s)) if s == "silu" => {}
                Some(other) => bail!(
                    "`hidden_act` is {other}; only \"silu\" (SwiGLU: down(silu(gate(x)) * up(x))) is supported"
                ),
            }
        }
        let hidden_size = keys.usize("hidden_size", defaults.hidden)?;
        let heads = keys.usize("num_attention_heads", defaults.heads)?;
        let kv_heads = keys.usize("num_key_value_heads", defaults.kv_heads.unwrap_or(heads))?;
        if heads % kv_heads != 0 {
            bail!("`num_attention_heads` ({heads}) is not a multiple of `num_key_value_heads` ({kv_heads})");
        }
        let head_dim = match keys.opt_usize("head_dim")?.or(defaults.head_dim) {
            Some(h) => h,
            None => {
                if hidden_size % heads != 0 {
                    bail!("`hidden_size` ({hidden_size}) is not a multiple of `num_attention_heads` ({heads}) and `head_dim` is not given");
                }
                hidden_size / heads
            }
        };
        if head_dim % 2 != 0 {
            bail!("`head_dim` is {head_dim}; rotary embeddings need an even head_dim");
        }
        if let Some(x) = keys.value("partial_rotary_factor") {
            if x.as_f64() != Some(1.0) {
                bail!("`partial_rotary_factor` is {x}; only 1.0 (rotary on the whole head) is supported");
            }
        }
        let layers = keys.layers("num_hidden_layers", defaults.layers)?;
        let (attention_bias, mlp_bias) = match flavor {
            LlamaFlavor::Llama => (
                keys.bool("attention_bias", false)?,
                keys.bool("mlp_bias", false)?,
            ),
            LlamaFlavor::Qwen2 => {
                // Qwen2's modules ignore these keys; a value that contradicts the architecture
                // means the checkpoint is not what its config claims.
                if keys.value("attention_bias").is_some() && !keys.bool("attention_bias", true)? {
                    bail!("`attention_bias` is false, but Qwen2 always has q/k/v biases");
                }
                no_mlp_bias(&keys, flavor)?;
                (false, false)
            }
            LlamaFlavor::Qwen3
            | LlamaFlavor::Gemma
            | LlamaFlavor::Gemma2
            | LlamaFlavor::Gemma3Text
            | LlamaFlavor::VaultGemma => {
                no_mlp_bias(&keys, flavor)?;
                (keys.bool("attention_bias", false)?, false)
            }
        };
        let mut cfg = LlamaConfig {
            flavor,
            vocab_size: keys.usize("vocab_size", defaults.vocab)?,
            hidden_size,
            intermediate_size: keys.usize("intermediate_size", defaults.intermediate)?,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            max_position_embeddings: keys.usize("max_position_embeddings", defaults.max_pos)?,
            rms_norm_eps: keys.positive("rms_norm_eps", 1e-6)?,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::None,
            attention_bias,
            mlp_bias,
            tie_word_embeddings: keys.bool("tie_word_embeddings", defaults.tie)?,
            query_pre_attn_scalar: None,
            attn_logit_softcapping: None,
            final_logit_softcapping: None,
            layer_types: vec![LayerType::Full; layers],
            sliding_window: None,
            local_rope_theta: None,
            pad_token_id: None,
        };
        cfg.pad_token_id = pad_token_id(&keys, flavor, cfg.vocab_size)?;
        if flavor.is_gemma() {
            let g = gemma_config::read(&keys, flavor, layers)?;
            cfg.query_pre_attn_scalar = g.query_pre_attn_scalar;
            cfg.attn_logit_softcapping = g.attn_logit_softcapping;
            cfg.final_logit_softcapping = g.final_logit_softcapping;
            cfg.layer_types = g.layer_types;
            cfg.sliding_window = g.sliding_window;
            (cfg.rope_theta, cfg.rope_scaling) = (g.rope_theta, g.rope_scaling);
            cfg.local_rope_theta = g.local_rope_theta;
        } else {
            check_no_sliding_window(&keys, layers)?;
            (cfg.rope_theta, cfg.rope_scaling) = rope(&keys, 10000.0)?;
        }
        check_parameter_count(cfg.parameter_count())?;
        Ok(cfg)
    }

    /// Number of trainable scalars (the tied head counted once).
    pub fn parameter_count(&self) -> usize {
        let (d, i) = (self.hidden_size, self.intermediate_size);
        let (q, kv) = (
            self.num_attention_heads * self.head_dim,
            self.num_key_value_heads * self.head_dim,
        );
        let qkv_b = if self.qkv_bias() { q + 2 * kv } else { 0 };
        let o_b = if self.o_proj_bias() { d } else { 0 };
        let mlp_b = if self.mlp_biases() { 2 * i + d } else { 0 };
        let norms = match self.flavor.norm_layout() {
            NormLayout::PreNorm | NormLayout::PreFeedforward => 2 * d,
            NormLayout::Sandwich => 4 * d,
        };
        let head_norms = if self.flavor.head_norms() {
            2 * self.head_dim
        } else {
            0
        };
        let layer = norms + head_norms + d * (q + 2 * kv) + qkv_b + q * d + o_b + 3 * d * i + mlp_b;
        let head = if self.tie_word_embeddings {
            0
        } else {
            self.vocab_size * d
        };
        self.vocab_size * d + self.num_hidden_layers * layer + d + head
    }

    /// The config as `config.json`, in the new `rope_parameters` layout (what
    /// [`LlamaConfig::from_json_str`] reads back).
    pub fn to_json(&self) -> Value {
        let rope_parameters = match self.rope_scaling {
            RopeScaling::None => serde_json::json!({
                "rope_type": "default",
                "rope_theta": self.rope_theta,
            }),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => serde_json::json!({
                "rope_type": "llama3",
                "rope_theta": self.rope_theta,
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings,
            }),
        };
        let mut v = serde_json::json!({
            "architectures": [self.flavor.class_name()],
            "model_type": self.flavor.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_word_embeddings,
            "pad_token_id": self.pad_token_id,
        });
        match self.flavor {
            LlamaFlavor::Llama => {
                v["hidden_act"] = "silu".into();
                v["attention_bias"] = Value::Bool(self.attention_bias);
                v["mlp_bias"] = Value::Bool(self.mlp_bias);
            }
            LlamaFlavor::Qwen2 => {
                v["hidden_act"] = "silu".into();
                v["use_sliding_window"] = Value::Bool(false);
            }
            LlamaFlavor::Qwen3 => {
                v["hidden_act"] = "silu".into();
                v["attention_bias"] = Value::Bool(self.attention_bias);
                v["use_sliding_window"] = Value::Bool(false);
            }
            LlamaFlavor::Gemma
            | LlamaFlavor::Gemma2
            | LlamaFlavor::Gemma3Text
            | LlamaFlavor::VaultGemma => {
                v["attention_bias"] = Value::Bool(self.attention_bias);
                let g = GemmaKeys {
                    query_pre_attn_scalar: self.query_pre_attn_scalar,
                    attn_logit_softcapping: self.attn_logit_softcapping,
                    final_logit_softcapping: self.final_logit_softcapping,
                    layer_types: self.layer_types.clone(),
                    sliding_window: self.sliding_window,
                    rope_theta: self.rope_theta,
                    rope_scaling: self.rope_scaling,
                    local_rope_theta: self.local_rope_theta,
                };
                gemma_config::write(&g, self.flavor, &mut v)
            }
        }
        v
    }
}

/// Llama and Qwen may restrict some layers to a sliding window, which the reference implements
/// for the Gemma family only (the families whose golden files test it): an active window is an
/// error here.
fn check_no_sliding_window(keys: &Keys, layers: usize) -> Result<()> {
    if let Some(types) = keys.value("layer_types") {
        let Some(list) = types.as_array() else {
            bail!("`layer_types` must be a list, found {types}");
        };
        for (i, t) in list.iter().enumerate() {
            if t.as_str() != Some("full_attention") {
                bail!("`layer_types[{i}]` is {t}; only \"full_attention\" is supported (no sliding-window attention)");
            }
        }
    }
    if keys.bool("use_sliding_window", false)? && keys.value("sliding_window").is_some() {
        let first = match keys.value("max_window_layers") {
            None => 28,
            Some(x) => x
                .as_u64()
                .ok_or_else(|| {
                    Error::new(format!(
                        "`max_window_layers` must be a non-negative integer, found {x}"
                    ))
                })?
                .min(usize::MAX as u64) as usize,
        };
        if first < layers {
            bail!(
                "`use_sliding_window` is true with `sliding_window` = {} for layers {first}..{layers} (`max_window_layers` = {first}); sliding-window attention is not supported",
                keys.value("sliding_window").expect("checked above")
            );
        }
    }
    Ok(())
}

/// `pad_token_id` (Gemma's configs default to 0, the others to none), inside the vocabulary as
/// `nn.Embedding` requires.
fn pad_token_id(keys: &Keys, flavor: LlamaFlavor, vocab: usize) -> Result<Option<usize>> {
    let default = flavor.is_gemma().then_some(0);
    let id = match keys.v_raw("pad_token_id") {
        None => default,
        Some(Value::Null) => None,
        Some(x) => match x.as_u64() {
            Some(n) if (n as usize) < vocab => Some(n as usize),
            _ => bail!(
                "`pad_token_id` must be null or an id in 0..{vocab} (`vocab_size`), found {x}"
            ),
        },
    };
    Ok(id)
}

fn no_mlp_bias(keys: &Keys, flavor: LlamaFlavor) -> Result<()> {
    if keys.bool("mlp_bias", false)? {
        bail!(
            "`mlp_bias` is true, but {}'s MLP has no biases",
            flavor.class_name()
        );
    }
    Ok(())
}

/// θ^(-2i/dim) for i < dim/2, in f64.
fn default_inverse_frequencies(theta: f64, dim: usize) -> Vec<f64> {
    (0..dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / dim as f64))
        .collect()
}
