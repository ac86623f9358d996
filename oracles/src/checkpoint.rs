//! The checkpoint directory every family shares: `config.json` and `model.safetensors` as
//! `save_pretrained` lays them out, read with every tensor checked against the config before
//! anything is allocated.

use crate::decoder::{DecoderModel, ParamSet, LM_HEAD};
use crate::error::{bail, Error, Result};
use crate::tensors;
use ndarray::ArrayViewD;
use safetensors::SafeTensors;
use serde_json::Value;
use std::path::Path;

/// A model that [`load`] can read: its config's parser and its builder from the checkpoint.
pub trait FromCheckpoint: Sized {
    type Config;
    /// Parses the text of `config.json`.
    fn parse_config(text: &str) -> Result<Self::Config>;
    /// Builds the model from its config and the contents of `model.safetensors`; `label` names
    /// the file in messages.
    fn build(config: Self::Config, bytes: &[u8], label: &str) -> Result<Self>;
}

/// Loads `config.json` and `model.safetensors` from an HF checkpoint directory: a
/// [`Model`](crate::Model) of whichever family `model_type` names, or one family's own type.
pub fn load<M: FromCheckpoint>(dir: &Path) -> Result<M> {
    if !dir.is_dir() {
        bail!(
            "model directory {} does not exist or is not a directory",
            dir.display()
        );
    }
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path)
        .map_err(|e| Error::new(format!("cannot read config {}: {e}", cfg_path.display())))?;
    // The config is checked before the (possibly large) checkpoint is read.
    let config = M::parse_config(&text)
        .map_err(|e| Error::new(format!("config {}: {e}", cfg_path.display())))?;
    let path = dir.join("model.safetensors");
    let bytes = tensors::read_bytes(&path, "checkpoint")?;
    M::build(config, &bytes, &path.display().to_string())
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
            return Err(Error::internal(format!(
                "{label}: internal error: {} tensors laid out, {} allocated",
                layout.len(),
                slots.len()
            )));
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
