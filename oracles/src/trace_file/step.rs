//! The DP-SGD step a trace may carry: `claimed.clipped_sum.<param>` and `claimed.update.<param>`
//! for every parameter or none, and the header keys `batch_divisor`, `clip_stabilizer` and
//! `clipping` that say how the library formed it.

use super::header::positive;
use crate::clipping::Clipping;
use crate::error::{bail, Error, Result};
use crate::factors::Factors;
use crate::io::RawTensor;
use crate::precision::Precision;
use crate::tensors::{has, Floats, TensorSource};
use crate::trace::Trace;
use ndarray::Array1;
use safetensors::SafeTensors;
use std::collections::{HashMap, HashSet};

/// One value per entry of each parameter, in the trace's first-use order, row-major in the
/// parameter's layout, in the dtype the library produced it in.
pub type ParamValues = Vec<(String, Floats)>;

/// A library's DP-SGD step over the trace's (logical) batch.
#[derive(Clone, Debug, PartialEq)]
pub struct StepClaim {
    /// `claimed.clipped_sum.<param>`: Σ_i c_i g_i before noise, as the library holds it.
    pub clipped_sum: Option<ParamValues>,
    /// `claimed.update.<param>`: the noisy sum divided by `batch_divisor`.
    pub update: Option<ParamValues>,
    /// What the library says it divides the noisy sum by (required with `update`).
    pub batch_divisor: Option<f64>,
    /// γ in the coefficient (`clip_stabilizer`; Opacus uses 1e-6).
    pub clip_stabilizer: f64,
    /// Whether the coefficient is flat or automatic.
    pub clipping: Clipping,
}

/// The step keys: `claimed.clipped_sum.<param>` and `claimed.update.<param>` for every
/// parameter or none, each with the parameter's number of values, and the header's
/// `batch_divisor`, `clip_stabilizer` and `clipping`. Values may be NaN or infinite: that is the
/// library's defect, judged as a verdict.
pub(super) fn read_step<F: Factors>(
    st: &SafeTensors,
    meta: &HashMap<String, String>,
    trace: &Trace<F>,
    label: &str,
    expected: &mut HashSet<String>,
    done: super::Done,
) -> Result<Option<StepClaim>> {
    let params = trace.params();
    let mut sums = |prefix: &str| -> Result<Option<ParamValues>> {
        let names: Vec<&str> = st
            .names()
            .into_iter()
            .filter_map(|n| n.strip_prefix(prefix))
            .collect();
        if names.is_empty() {
            return Ok(None);
        }
        for n in &names {
            if !params.iter().any(|(p, _)| p == n) {
                bail!("{label}: tensor `{prefix}{n}` names no parameter of the trace's sites");
            }
        }
        params
            .iter()
            .map(|(p, js)| {
                let name = format!("{prefix}{p}");
                if !has(st, &name) {
                    bail!("{label}: tensor `{name}` is missing: `{prefix}*` must cover every parameter");
                }
                expected.insert(name.clone());
                let (rows, cols) = trace.site_gradient_shape(js[0]);
                let (dtype, _, bytes) = st.raw(&name, label)?;
                let v = Floats::decode(dtype, &bytes, &name, label)?;
                done(&name)?;
                if v.len() != rows * cols {
                    bail!(
                        "{label}: `{name}` has {} values; parameter `{p}` has {rows}×{cols}",
                        v.len()
                    );
                }
                Ok((p.clone(), v))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    };
    let clipped_sum = sums("claimed.clipped_sum.")?;
    let update = sums("claimed.update.")?;
    let number = |key: &str| meta.get(key).map(|s| positive(s, key, label)).transpose();
    let batch_divisor = number("batch_divisor")?;
    if batch_divisor == Some(0.0) {
        bail!("{label}: `__metadata__.batch_divisor` must be positive");
    }
    if update.is_some() && batch_divisor.is_none() {
        bail!("{label}: `claimed.update.*` needs `__metadata__.batch_divisor`, the number the library divides the noisy sum by");
    }
    let clip_stabilizer = number("clip_stabilizer")?.unwrap_or(0.0);
    let clipping = match meta.get("clipping") {
        None => Clipping::Flat,
        Some(s) => Clipping::parse(s).ok_or_else(|| {
            Error::new(format!(
                "{label}: `__metadata__.clipping` is {s:?}; expected \"flat\" or \"automatic\""
            ))
        })?,
    };
    if clipped_sum.is_none() && update.is_none() {
        return Ok(None);
    }
    Ok(Some(StepClaim {
        clipped_sum,
        update,
        batch_divisor,
        clip_stabilizer,
        clipping,
    }))
}

/// The step's tensors, each in its values' own dtype, and its header keys.
pub(super) fn write_step(
    step: &StepClaim,
    raw: &mut Vec<(String, RawTensor)>,
    meta: &mut HashMap<String, String>,
) {
    for (prefix, sums) in [
        ("claimed.clipped_sum.", &step.clipped_sum),
        ("claimed.update.", &step.update),
    ] {
        for (p, v) in sums.iter().flatten() {
            // In the values' own dtype: widening them was exact, so rounding back is too.
            let precision = match v {
                Floats::F64(_) => Precision::F64,
                Floats::F32(_) => Precision::F32,
                Floats::F16(_) => Precision::F16,
                Floats::Bf16(_) => Precision::BF16,
            };
            let v = Array1::from(v.to_f64_vec()).into_dyn();
            raw.push((
                format!("{prefix}{p}"),
                RawTensor::from_f64(&v.view(), precision),
            ));
        }
    }
    if let Some(d) = step.batch_divisor {
        meta.insert("batch_divisor".to_string(), format!("{d:e}"));
    }
    meta.insert(
        "clip_stabilizer".to_string(),
        format!("{:e}", step.clip_stabilizer),
    );
    meta.insert("clipping".to_string(), step.clipping.name().to_string());
}
