//! The rotary parameters of a Llama-shaped config: `rope_theta` + `rope_scaling`
//! (transformers 4) or `rope_parameters` (transformers 5), merged and checked.

use crate::error::{bail, Error, Result};
use crate::keys::{positive_number, Keys, MAX_DIM};
use serde_json::{Map, Value};

/// How the rotary inverse frequencies are adjusted (`rope_scaling` / `rope_parameters`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// `null`, or `rope_type: "default"`.
    None,
    /// `rope_type: "llama3"` (Llama 3.1+): long wavelengths divided by `factor`, short ones kept,
    /// a smooth interpolation in between.
    Llama3 {
        /// How much the long wavelengths are divided by.
        factor: f64,
        /// Wavelengths longer than original context / this are divided by `factor`.
        low_freq_factor: f64,
        /// Wavelengths shorter than original context / this are kept.
        high_freq_factor: f64,
        /// The context length the model was pretrained on.
        original_max_position_embeddings: usize,
    },
}

/// Keys a `rope_scaling` / `rope_parameters` object may hold for each `rope_type`.
const ROPE_COMMON_KEYS: [&str; 3] = ["rope_type", "type", "rope_theta"];
const LLAMA3_KEYS: [&str; 4] = [
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
];

/// `rope_theta` and the scaling, from `rope_theta` + `rope_scaling` (transformers 4) or
/// `rope_parameters` (transformers 5), which must agree where both are given.
pub(crate) fn rope(keys: &Keys, default_theta: f64) -> Result<(f64, RopeScaling)> {
    rope_from(
        default_theta,
        keys.value("rope_theta"),
        [
            ("rope_scaling", keys.value("rope_scaling")),
            ("rope_parameters", keys.value("rope_parameters")),
        ],
    )
}

/// The rope of [`rope`], from a top-level `rope_theta` and rope objects given by name (`null`
/// or absent ones as `None`), merged.
pub(crate) fn rope_from(
    default_theta: f64,
    top_theta: Option<&Value>,
    objects: [(&str, Option<&Value>); 2],
) -> Result<(f64, RopeScaling)> {
    let mut merged: Map<String, Value> = Map::new();
    for (key, v) in objects {
        let Some(v) = v.filter(|v| !v.is_null()) else {
            continue;
        };
        let Some(obj) = v.as_object() else {
            bail!("`{key}` must be an object or null, found {v}");
        };
        for (k, x) in obj {
            if let Some(prev) = merged.get(k) {
                if prev != x {
                    bail!("`rope_scaling.{k}` ({prev}) and `rope_parameters.{k}` ({x}) disagree");
                }
            }
            merged.insert(k.clone(), x.clone());
        }
    }
    let rope_type = match (merged.get("rope_type"), merged.get("type")) {
        (Some(a), Some(b)) if a != b => {
            bail!("`rope_type` ({a}) and `type` ({b}) of the rope parameters disagree")
        }
        (Some(a), _) | (None, Some(a)) => match a.as_str() {
            Some(s) => s.to_string(),
            None => bail!("`rope_type` must be a string, found {a}"),
        },
        (None, None) => "default".to_string(),
    };
    let theta = match (top_theta, merged.get("rope_theta")) {
        (Some(a), Some(b)) if positive_number(a) != positive_number(b) => {
            bail!("`rope_theta` ({a}) and `rope_parameters.rope_theta` ({b}) disagree")
        }
        (Some(x), _) | (None, Some(x)) => positive_number(x).ok_or_else(|| {
            Error::new(format!("`rope_theta` must be a positive number, found {x}"))
        })?,
        (None, None) => default_theta,
    };
    let allowed: &[&str] = match rope_type.as_str() {
        "default" => &[],
        "llama3" => &LLAMA3_KEYS,
        other => bail!(
            "`rope_type` is \"{other}\"; supported: \"default\" (or rope_scaling null) and \"llama3\""
        ),
    };
    for (k, x) in &merged {
        if ROPE_COMMON_KEYS.contains(&k.as_str()) || allowed.contains(&k.as_str()) {
            continue;
        }
        if k == "partial_rotary_factor" && x.as_f64() == Some(1.0) {
            continue;
        }
        bail!("rope parameter `{k}` = {x} is not supported with rope_type \"{rope_type}\"");
    }
    if rope_type == "default" {
        return Ok((theta, RopeScaling::None));
    }
    let num = |k: &str| -> Result<f64> {
        match merged.get(k) {
            None => bail!("rope_type \"llama3\" needs `{k}`"),
            Some(x) => positive_number(x).ok_or_else(|| {
                Error::new(format!(
                    "rope parameter `{k}` must be a positive number, found {x}"
                ))
            }),
        }
    };
    let factor = num("factor")?;
    let low_freq_factor = num("low_freq_factor")?;
    let high_freq_factor = num("high_freq_factor")?;
    if high_freq_factor <= low_freq_factor {
        bail!("rope parameter `high_freq_factor` ({high_freq_factor}) must exceed `low_freq_factor` ({low_freq_factor})");
    }
    let original = num("original_max_position_embeddings")?;
    if original.fract() != 0.0 || original > MAX_DIM as f64 {
        bail!("rope parameter `original_max_position_embeddings` must be an integer in 1..={}, found {original}", MAX_DIM);
    }
    Ok((
        theta,
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: original as usize,
        },
    ))
}
