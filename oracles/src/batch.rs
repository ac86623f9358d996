//! A batch of token sequences and the causal-LM targets derived from it.

use crate::decoder::{Dims, HasDims};
use crate::error::{bail, Error, Result};
use crate::io::{write_raw, RawTensor};
use crate::tensors;
use ndarray::{Array2, Ix2};
use std::ops::Range;
use std::path::Path;

/// The value HF uses for a label that takes no part in the loss.
pub const IGNORE: i64 = -100;

/// B×T token ids and labels. Every id is ≥ 0 and every label is ≥ 0 or [`IGNORE`] (checked when
/// the batch is built, so that no id is ever cast to an index unchecked); whether they fit a
/// model's vocabulary is checked against the model ([`Batch::validate`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    input_ids: Array2<i64>,
    /// `IGNORE` = not a target; the logits at t predict `labels[t + 1]`.
    labels: Array2<i64>,
}

impl Batch {
    /// A batch of `input_ids` (B×T) with `labels` of the same shape (`None`: the ids themselves,
    /// as HF's causal-LM models take them). A negative id, a label that is neither ≥ 0 nor
    /// [`IGNORE`], or labels of another shape are refused, naming the tensor and the entry.
    pub fn new(input_ids: Array2<i64>, labels: Option<Array2<i64>>) -> Result<Self> {
        if let Some(l) = &labels {
            if l.shape() != input_ids.shape() {
                bail!(
                    "`labels` has shape {:?} but `input_ids` has {:?}",
                    l.shape(),
                    input_ids.shape()
                );
            }
        }
        if let Some(((i, j), x)) = input_ids.indexed_iter().find(|(_, &x)| x < 0) {
            bail!("input_ids[{i}][{j}] = {x} is negative; a token id indexes the vocabulary");
        }
        let labels = labels.unwrap_or_else(|| input_ids.clone());
        if let Some(((i, j), y)) = labels.indexed_iter().find(|(_, &y)| y < 0 && y != IGNORE) {
            bail!("labels[{i}][{j}] = {y} is neither -100 (ignored) nor a token id (≥ 0)");
        }
        Ok(Batch { input_ids, labels })
    }

    /// B×T token ids, every one ≥ 0.
    pub fn input_ids(&self) -> &Array2<i64> {
        &self.input_ids
    }

    /// B×T labels, each ≥ 0 or [`IGNORE`]; the logits at t predict `labels[t + 1]`.
    pub fn labels(&self) -> &Array2<i64> {
        &self.labels
    }

    /// The ids and the labels, to be changed and checked again by [`Batch::new`].
    pub fn into_parts(self) -> (Array2<i64>, Array2<i64>) {
        (self.input_ids, self.labels)
    }

    /// Number of examples (rows).
    pub fn len(&self) -> usize {
        self.input_ids.nrows()
    }

    /// True for a batch of no examples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tokens per example (columns), padding included.
    pub fn seq_len(&self) -> usize {
        self.input_ids.ncols()
    }

    /// Example `example`'s token ids.
    pub fn ids(&self, example: usize) -> Vec<usize> {
        // Non-negative by construction.
        self.input_ids
            .row(example)
            .iter()
            .map(|&x| x as usize)
            .collect()
    }

    /// `(position t, target)` for every kept target of an example: logits at t predict labels[t+1].
    pub fn targets(&self, example: usize) -> Vec<(usize, usize)> {
        let row = self.labels.row(example);
        // Every label that is not IGNORE is non-negative by construction.
        (0..self.seq_len().saturating_sub(1))
            .filter(|&t| row[t + 1] != IGNORE)
            .map(|t| (t, row[t + 1] as usize))
            .collect()
    }

    /// Reads a batch file (safetensors with `input_ids` and `labels`, both B×T).
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
        Batch::new(ids, labels).map_err(|e| Error::new(format!("{label}: {e}")))
    }

    /// Writes the batch as a safetensors file that [`Batch::load`] reads back.
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
        let dims = cfg.dims();
        self.check_sizes(&dims, label)?;
        let all = 0..self.len();
        self.check_ids(&dims, all.clone(), label)?;
        self.check_labels(&dims, all.clone(), label)?;
        self.check_targets(all, label)
    }

    /// The checks of [`Batch::validate`] that concern one example: what running it through the
    /// model needs.
    pub(crate) fn check_example(&self, dims: &Dims, example: usize) -> Result<()> {
        let label = "batch";
        if example >= self.len() {
            bail!(
                "{label}: example {example} is outside the batch of {} examples",
                self.len()
            );
        }
        self.check_sizes(dims, label)?;
        let one = example..example + 1;
        self.check_ids(dims, one.clone(), label)?;
        self.check_labels(dims, one.clone(), label)?;
        self.check_targets(one, label)
    }

    fn check_sizes(&self, dims: &Dims, label: &str) -> Result<()> {
        let (b, t) = self.input_ids.dim();
        if b == 0 || t == 0 {
            bail!("{label}: `input_ids` is empty ({b}×{t})");
        }
        if t > dims.max_positions {
            bail!(
                "{label}: sequence length {t} exceeds the model's {} = {}",
                dims.positions_key,
                dims.max_positions
            );
        }
        if t < 2 {
            bail!("{label}: sequence length 1 has no causal-LM target (logits at t predict the token at t+1)");
        }
        Ok(())
    }

    fn check_ids(&self, dims: &Dims, examples: Range<usize>, label: &str) -> Result<()> {
        for i in examples {
            for (j, &x) in self.input_ids.row(i).indexed_iter() {
                if x < 0 || x as usize >= dims.vocab_size {
                    bail!(
                        "{label}: input_ids[{i}][{j}] = {x} is outside the vocabulary 0..{}",
                        dims.vocab_size
                    );
                }
            }
        }
        Ok(())
    }

    fn check_labels(&self, dims: &Dims, examples: Range<usize>, label: &str) -> Result<()> {
        for i in examples {
            for (j, &y) in self.labels.row(i).indexed_iter() {
                if y != IGNORE && (y < 0 || y as usize >= dims.vocab_size) {
                    bail!(
                        "{label}: labels[{i}][{j}] = {y} is neither -100 (ignored) nor in the vocabulary 0..{}",
                        dims.vocab_size
                    );
                }
            }
        }
        Ok(())
    }

    fn check_targets(&self, examples: Range<usize>, label: &str) -> Result<()> {
        let t = self.seq_len();
        for i in examples {
            if self.targets(i).is_empty() {
                bail!("{label}: example {i} has no target: every label at positions 1..{t} is -100, so its loss is undefined");
            }
        }
        Ok(())
    }
}
