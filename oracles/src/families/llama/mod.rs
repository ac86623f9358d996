//! The Llama-shaped families (HF `LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`,
//! `GemmaForCausalLM`, `Gemma2ForCausalLM`, `Gemma3ForCausalLM`, `VaultGemmaForCausalLM`) as one
//! instance of the decoder skeleton: RMSNorm, rotary embeddings (rotate-half layout), causal
//! attention with grouped-query heads, a gated MLP, no position table. What differs between them
//! is decided by the config's flavor ([`LlamaFlavor`]): where the norms sit, per-head q/k norms,
//! SwiGLU or GeGLU, the embedding scale, soft-capping, sliding windows, a second rope. Tensors
//! carry their full checkpoint names (`model.layers.N.self_attn.q_proj.weight`, ...).
//!
//! `params` holds the parameters and the one table of a layer's modules; `block` a layer's
//! forward and backward passes and the sites they record; this module the model and its loading.
//!
//! [`LlamaFlavor`]: flavor::LlamaFlavor

mod block;
mod config;
mod flavor;
mod gemma_config;
mod params;
mod rope_config;

pub use params::{LlamaLayer, LlamaParams, EMBED_TOKENS};

use crate::checkpoint::{
    read_checkpoint, write_checkpoint, Blocks, CheckpointLayout, FromCheckpoint,
};
use crate::decoder::{Dims, HasDims, ParamSet};
use crate::error::{bail, Result};
use crate::rng::SplitMix64;
use crate::stored::StoredBlocks;
use crate::tensors::TensorSource;
pub use config::{LayerType, LlamaConfig, LlamaFlavor, NormLayout, RopeScaling};
use params::layer_layout;
use std::path::Path;

/// A Llama-family decoder (Llama, Qwen2/3, the Gemmas): config, weights and checkpoint names.
#[derive(Clone, Debug, PartialEq)]
pub struct Llama {
    /// The model's hyperparameters and flavor.
    pub config: LlamaConfig,
    /// The weights; their `layers` are empty when the blocks are `stored`.
    pub params: LlamaParams,
    /// The blocks in the checkpoint's dtype, widened one at a time ([`Llama::load_stored`]).
    pub stored: Option<StoredBlocks>,
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
