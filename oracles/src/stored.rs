//! Block weights kept in the checkpoint's own dtype and widened to f64 one block at a time. An
//! f32, f16 or bf16 value is exactly an f64, so a widened block is bit for bit the block an f64
//! copy of the model would hold: the products stay f64 and every result is unchanged, while a
//! 1B-parameter f32 checkpoint costs its 4 bytes a weight instead of 8, and nothing of the
//! process's own when the file is mapped.

use crate::error::{bail, Result};
use crate::tensors::StoredTensor;
use ndarray::ArrayViewMutD;

/// Every block's tensors in the checkpoint's dtype, in `BlockParams::tensors` order, with the
/// shape each must widen into.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredBlocks {
    blocks: Vec<Vec<(Vec<usize>, StoredTensor)>>,
}

impl StoredBlocks {
    /// Reads the blocks from `read(name)` (a tensor's shape and values, checked finite), each
    /// block's tensors named by `names(layer)` with the shape `shapes` gives (checked).
    pub(crate) fn read(
        layers: usize,
        layout: &[(String, Vec<usize>)],
        name: impl Fn(usize, &str) -> String,
        mut read: impl FnMut(&str) -> Result<(Vec<usize>, StoredTensor)>,
        label: &str,
    ) -> Result<Self> {
        let mut blocks = Vec::with_capacity(layers);
        for layer in 0..layers {
            let mut tensors = Vec::with_capacity(layout.len());
            for (local, shape) in layout {
                let full = name(layer, local);
                let (got, values) = read(&full)?;
                if &got != shape {
                    bail!(
                        "{label}: tensor `{full}` has shape {got:?}; config.json implies {shape:?}"
                    );
                }
                tensors.push((shape.clone(), values));
            }
            blocks.push(tensors);
        }
        Ok(StoredBlocks { blocks })
    }

    /// Number of blocks.
    pub fn layers(&self) -> usize {
        self.blocks.len()
    }

    /// Whether every tensor is left in a mapped file (else some were decoded into memory).
    pub fn mapped(&self) -> bool {
        self.blocks
            .iter()
            .flatten()
            .all(|(_, t)| matches!(t, StoredTensor::Mapped { .. }))
    }

    /// Bytes the stored values take in the checkpoint's dtype: the page cache's when mapped.
    pub fn bytes(&self) -> usize {
        self.blocks.iter().flatten().map(|(_, v)| v.bytes()).sum()
    }

    /// Writes block `layer`'s weights into `slots` (a block's tensors, in the family's order).
    pub(crate) fn widen_into(&self, layer: usize, slots: Vec<(String, ArrayViewMutD<'_, f64>)>) {
        let stored = &self.blocks[layer];
        assert_eq!(
            slots.len(),
            stored.len(),
            "a stored block has the family's tensors"
        );
        for ((_, mut slot), (shape, values)) in slots.into_iter().zip(stored) {
            assert!(
                slot.shape() == shape.as_slice() && values.len() == slot.len(),
                "a stored tensor has its block's shape"
            );
            values.widen_into(
                slot.as_slice_mut()
                    .expect("a block's tensors are owned, in standard layout"),
            );
        }
    }
}
