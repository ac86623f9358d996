//! A batch of token sequences and the causal-LM targets derived from it.

use crate::decoder::HasDims;
use crate::error::{bail, Result};
use crate::io::{write_raw, RawTensor};
use crate::tensors;
use ndarray::{Array2, Ix2};
use std::path::Path;

/// The value HF uses for a label that takes no part in the loss.
pub const IGNORE: i64 = -100;

#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// B×T token ids.
    pub input_ids: Array2<i64>,
    /// B×T labels (`IGNORE` = not a target); the logits at t predict `labels[t + 1]`.
    pub labels: Array2<i64>,
}

impl Batch {
    pub fn new(input_ids: Array2<i64>, labels: Option<Array2<i64>>) -> Self {
        let labels = labels.unwrap_or_else(|| input_ids.clone());
        Batch { input_ids, labels }
    }

    pub fn len(&self) -> usize {
        self.input_ids.nrows()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn seq_len(&self) -> usize {
        self.input_ids.ncols()
    }

    pub fn ids(&self, example: usize) -> Vec<usize> {
        self.input_ids
            .row(example)
            .iter()
            .map(|&x| x as usize)
            .collect()
    }

    /// `(position t, target)` for every kept target of an example: logits at t predict labels[t+1].
    pub fn targets(&self, example: usize) -> Vec<(usize, usize)> {
        let row = self.labels.row(example);
        (0..self.seq_len().saturating_sub(1))
            .filter(|&t| row[t + 1] != IGNORE)
            .map(|t| (t, row[t + 1] as usize))
            .collect()
    }

    pub fn load(path: &Path) -> Result<Self> {
        let bytes = tensors::read_bytes(path, "batch file")?;
        Self::from_bytes(&bytes, &path.display().to_string())
    }

    /// Parses a batch file's contents; `label` names it in messages.
    pub fn from_bytes(bytes: &[u8], label: &str) -> Result<Self> {
        let st = tensors::parse(bytes, label)?;
        let ids = tensors::to_i64(&st, "input_ids", label)?;
        let ids = match ids.into_dimensionality::<Ix2>() {
            Ok(a) => a,
            Err(_) => bail!("{label}: `input_ids` must be 2-D (batch × sequence)"),
        };
        let labels = if tensors::has(&st, "labels") {
            let l = tensors::to_i64(&st, "labels", label)?;
            if l.shape() != ids.shape() {
                bail!(
                    "{label}: `labels` has shape {:?} but `input_ids` has {:?}",
                    l.shape(),
                    ids.shape()
                );
            }
            Some(l.into_dimensionality::<Ix2>().expect("checked shape"))
        } else {
            None
        };
        for name in st.names() {
            if name != "input_ids" && name != "labels" {
                bail!("{label}: unexpected tensor `{name}`; a batch holds `input_ids` and optionally `labels`");
            }
        }
        Ok(Batch::new(ids, labels))
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        let t = [
            (
                "input_ids".to_string(),
                RawTensor::from_i64(&self.input_ids.view().into_dyn()),
            ),
            (
                "labels".to_string(),
                RawTensor::from_i64(&self.labels.view().into_dyn()),
            ),
        ];
        write_raw(path, &t, None)
    }

    /// Checks the batch against a model or config; `label` names the source in messages.
    pub fn validate<C: HasDims + ?Sized>(&self, cfg: &C, label: &str) -> Result<()> {
        let cfg = cfg.dims();
        let (b, t) = self.input_ids.dim();
        if b == 0 || t == 0 {
            bail!("{label}: `input_ids` is empty ({b}×{t})");
        }
        if t > cfg.max_positions {
            bail!(
                "{label}: sequence length {t} exceeds the model's {} = {}",
                cfg.positions_key,
                cfg.max_positions
            );
        }
        if t < 2 {
            bail!("{label}: sequence length 1 has no causal-LM target (logits at t predict the token at t+1)");
        }
        for ((i, j), &x) in self.input_ids.indexed_iter() {
            if x < 0 || x as usize >= cfg.vocab_size {
                bail!(
                    "{label}: input_ids[{i}][{j}] = {x} is outside the vocabulary 0..{}",
                    cfg.vocab_size
                );
            }
        }
        for ((i, j), &y) in self.labels.indexed_iter() {
            if y != IGNORE && (y < 0 || y as usize >= cfg.vocab_size) {
                bail!(
                    "{label}: labels[{i}][{j}] = {y} is neither -100 (ignored) nor in the vocabulary 0..{}",
                    cfg.vocab_size
                );
            }
        }
        for i in 0..b {
            if self.targets(i).is_empty() {
                bail!("{label}: example {i} has no target: every label at positions 1..{t} is -100, so its loss is undefined");
            }
        }
        Ok(())
    }
}
