//! The model families the reference runs, one folder each, and the enum that chooses among them
//! by `config.json`'s `model_type`.
//!
//! Every family fills the one skeleton of `crate::decoder` ([`DecoderModel`] and [`ParamSet`](crate::ParamSet)) in
//! the same four files: `config.rs` (its `config.json`), `params.rs` (its tensors, in checkpoint
//! order), `block.rs` (its forward and backward passes and the sites they record) and `mod.rs`
//! (the model, loaded from and saved to a checkpoint). A new family is one more folder here and
//! one more variant of [`Model`] and [`ModelConfig`], whose every `match` is exhaustive: a family
//! left out anywhere is a compile error.
//!
//! ```text
//! gpt2     GPT2LMHeadModel
//! llama    Llama, Qwen2, Qwen3, Gemma 1-3, VaultGemma: one block shape, what each member
//!          changes in flavor.rs; gemma_config.rs (Gemma's keys), rope_config.rs (rope_theta /
//!          rope_scaling / rope_parameters)
//! ```

pub mod gpt2;
pub mod llama;

use crate::checkpoint::{Blocks, FromCheckpoint};
use crate::decoder::{DecoderModel, Dims, HasDims};
use crate::error::{bail, Error, Result};
use crate::tensors::TensorSource;
use gpt2::{Gpt2, Gpt2Config};
use llama::{Llama, LlamaConfig, LlamaFlavor};
use serde_json::Value;
use std::path::Path;

/// A model of any supported family. Every `match` on it is exhaustive, so a new family is a
/// compile error wherever it is not handled.
#[derive(Clone, Debug, PartialEq)]
pub enum Model {
    /// `gpt2` (`GPT2LMHeadModel`).
    Gpt2(Gpt2),
    /// `llama`, `qwen2`, `qwen3`, `gemma`, `gemma2`, `gemma3_text` and `vaultgemma`: one block
    /// shape, its differences set by [`crate::LlamaFlavor`].
    Llama(Llama),
}

/// The `model_type` values a [`Model`] is loaded from: `gpt2` and every [`LlamaFlavor`].
pub(crate) fn model_types() -> Vec<&'static str> {
    let mut out = vec!["gpt2"];
    out.extend(LlamaFlavor::ALL.map(LlamaFlavor::model_type));
    out
}

impl Model {
    /// The family's name as `config.json` writes it.
    pub fn model_type(&self) -> &'static str {
        match self {
            Model::Gpt2(_) => "gpt2",
            Model::Llama(m) => m.config.flavor.model_type(),
        }
    }

    /// Number of trainable scalars (a tied head counted once).
    pub fn parameter_count(&self) -> usize {
        match self {
            Model::Gpt2(m) => m.config.parameter_count(),
            Model::Llama(m) => m.config.parameter_count(),
        }
    }

    /// Writes `config.json` and `model.safetensors` into `dir` (f32 weights when `f32_weights`).
    pub fn save(&self, dir: &Path, f32_weights: bool) -> Result<()> {
        match self {
            Model::Gpt2(m) => m.save(dir, f32_weights),
            Model::Llama(m) => m.save(dir, f32_weights),
        }
    }

    /// Checkpoint name of the tensor the LM head reads.
    pub fn head_param_name(&self) -> String {
        match self {
            Model::Gpt2(m) => m.head_param_name(),
            Model::Llama(m) => DecoderModel::head_param_name(m),
        }
    }

    /// (checkpoint name, shape) of every parameter, in the order of the reference's gradients.
    pub fn layout(&self) -> Vec<(String, Vec<usize>)> {
        match self {
            Model::Gpt2(m) => DecoderModel::layout(m),
            Model::Llama(m) => DecoderModel::layout(m),
        }
    }
}

impl From<Gpt2> for Model {
    fn from(m: Gpt2) -> Self {
        Model::Gpt2(m)
    }
}

impl From<Llama> for Model {
    fn from(m: Llama) -> Self {
        Model::Llama(m)
    }
}

impl HasDims for Model {
    fn dims(&self) -> Dims {
        match self {
            Model::Gpt2(m) => m.dims(),
            Model::Llama(m) => m.dims(),
        }
    }
}

/// A parsed `config.json` of any supported family.
#[derive(Clone, Debug, PartialEq)]
pub enum ModelConfig {
    /// A GPT-2 config.
    Gpt2(Gpt2Config),
    /// A config of the Llama-shaped families.
    Llama(LlamaConfig),
}

impl ModelConfig {
    /// Parses a `config.json`, the family chosen by its `model_type`.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| Error::new(format!("not valid JSON: {e}")))?;
        match v.get("model_type") {
            None | Some(Value::Null) => Ok(ModelConfig::Gpt2(Gpt2Config::from_json_str(text)?)),
            Some(Value::String(t)) if t == "gpt2" => {
                Ok(ModelConfig::Gpt2(Gpt2Config::from_json_str(text)?))
            }
            Some(Value::String(t)) if LlamaFlavor::from_model_type(t).is_some() => {
                Ok(ModelConfig::Llama(LlamaConfig::from_json_str(text)?))
            }
            Some(other) => bail!(
                "`model_type` is {other}; supported: {}",
                model_types()
                    .into_iter()
                    .map(|t| format!("\"{t}\""))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }

    /// Builds the model from the contents of `model.safetensors`, every weight resident.
    pub fn build(self, bytes: &[u8], label: &str) -> Result<Model> {
        Model::build(self, bytes, label)
    }
}

impl HasDims for ModelConfig {
    fn dims(&self) -> Dims {
        match self {
            ModelConfig::Gpt2(c) => c.dims(),
            ModelConfig::Llama(c) => c.dims(),
        }
    }
}

impl FromCheckpoint for Model {
    type Config = ModelConfig;

    /// Chooses the family by `model_type` (absent: GPT-2, as HF's GPT-2 configs leave it).
    fn parse_config(text: &str) -> Result<ModelConfig> {
        ModelConfig::from_json_str(text)
    }

    fn build_from(
        config: ModelConfig,
        src: &dyn TensorSource,
        label: &str,
        blocks: Blocks,
    ) -> Result<Model> {
        Ok(match config {
            ModelConfig::Gpt2(c) => Model::Gpt2(Gpt2::build_from(c, src, label, blocks)?),
            ModelConfig::Llama(c) => Model::Llama(Llama::build_from(c, src, label, blocks)?),
        })
    }
}
