//! The rounding of the model's own forward and backward in the traced factors, when the exporter
//! measured it: the tensor `model.rounding` and the header key `model_rounding`, always together
//! (docs/trace-format.md, "The model's own rounding").

use crate::error::{bail, Result};
use crate::io::RawTensor;
use crate::tensors::{self, has};
use ndarray::{Array1, Ix1};
use safetensors::{Dtype, SafeTensors};
use std::collections::{HashMap, HashSet};

/// The tensor: one absolute gradient-norm error per example.
pub(crate) const TENSOR: &str = "model.rounding";
/// The header key: how the rounding was measured.
pub(crate) const KEY: &str = "model_rounding";

/// How far the per-example gradients rebuilt from the traced factors are from the same model's in
/// exact arithmetic, as the exporter measured it by replaying the model at another precision.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelRounding {
    /// How it was measured (`__metadata__.model_rounding`, e.g. `replay-float64`): a
    /// description to print, not interpreted.
    pub method: String,
    /// Per example, an estimate of ‖g_i(traced factors) − g_i(exact arithmetic)‖₂ over every
    /// parameter, in gradient units: finite and non-negative.
    pub per_example: Vec<f64>,
}

/// Reads `model.rounding` and `model_rounding`: both or neither, the tensor f64 of shape (B,),
/// every value finite and non-negative. Its bytes were held to the memory budget with every
/// other tensor copied as stored.
pub(super) fn read_model_rounding(
    st: &SafeTensors,
    meta: &HashMap<String, String>,
    b: usize,
    label: &str,
    expected: &mut HashSet<String>,
    done: super::Done,
) -> Result<Option<ModelRounding>> {
    let method = meta.get(KEY);
    let present = has(st, TENSOR);
    let method = match (method, present) {
        (None, false) => return Ok(None),
        (Some(m), true) => m.clone(),
        (Some(_), false) => bail!(
            "{label}: `__metadata__.{KEY}` is given but tensor `{TENSOR}` is missing (they come together: the per-example rounding and how it was measured)"
        ),
        (None, true) => bail!(
            "{label}: tensor `{TENSOR}` is given but `__metadata__.{KEY}` is missing (they come together: the per-example rounding and how it was measured)"
        ),
    };
    if method.trim().is_empty() {
        bail!("{label}: `__metadata__.{KEY}` is empty; it says how `{TENSOR}` was measured (e.g. \"replay-float64\")");
    }
    expected.insert(TENSOR.to_string());
    let view = st.tensor(TENSOR).expect("checked present");
    if view.dtype() != Dtype::F64 {
        bail!(
            "{label}: tensor `{TENSOR}` has dtype {:?}; expected F64",
            view.dtype()
        );
    }
    if view.shape() != [b] {
        bail!(
            "{label}: tensor `{TENSOR}` has shape {:?}; expected ({b}), one value per example",
            view.shape()
        );
    }
    // Refuses NaN and ±∞, naming the tensor.
    let values = tensors::to_f64(st, TENSOR, label)?
        .into_dimensionality::<Ix1>()
        .expect("checked 1-D")
        .to_vec();
    done(TENSOR)?;
    if let Some((i, v)) = values.iter().enumerate().find(|(_, &v)| v < 0.0) {
        bail!("{label}: tensor `{TENSOR}` holds {v:e} for example {i}; a rounding error is a norm, never negative");
    }
    Ok(Some(ModelRounding {
        method,
        per_example: values,
    }))
}

/// The tensor and the header key of a trace's model rounding.
pub(super) fn write_model_rounding(
    rounding: &ModelRounding,
    raw: &mut Vec<(String, RawTensor)>,
    meta: &mut HashMap<String, String>,
) {
    let v = Array1::from(rounding.per_example.clone()).into_dyn();
    raw.push((
        TENSOR.to_string(),
        RawTensor::from_f64(&v.view(), crate::precision::Precision::F64),
    ));
    meta.insert(KEY.to_string(), rounding.method.clone());
}
