//! The checkpoint directory every family shares: `config.json` and `model.safetensors` as
//! `save_pretrained` lays them out, read with every tensor checked against the config before
//! anything is allocated.

use crate::decoder::{DecoderModel, ParamSet, LM_HEAD};
use crate::error::{bail, Error, Result};
use crate::io::{weight_precision, RawTensor};
use crate::stored::StoredBlocks;
use crate::tensors::{self, TensorFile, TensorSource};
use serde_json::Value;
use std::path::Path;

/// A model that [`load`] can read: its config's parser and its builder from the checkpoint.
pub trait FromCheckpoint: Sized {
    /// The model's parsed `config.json`.
    type Config;
    /// Parses the text of `config.json`.
    fn parse_config(text: &str) -> Result<Self::Config>;
    /// Builds the model from its config and the contents of `model.safetensors`; `label` names
    /// the file in messages.
    fn build(config: Self::Config, bytes: &[u8], label: &str) -> Result<Self> {
        Self::build_from(
            config,
            &tensors::parse(bytes, label)?,
            label,
            Blocks::Resident,
        )
    }
    /// Builds the model from a checkpoint's tensors, its blocks kept as `blocks` says.
    #[doc(hidden)]
    fn build_from(
        config: Self::Config,
        src: &dyn TensorSource,
        label: &str,
        blocks: Blocks,
    ) -> Result<Self>;
}

/// How a loaded model keeps its blocks' weights.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Blocks {
    /// In f64, in `params()`: they can be read and changed in place.
    Resident,
    /// In the checkpoint's dtype, widened a block at a time (families that support it;
    /// the others keep theirs resident).
    Stored,
}

/// Loads `config.json` and `model.safetensors` from an HF checkpoint directory: a
/// [`Model`](crate::Model) of whichever family `model_type` names, or one family's own type.
/// The file is read tensor by tensor, never whole; the Llama-shaped families keep their blocks
/// in the checkpoint's dtype (see [`crate::StoredBlocks`]).
pub fn load<M: FromCheckpoint>(dir: &Path) -> Result<M> {
    load_as(dir, Blocks::Stored)
}

/// [`load`] with every weight resident in f64, for callers that change weights in place.
pub fn load_resident<M: FromCheckpoint>(dir: &Path) -> Result<M> {
    load_as(dir, Blocks::Resident)
}

fn load_as<M: FromCheckpoint>(dir: &Path, blocks: Blocks) -> Result<M> {
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
    let file = TensorFile::open(&path, "checkpoint")?;
    M::build_from(config, &file, &path.display().to_string(), blocks)
}

/// What [`read_checkpoint`] reads: the whole layout ((checkpoint name, shape) in the
/// `ParamSet`'s `tensors_mut` order) and, when the blocks are stored, how they are named.
pub(crate) struct CheckpointLayout<'a> {
    pub layout: &'a [(String, Vec<usize>)],
    pub layers: usize,
    /// A block's tensors, named relative to the block, with their shapes.
    pub block: Vec<(String, Vec<usize>)>,
    /// Checkpoint name of block `layer`'s tensor `local`.
    pub block_name: &'a dyn Fn(usize, &str) -> String,
}

/// Reads a checkpoint's tensors: the blocks into `params` (from `zeros(true)`) when resident, or
/// into [`StoredBlocks`] (with `zeros(false)` holding the rest) when stored. Every tensor is
/// checked against the header before anything is allocated: a config can claim any size, but
/// only tensors actually present in the file (so bounded by its length) are ever built. A
/// tensor the family does not know is an error unless `ignored` accepts it (buffers); with
/// `tied_embedding` (the embedding's checkpoint name), a tied checkpoint may still carry
/// `lm_head.weight`, but only as an exact copy.
#[allow(clippy::too_many_arguments)]
pub(crate) fn read_checkpoint<P: ParamSet>(
    src: &dyn TensorSource,
    label: &str,
    spec: &CheckpointLayout,
    blocks: Blocks,
    zeros: impl FnOnce(bool) -> P,
    ignored: impl Fn(&str) -> bool,
    tied_embedding: Option<String>,
    family: &str,
) -> Result<(P, Option<StoredBlocks>)> {
    if tied_embedding.is_none() && !src.has(LM_HEAD) {
        bail!("{label}: config says tie_word_embeddings = false but tensor `{LM_HEAD}` is missing");
    }
    for (name, shape) in spec.layout {
        let (_, got) = src
            .info(name)
            .ok_or_else(|| Error::new(format!("{label}: tensor `{name}` is missing")))?;
        if &got != shape {
            bail!("{label}: tensor `{name}` has shape {got:?}; config.json implies {shape:?}");
        }
    }
    let stored = blocks == Blocks::Stored;
    let block_names: std::collections::HashSet<String> = (0..spec.layers)
        .flat_map(|l| spec.block.iter().map(move |(n, _)| (spec.block_name)(l, n)))
        .collect();
    let mut params = zeros(!stored);
    {
        let wanted: Vec<&(String, Vec<usize>)> = spec
            .layout
            .iter()
            .filter(|(n, _)| !stored || !block_names.contains(n))
            .collect();
        let slots = params.tensors_mut();
        if slots.len() != wanted.len() {
            return Err(Error::internal(format!(
                "{label}: internal error: {} tensors laid out, {} allocated",
                wanted.len(),
                slots.len()
            )));
        }
        for ((name, shape), (_, mut slot)) in wanted.into_iter().zip(slots) {
            // The header's shape was checked against the layout above.
            if slot.shape() != shape.as_slice() {
                return Err(Error::internal(format!(
                    "{label}: internal error: `{name}` allocated as {:?}, laid out as {shape:?}",
                    slot.shape()
                )));
            }
            // Straight into the model's own buffer: a 1 B model's f32 embedding would otherwise
            // be decoded, widened and copied, three fresh buffers for one table.
            let out = slot
                .as_slice_mut()
                .ok_or_else(|| Error::internal(format!("{label}: `{name}` is not contiguous")))?;
            src.widen_into(name, label, out)?;
        }
    }
    let stored = stored
        .then(|| {
            StoredBlocks::read(
                spec.layers,
                &spec.block,
                spec.block_name,
                |n| src.stored(n, label),
                label,
            )
        })
        .transpose()?;
    for name in src.names() {
        if spec.layout.iter().any(|(n, _)| *n == name) || ignored(&name) {
            continue;
        }
        if let (true, Some(emb)) = (name == LM_HEAD, &tied_embedding) {
            let head = src.f64(LM_HEAD, label)?;
            if head.view() != params.token_embedding().view().into_dyn() {
                bail!("{label}: tie_word_embeddings is true but `{LM_HEAD}` differs from `{emb}`");
            }
            continue;
        }
        bail!("{label}: unexpected tensor `{name}` (not a {family} parameter of this config)");
    }
    Ok((params, stored))
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
    let precision = weight_precision(f32_weights);
    let mut raw = Vec::new();
    model.visit_weights(&mut |name, t| raw.push((name, RawTensor::from_f64(&t, precision))));
    crate::io::write_raw(&dir.join("model.safetensors"), &raw, None)
}
