//! The hyper-parameters of the Llama family (`LlamaForCausalLM`, `Qwen2ForCausalLM`) as Hugging
//! Face's `config.json` writes them, old (`rope_theta` + `rope_scaling`) and new
//! (`rope_parameters`) layouts alike. A value the reference does not model is an error naming the
//! key, never ignored.

use crate::error::{bail, Error, Result};
use crate::keys::{check_parameter_count, positive_number, Keys, MAX_DIM};
use serde_json::{Map, Value};

/// Which member of the family: it fixes the biases and the keys that are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlamaFlavor {
    /// `model_type: "llama"`: `attention_bias` on all four projections, `mlp_bias` on the MLP.
    Llama,
    /// `model_type: "qwen2"`: q/k/v biases always, no o_proj bias, no MLP bias.
    Qwen2,
}

impl LlamaFlavor {
    pub fn model_type(self) -> &'static str {
        match self {
            LlamaFlavor::Llama => "llama",
            LlamaFlavor::Qwen2 => "qwen2",
        }
    }

    pub fn from_model_type(s: &str) -> Option<Self> {
        [LlamaFlavor::Llama, LlamaFlavor::Qwen2]
            .into_iter()
            .find(|f| f.model_type() == s)
    }
}

/// How the rotary inverse frequencies are adjusted (`rope_scaling` / `rope_parameters`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// `null`, or `rope_type: "default"`.
    None,
    /// `rope_type: "llama3"` (Llama 3.1+): long wavelengths divided by `factor`, short ones kept,
    /// a smooth interpolation in between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub flavor: LlamaFlavor,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Grouped-query attention: each key/value head serves `num_attention_heads /
    /// num_key_value_heads` consecutive query heads.
    pub num_key_value_heads: usize,
    /// `head_dim` when the config gives it, else hidden_size / num_attention_heads.
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    /// Llama only (Qwen2's biases are fixed by the architecture).
    pub attention_bias: bool,
    /// Llama only.
    pub mlp_bias: bool,
    pub tie_word_embeddings: bool,
}

/// Keys a `rope_scaling` / `rope_parameters` object may hold for each `rope_type`.
const ROPE_COMMON_KEYS: [&str; 3] = ["rope_type", "type", "rope_theta"];
const LLAMA3_KEYS: [&str; 4] = [
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
];

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
        LlamaConfig {
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
        }
    }

    pub fn untied(mut self) -> Self {
        self.tie_word_embeddings = false;
        self
    }

    /// Whether q_proj, k_proj and v_proj have biases.
    pub fn qkv_bias(&self) -> bool {
        match self.flavor {
            LlamaFlavor::Llama => self.attention_bias,
            LlamaFlavor::Qwen2 => true,
        }
    }

    /// Whether o_proj has a bias.
    pub fn o_proj_bias(&self) -> bool {
        match self.flavor {
            LlamaFlavor::Llama => self.attention_bias,
            LlamaFlavor::Qwen2 => false,
        }
    }

    /// Whether gate_proj, up_proj and down_proj have biases.
    pub fn mlp_biases(&self) -> bool {
        match self.flavor {
            LlamaFlavor::Llama => self.mlp_bias,
            LlamaFlavor::Qwen2 => false,
        }
    }

    /// Query heads per key/value head.
    pub fn group_size(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// The rotary inverse frequencies θ^(-2i/head_dim), i < head_dim/2, after the scaling of
    /// `rope_scaling` (Hugging Face's `_compute_llama3_parameters`, evaluated in f64).
    pub fn inverse_frequencies(&self) -> Vec<f64> {
        let dim = self.head_dim;
        let base: Vec<f64> = (0..dim / 2)
            .map(|i| 1.0 / self.rope_theta.powf((2 * i) as f64 / dim as f64))
            .collect();
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

    pub fn from_json_str(text: &str) -> Result<Self> {
        let keys = Keys::parse(text)?;
        let flavor = match keys.value("model_type") {
            None => bail!("`model_type` is missing; expected \"llama\" or \"qwen2\""),
            Some(v) => match v.as_str().and_then(LlamaFlavor::from_model_type) {
                Some(f) => f,
                None => bail!("`model_type` is {v}; this loader reads \"llama\" and \"qwen2\""),
            },
        };
        // Hugging Face's defaults for absent keys differ between the two configs.
        let (vocab, intermediate, max_pos) = match flavor {
            LlamaFlavor::Llama => (32000, 11008, 2048),
            LlamaFlavor::Qwen2 => (151936, 22016, 32768),
        };
        match keys.value("hidden_act") {
            None => {}
            Some(Value::String(s)) if s == "silu" => {}
            Some(other) => bail!(
                "`hidden_act` is {other}; only \"silu\" (SwiGLU: down(silu(gate(x)) * up(x))) is supported"
            ),
        }
        let hidden_size = keys.usize("hidden_size", 4096)?;
        let heads = keys.usize("num_attention_heads", 32)?;
        let kv_heads = keys.usize("num_key_value_heads", heads)?;
        if heads % kv_heads != 0 {
            bail!("`num_attention_heads` ({heads}) is not a multiple of `num_key_value_heads` ({kv_heads})");
        }
        let head_dim = match keys.opt_usize("head_dim")? {
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
                if keys.bool("mlp_bias", false)? {
                    bail!("`mlp_bias` is true, but Qwen2's MLP has no biases");
                }
                check_qwen2_sliding_window(&keys)?;
                (false, false)
            }
        };
        let layers = keys.layers("num_hidden_layers", 32)?;
        let (rope_theta, rope_scaling) = rope(&keys)?;
        let cfg = LlamaConfig {
            flavor,
            vocab_size: keys.usize("vocab_size", vocab)?,
            hidden_size,
            intermediate_size: keys.usize("intermediate_size", intermediate)?,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            max_position_embeddings: keys.usize("max_position_embeddings", max_pos)?,
            rms_norm_eps: keys.positive("rms_norm_eps", 1e-6)?,
            rope_theta,
            rope_scaling,
            attention_bias,
            mlp_bias,
            tie_word_embeddings: keys.bool("tie_word_embeddings", false)?,
        };
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
        let layer = 2 * d + d * (q + 2 * kv) + qkv_b + q * d + o_b + 3 * d * i + mlp_b;
        let head = if self.tie_word_embeddings {
            0
        } else {
            self.vocab_size * d
        };
        self.vocab_size * d + self.num_hidden_layers * layer + d + head
    }

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
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings,
        });
        match self.flavor {
            LlamaFlavor::Llama => {
                v["attention_bias"] = Value::Bool(self.attention_bias);
                v["mlp_bias"] = Value::Bool(self.mlp_bias);
            }
            LlamaFlavor::Qwen2 => {
                v["use_sliding_window"] = Value::Bool(false);
            }
        }
        v
    }
}

/// Qwen2 may restrict some layers to a sliding window; the reference models full causal
/// attention only, so an active window is an error.
fn check_qwen2_sliding_window(keys: &Keys) -> Result<()> {
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
        let layers = keys.layers("num_hidden_layers", 32)?;
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

/// `rope_theta` and the scaling, from `rope_theta` + `rope_scaling` (transformers 4) or
/// `rope_parameters` (transformers 5), which must agree where both are given.
fn rope(keys: &Keys) -> Result<(f64, RopeScaling)> {
    let mut merged: Map<String, Value> = Map::new();
    for key in ["rope_scaling", "rope_parameters"] {
        let Some(v) = keys.value(key) else { continue };
        let Some(obj) = v.as_object() else {
            bail!("`{key}` must be an object or null, found {v}");
        };
        for (k, x) in obj {
            if let Some(prev) = merged.get(k) {
                if prev != x {
                    bail!("`rope_scaling.{k}` ({prev}) and `rope_parameters.{k}` ({x}) disagree");
                }
            }
            merged.insert(k.clone(), x.clone());
        }
    }
    let rope_type = match (merged.get("rope_type"), merged.get("type")) {
        (Some(a), Some(b)) if a != b => {
            bail!("`rope_type` ({a}) and `type` ({b}) of the rope parameters disagree")
        }
        (Some(a), _) | (None, Some(a)) => match a.as_str() {
            Some(s) => s.to_string(),
            None => bail!("`rope_type` must be a string, found {a}"),
        },
        (None, None) => "default".to_string(),
    };
    let theta = match (keys.value("rope_theta"), merged.get("rope_theta")) {
        (Some(a), Some(b)) if positive_number(a) != positive_number(b) => {
            bail!("`rope_theta` ({a}) and `rope_parameters.rope_theta` ({b}) disagree")
        }
        (Some(x), _) | (None, Some(x)) => positive_number(x).ok_or_else(|| {
            Error::new(format!("`rope_theta` must be a positive number, found {x}"))
        })?,
        (None, None) => 10000.0,
    };
    let allowed: &[&str] = match rope_type.as_str() {
        "default" => &[],
        "llama3" => &LLAMA3_KEYS,
        other => bail!(
            "`rope_type` is \"{other}\"; supported: \"default\" (or rope_scaling null) and \"llama3\""
        ),
    };
    for (k, x) in &merged {
        if ROPE_COMMON_KEYS.contains(&k.as_str()) || allowed.contains(&k.as_str()) {
            continue;
        }
        if k == "partial_rotary_factor" && x.as_f64() == Some(1.0) {
            continue;
        }
        bail!("rope parameter `{k}` = {x} is not supported with rope_type \"{rope_type}\"");
    }
    if rope_type == "default" {
        return Ok((theta, RopeScaling::None));
    }
    let num = |k: &str| -> Result<f64> {
        match merged.get(k) {
            None => bail!("rope_type \"llama3\" needs `{k}`"),
            Some(x) => positive_number(x).ok_or_else(|| {
                Error::new(format!(
                    "rope parameter `{k}` must be a positive number, found {x}"
                ))
            }),
        }
    };
    let factor = num("factor")?;
    let low_freq_factor = num("low_freq_factor")?;
    let high_freq_factor = num("high_freq_factor")?;
    if high_freq_factor <= low_freq_factor {
        bail!("rope parameter `high_freq_factor` ({high_freq_factor}) must exceed `low_freq_factor` ({low_freq_factor})");
    }
    let original = num("original_max_position_embeddings")?;
    if original.fract() != 0.0 || original > MAX_DIM as f64 {
        bail!("rope parameter `original_max_position_embeddings` must be an integer in 1..={}, found {original}", MAX_DIM);
    }
    Ok((
        theta,
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: original as usize,
        },
    ))
}
