//! The keys only the Gemma family's configs have (`gemma`, `gemma2`, `gemma3_text`,
//! `vaultgemma`), read as Hugging Face's config classes and modules (transformers 5.25) interpret
//! them; `llama_config.rs` folds them into its config.

use super::flavor::{LayerType, LlamaFlavor};
use super::rope_config::{rope, rope_from, RopeScaling};
use crate::error::{bail, Error, Result};
use crate::keys::Keys;
use serde_json::{json, Value};

/// What a Gemma config sets beyond the Llama keys.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct GemmaKeys {
    pub(crate) query_pre_attn_scalar: Option<f64>,
    pub(crate) attn_logit_softcapping: Option<f64>,
    pub(crate) final_logit_softcapping: Option<f64>,
    pub(crate) layer_types: Vec<LayerType>,
    pub(crate) sliding_window: Option<usize>,
    pub(crate) rope_theta: f64,
    pub(crate) rope_scaling: RopeScaling,
    pub(crate) local_rope_theta: Option<f64>,
}

const GELU_TANH: &str = "gelu_pytorch_tanh";

/// Gemma's MLP is GeGLU with the tanh gelu. Gemma 1 reads `hidden_act` (whose legacy value
/// "gelu" `GemmaConfig` turns into the tanh form); the later ones read `hidden_activation` and
/// ignore `hidden_act`, as their modules do.
pub(crate) fn check_activation(keys: &Keys, flavor: LlamaFlavor) -> Result<()> {
    let (key, accepted): (&str, &[&str]) = match flavor {
        LlamaFlavor::Gemma => ("hidden_act", &[GELU_TANH, "gelu"]),
        LlamaFlavor::Gemma2 | LlamaFlavor::Gemma3Text | LlamaFlavor::VaultGemma => {
            ("hidden_activation", &[GELU_TANH])
        }
        LlamaFlavor::Llama | LlamaFlavor::Qwen2 | LlamaFlavor::Qwen3 => {
            return Err(Error::internal(format!(
                "internal error: {} read as a Gemma config",
                flavor.model_type()
            )))
        }
    };
    match keys.value(key) {
        None => Ok(()),
        Some(Value::String(s)) if accepted.contains(&s.as_str()) => Ok(()),
        Some(other) => bail!(
            "`{key}` is {other}; only \"{GELU_TANH}\" (GeGLU: down(gelu_tanh(gate(x)) * up(x))) is supported"
        ),
    }
}

/// Scaling, soft-capping, sliding windows and rope of a Gemma config of `layers` layers.
pub(crate) fn read(keys: &Keys, flavor: LlamaFlavor, layers: usize) -> Result<GemmaKeys> {
    if keys.bool("use_bidirectional_attention", false)? {
        bail!("`use_bidirectional_attention` is true; only causal attention is supported");
    }
    let mut g = GemmaKeys {
        query_pre_attn_scalar: None,
        attn_logit_softcapping: None,
        final_logit_softcapping: None,
        layer_types: vec![LayerType::Full; layers],
        sliding_window: None,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        local_rope_theta: None,
    };
    match flavor {
        // GemmaConfig has none of the later keys; its modules scale by head_dim^(-1/2).
        LlamaFlavor::Gemma => {
            (g.rope_theta, g.rope_scaling) = rope(keys, 10000.0)?;
            return Ok(g);
        }
        LlamaFlavor::Gemma2 | LlamaFlavor::VaultGemma => {
            g.attn_logit_softcapping =
                keys.nullable_positive("attn_logit_softcapping", Some(50.0))?;
            g.final_logit_softcapping =
                keys.nullable_positive("final_logit_softcapping", Some(30.0))?;
            g.layer_types = layer_types(keys, layers, 2)?;
            (g.rope_theta, g.rope_scaling) = rope(keys, 10000.0)?;
        }
        LlamaFlavor::Gemma3Text => {
            // Gemma3Attention keeps `attn_logit_softcapping` but never passes it to the attention
            // function: Hugging Face's model computes without it, and so does the reference.
            keys.nullable_positive("attn_logit_softcapping", None)?;
            g.final_logit_softcapping = keys.nullable_positive("final_logit_softcapping", None)?;
            let pattern = keys.usize("sliding_window_pattern", 6)?;
            g.layer_types = layer_types(keys, layers, pattern)?;
            gemma3_rope(keys, &mut g)?;
        }
        LlamaFlavor::Llama | LlamaFlavor::Qwen2 | LlamaFlavor::Qwen3 => {
            return Err(Error::internal(format!(
                "internal error: {} read as a Gemma config",
                flavor.model_type()
            )))
        }
    }
    g.query_pre_attn_scalar = Some(keys.positive("query_pre_attn_scalar", 256.0)?);
    g.sliding_window = keys.nullable_usize("sliding_window", Some(4096))?;
    if g.sliding_window.is_none() {
        if let Some(i) = g.layer_types.iter().position(|t| *t == LayerType::Sliding) {
            bail!("`sliding_window` is null but `layer_types[{i}]` is \"sliding_attention\"");
        }
    }
    Ok(g)
}

/// `layer_types`, or HF's default: every `pattern`-th layer full, the others sliding.
fn layer_types(keys: &Keys, layers: usize, pattern: usize) -> Result<Vec<LayerType>> {
    let Some(v) = keys.value("layer_types") else {
        return Ok((0..layers)
            .map(|i| {
                if (i + 1) % pattern != 0 {
                    LayerType::Sliding
                } else {
                    LayerType::Full
                }
            })
            .collect());
    };
    let Some(list) = v.as_array() else {
        bail!("`layer_types` must be a list, found {v}");
    };
    if list.len() != layers {
        bail!(
            "`layer_types` has {} entries but `num_hidden_layers` is {layers}",
            list.len()
        );
    }
    list.iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            Some("full_attention") => Ok(LayerType::Full),
            Some("sliding_attention") => Ok(LayerType::Sliding),
            _ => bail!(
                "`layer_types[{i}]` is {t}; supported: \"full_attention\", \"sliding_attention\""
            ),
        })
        .collect()
}

/// Gemma 3's two ropes: `rope_parameters` per layer type (transformers 5), or `rope_theta` +
/// `rope_scaling` for full-attention layers and `rope_local_base_freq` for sliding ones.
fn gemma3_rope(keys: &Keys, cfg: &mut GemmaKeys) -> Result<()> {
    let nested = keys.value("rope_parameters").and_then(|v| {
        v.as_object()
            .filter(|o| o.contains_key("full_attention") || o.contains_key("sliding_attention"))
    });
    let (full, local_theta) = match nested {
        Some(obj) => {
            for k in obj.keys() {
                if k != "full_attention" && k != "sliding_attention" {
                    bail!("`rope_parameters.{k}`: expected only \"full_attention\" and \"sliding_attention\"");
                }
            }
            let full = rope_from(
                1e6,
                keys.value("rope_theta"),
                [
                    ("rope_scaling", keys.value("rope_scaling")),
                    ("rope_parameters", obj.get("full_attention")),
                ],
            )
            .map_err(|e| Error::new(format!("`rope_parameters.full_attention`: {e}")))?;
            let local = rope_from(
                10000.0,
                keys.value("rope_local_base_freq"),
                [
                    ("rope_parameters", obj.get("sliding_attention")),
                    ("", None),
                ],
            )
            .map_err(|e| Error::new(format!("`rope_parameters.sliding_attention`: {e}")))?;
            (full, local)
        }
        None => {
            let full = rope(keys, 1e6)?;
            let local = keys.positive("rope_local_base_freq", 10000.0)?;
            (full, (local, RopeScaling::None))
        }
    };
    if local_theta.1 != RopeScaling::None {
        bail!("`rope_parameters.sliding_attention`: only rope_type \"default\" is supported for sliding-window layers");
    }
    (cfg.rope_theta, cfg.rope_scaling) = full;
    cfg.local_rope_theta = Some(local_theta.0);
    Ok(())
}

/// The Gemma keys of `config.json`.
pub(crate) fn write(cfg: &GemmaKeys, flavor: LlamaFlavor, v: &mut Value) {
    match flavor {
        LlamaFlavor::Gemma => {
            v["hidden_act"] = GELU_TANH.into();
            return;
        }
        LlamaFlavor::Gemma2
        | LlamaFlavor::Gemma3Text
        | LlamaFlavor::VaultGemma
        | LlamaFlavor::Llama
        | LlamaFlavor::Qwen2
        | LlamaFlavor::Qwen3 => {}
    }
    v["hidden_activation"] = GELU_TANH.into();
    v["query_pre_attn_scalar"] = json!(cfg.query_pre_attn_scalar);
    v["attn_logit_softcapping"] = json!(cfg.attn_logit_softcapping);
    v["final_logit_softcapping"] = json!(cfg.final_logit_softcapping);
    v["sliding_window"] = json!(cfg.sliding_window);
    v["layer_types"] = cfg.layer_types.iter().map(|t| t.name()).collect();
    if let Some(local) = cfg.local_rope_theta {
        let full = v["rope_parameters"].clone();
        v["rope_parameters"] = json!({
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
        });
    }
}
