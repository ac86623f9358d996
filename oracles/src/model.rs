//! Any supported decoder model, chosen by `config.json`'s `model_type`, and the checkpoint reading
//! and writing every family shares.

use crate::config::Gpt2Config;
use crate::decoder::{DecoderModel, Dims, HasDims, ParamSet, LM_HEAD};
use crate::error::{bail, Error, Result};
use crate::gpt2::Gpt2;
use crate::llama::Llama;
use crate::llama_config::LlamaConfig;
use crate::tensors;
use ndarray::ArrayViewD;
use safetensors::SafeTensors;
use serde_json::Value;
use std::path::Path;

/// A model of any supported family. Every `match` on it is exhaustive, so a new family is a
/// compile error wherever it is not handled.
#[derive(Clone, Debug, PartialEq)]
pub enum Model {
    Gpt2(Gpt2),
    /// `llama` and `qwen2`.
    Llama(Llama),
}

/// The `model_type` values [`Model::load`] reads.
pub const MODEL_TYPES: [&str; 3] = ["gpt2", "llama", "qwen2"];

impl Model {
    /// Loads `config.json` and `model.safetensors` from an HF checkpoint directory, choosing the
    /// family by `model_type` (absent: GPT-2, as `Gpt2::load` assumes).
    pub fn load(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            bail!(
                "model directory {} does not exist or is not a directory",
                dir.display()
            );
        }
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path)
            .map_err(|e| Error::new(format!("cannot read config {}: {e}", cfg_path.display())))?;
        let path = dir.join("model.safetensors");
        // The config is checked before the (possibly large) checkpoint is read.
        let config = ModelConfig::from_json_str(&text)
            .map_err(|e| Error::new(format!("config {}: {e}", cfg_path.display())))?;
        let bytes = tensors::read_bytes(&path, "checkpoint")?;
        config.build(&bytes, &path.display().to_string())
    }

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
        fn of<M: DecoderModel>(m: &M) -> Vec<(String, Vec<usize>)> {
            m.params()
                .tensors()
                .into_iter()
                .map(|(local, t)| (m.param_name(&local), t.shape().to_vec()))
                .collect()
        }
        match self {
            Model::Gpt2(m) => of(m),
            Model::Llama(m) => of(m),
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
    Gpt2(Gpt2Config),
    Llama(LlamaConfig),
}

impl ModelConfig {
    pub fn from_json_str(text: &str) -> Result<Self> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| Error::new(format!("not valid JSON: {e}")))?;
        match v.get("model_type") {
            None | Some(Value::Null) => Ok(ModelConfig::Gpt2(Gpt2Config::from_json_str(text)?)),
            Some(Value::String(t)) if t == "gpt2" => {
                Ok(ModelConfig::Gpt2(Gpt2Config::from_json_str(text)?))
            }
            Some(Value::String(t)) if t == "llama" || t == "qwen2" => {
                Ok(ModelConfig::Llama(LlamaConfig::from_json_str(text)?))
            }
            Some(other) => bail!(
                "`model_type` is {other}; supported: {}",
                MODEL_TYPES.map(|t| format!("\"{t}\"")).join(", ")
            ),
        }
    }

    /// Builds the model from the contents of `model.safetensors`.
    pub fn build(self, bytes: &[u8], label: &str) -> Result<Model> {
        Ok(match self {
            ModelConfig::Gpt2(c) => Model::Gpt2(Gpt2::from_parts(c, bytes, label)?),
            ModelConfig::Llama(c) => Model::Llama(Llama::from_parts(c, bytes, label)?),
        })
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

/// Reads the tensors of `layout` ((checkpoint name, shape) in the `ParamSet`'s `tensors_mut`
/// order) from a parsed checkpoint. Every tensor is checked against the header before anything
/// is allocated: a config can claim any size, but only tensors actually present in the file (so
/// bounded by its length) are ever built. A tensor the family does not know is an error unless
/// `ignored` accepts it (buffers); with `tied_embedding` (the embedding's checkpoint name), a
/// tied checkpoint may still carry `lm_head.weight`, but only as an exact copy.
pub(crate) fn read_checkpoint<P: ParamSet>(
    st: &SafeTensors,
    label: &str,
    layout: &[(String, Vec<usize>)],
    zeros: impl FnOnce() -> P,
    ignored: impl Fn(&str) -> bool,
    tied_embedding: Option<String>,
    family: &str,
) -> Result<P> {
    if tied_embedding.is_none() && !tensors::has(st, LM_HEAD) {
        bail!("{label}: config says tie_word_embeddings = false but tensor `{LM_HEAD}` is missing");
    }
    for (name, shape) in layout {
        let view = st
            .tensor(name)
            .map_err(|_| Error::new(format!("{label}: tensor `{name}` is missing")))?;
        if view.shape() != shape.as_slice() {
            bail!(
                "{label}: tensor `{name}` has shape {:?}; config.json implies {:?}",
                view.shape(),
                shape
            );
        }
    }
    let mut params = zeros();
    {
        let slots = params.tensors_mut();
        if slots.len() != layout.len() {
            bail!(
                "{label}: internal error: {} tensors laid out, {} allocated",
                layout.len(),
                slots.len()
            );
        }
        for ((name, _), (_, mut slot)) in layout.iter().zip(slots) {
            let t = tensors::to_f64(st, name, label)?;
            if t.shape() != slot.shape() {
                bail!(
                    "{label}: tensor `{name}` has shape {:?}; config.json implies {:?}",
                    t.shape(),
                    slot.shape()
                );
            }
            slot.assign(&t);
        }
    }
    for name in st.names() {
        if layout.iter().any(|(n, _)| n == name) || ignored(name) {
            continue;
        }
        if let (true, Some(emb)) = (name == LM_HEAD, &tied_embedding) {
            let head = tensors::to_f64(st, LM_HEAD, label)?;
            if head.view() != params.token_embedding().view().into_dyn() {
                bail!("{label}: tie_word_embeddings is true but `{LM_HEAD}` differs from `{emb}`");
            }
            continue;
        }
        bail!("{label}: unexpected tensor `{name}` (not a {family} parameter of this config)");
    }
    Ok(params)
}

/// Writes `config.json` and `model.safetensors` (f64 or f32) the way `save_pretrained` lays them
/// out.
pub(crate) fn write_checkpoint<M: DecoderModel>(
    model: &M,
    config: &Value,
    dir: &Path,
    f32_weights: bool,
) -> Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::new(format!("cannot create {}: {e}", dir.display())))?;
    let cfg = serde_json::to_string_pretty(config).expect("config serializes");
    let cfg_path = dir.join("config.json");
    std::fs::write(&cfg_path, cfg)
        .map_err(|e| Error::new(format!("cannot write {}: {e}", cfg_path.display())))?;
    let named: Vec<(String, ArrayViewD<f64>)> = model
        .params()
        .tensors()
        .into_iter()
        .map(|(local, t)| (model.param_name(&local), t))
        .collect();
    crate::io::write_f64_tensors(&dir.join("model.safetensors"), &named, f32_weights, None)
}
