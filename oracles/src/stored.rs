//! Block weights kept in the checkpoint's own dtype and widened to f64 one block at a time. An
//! f32, f16 or bf16 value is exactly an f64, so a widened block is bit for bit the block an f64
//! copy of the model would hold: the products stay f64 and every result is unchanged, while a
//! 1B-parameter f32 checkpoint costs its 4 bytes a weight instead of 8.

use crate::error::{bail, Result};
use half::{bf16, f16};
use ndarray::ArrayViewMutD;
use safetensors::Dtype;

/// One tensor's values as the checkpoint stores them.
#[derive(Clone, Debug, PartialEq)]
enum StoredValues {
    F64(Vec<f64>),
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
}

impl StoredValues {
    fn len(&self) -> usize {
        match self {
            StoredValues::F64(v) => v.len(),
            StoredValues::F32(v) => v.len(),
            StoredValues::F16(v) => v.len(),
            StoredValues::Bf16(v) => v.len(),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            StoredValues::F64(v) => 8 * v.len(),
            StoredValues::F32(v) => 4 * v.len(),
            StoredValues::F16(v) => 2 * v.len(),
            StoredValues::Bf16(v) => 2 * v.len(),
        }
    }

    /// The first non-finite value and its flat index, if any.
    fn first_non_finite(&self) -> Option<(usize, f64)> {
        fn find<T: Copy>(v: &[T], wide: impl Fn(T) -> f64) -> Option<(usize, f64)> {
            v.iter()
                .map(|&x| wide(x))
                .enumerate()
                .find(|(_, x)| !x.is_finite())
        }
        match self {
            StoredValues::F64(v) => find(v, |x| x),
            StoredValues::F32(v) => find(v, f64::from),
            StoredValues::F16(v) => find(v, f16::to_f64),
            StoredValues::Bf16(v) => find(v, bf16::to_f64),
        }
    }

    fn widen_into(&self, out: &mut [f64]) {
        fn copy<T: Copy>(v: &[T], out: &mut [f64], w: impl Fn(T) -> f64) {
            for (o, &x) in out.iter_mut().zip(v) {
                *o = w(x);
            }
        }
        match self {
            StoredValues::F64(v) => copy(v, out, |x| x),
            StoredValues::F32(v) => copy(v, out, f64::from),
            StoredValues::F16(v) => copy(v, out, f16::to_f64),
            StoredValues::Bf16(v) => copy(v, out, bf16::to_f64),
        }
    }
}

/// Little-endian bytes of a floating tensor in its own dtype.
fn decode(dtype: Dtype, data: &[u8], what: &str) -> Result<StoredValues> {
    Ok(match dtype {
        Dtype::F64 => StoredValues::F64(
            data.chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect(),
        ),
        Dtype::F32 => StoredValues::F32(
            data.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect(),
        ),
        Dtype::F16 => StoredValues::F16(
            data.chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]))
                .collect(),
        ),
        Dtype::BF16 => StoredValues::Bf16(
            data.chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]))
                .collect(),
        ),
        other => bail!("{what} has dtype {other:?}; expected F32, F64, F16 or BF16"),
    })
}

/// Every block's tensors in the checkpoint's dtype, in `BlockParams::tensors` order, with the
/// shape each must widen into.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredBlocks {
    blocks: Vec<Vec<(Vec<usize>, StoredValues)>>,
}

impl StoredBlocks {
    /// Reads the blocks from `read(name)` (a tensor's dtype, shape and bytes), each block's
    /// tensors named by `names(layer)` with the shape `shapes` gives (checked). A non-finite
    /// weight is an error naming the tensor, as it is for resident weights.
    pub(crate) fn read(
        layers: usize,
        layout: &[(String, Vec<usize>)],
        name: impl Fn(usize, &str) -> String,
        mut read: impl FnMut(&str) -> Result<(Dtype, Vec<usize>, Vec<u8>)>,
        label: &str,
    ) -> Result<Self> {
        let mut blocks = Vec::with_capacity(layers);
        for layer in 0..layers {
            let mut tensors = Vec::with_capacity(layout.len());
            for (local, shape) in layout {
                let full = name(layer, local);
                let (dtype, got, data) = read(&full)?;
                if &got != shape {
                    bail!(
                        "{label}: tensor `{full}` has shape {got:?}; config.json implies {shape:?}"
                    );
                }
                let values = decode(dtype, &data, &format!("{label}: tensor `{full}`"))?;
                if let Some((i, v)) = values.first_non_finite() {
                    bail!(
                        "{label}: tensor `{full}` holds a non-finite value ({v}) at flat index {i}"
                    );
                }
                tensors.push((shape.clone(), values));
            }
            blocks.push(tensors);
        }
        Ok(StoredBlocks { blocks })
    }

    pub fn layers(&self) -> usize {
        self.blocks.len()
    }

    /// Bytes the stored values take.
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
