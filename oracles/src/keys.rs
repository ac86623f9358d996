//! Typed access to the keys of a `config.json`, shared by every family's config, and the limits
//! on the sizes a config may declare.

use crate::error::{bail, Error, Result};
use serde_json::Value;

/// Upper limits on sizes read from a config, so that a hostile or mistyped file cannot make the
/// reference allocate terabytes before any tensor is checked.
pub(crate) const MAX_DIM: usize = 1 << 20;
pub(crate) const MAX_LAYERS: usize = 1024;
pub(crate) const MAX_PARAMS: usize = 1 << 34;

pub(crate) fn check_parameter_count(count: usize) -> Result<()> {
    if count > MAX_PARAMS {
        bail!("the config describes {count} parameters; at most {MAX_PARAMS} are supported");
    }
    Ok(())
}

/// Typed access to the keys of a `config.json`, with Hugging Face's default for an absent (or
/// `null`) key and an error naming the key for a value of the wrong type or range.
pub(crate) struct Keys {
    v: Value,
}

impl Keys {
    pub(crate) fn parse(text: &str) -> Result<Self> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| Error::new(format!("not valid JSON: {e}")))?;
        if !v.is_object() {
            bail!("expected a JSON object");
        }
        Ok(Keys { v })
    }

    /// The key's value; `None` when absent or `null`.
    pub(crate) fn value(&self, key: &str) -> Option<&Value> {
        self.v.get(key).filter(|x| !x.is_null())
    }

    pub(crate) fn usize(&self, key: &str, default: usize) -> Result<usize> {
        self.opt_usize(key).map(|n| n.unwrap_or(default))
    }

    pub(crate) fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.value(key) {
            None => Ok(None),
            Some(x) => match x.as_u64() {
                Some(n) if n >= 1 && n as usize <= MAX_DIM => Ok(Some(n as usize)),
                _ => bail!("`{key}` must be an integer in 1..={MAX_DIM}, found {x}"),
            },
        }
    }

    pub(crate) fn layers(&self, key: &str, default: usize) -> Result<usize> {
        let n = self.usize(key, default)?;
        if n > MAX_LAYERS {
            bail!("`{key}` is {n}; at most {MAX_LAYERS} are supported");
        }
        Ok(n)
    }

    pub(crate) fn bool(&self, key: &str, default: bool) -> Result<bool> {
        match self.value(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(x) => bail!("`{key}` must be true or false, found {x}"),
        }
    }

    /// A finite number > 0.
    pub(crate) fn positive(&self, key: &str, default: f64) -> Result<f64> {
        match self.value(key) {
            None => Ok(default),
            Some(x) => positive_number(x)
                .ok_or_else(|| Error::new(format!("`{key}` must be a positive number, found {x}"))),
        }
    }
}

impl Keys {
    /// The key's value as written, `null` included; `None` when absent.
    pub(crate) fn v_raw(&self, key: &str) -> Option<&Value> {
        self.v.get(key)
    }

    /// A finite number > 0 that may be `null` (off): `default` when the key is absent, `None`
    /// when it is `null`.
    pub(crate) fn nullable_positive(&self, key: &str, default: Option<f64>) -> Result<Option<f64>> {
        match self.v.get(key) {
            None => Ok(default),
            Some(Value::Null) => Ok(None),
            Some(x) => positive_number(x).map(Some).ok_or_else(|| {
                Error::new(format!(
                    "`{key}` must be a positive number or null, found {x}"
                ))
            }),
        }
    }

    /// A size that may be `null`, with the same absent / `null` rule as
    /// [`Keys::nullable_positive`].
    pub(crate) fn nullable_usize(
        &self,
        key: &str,
        default: Option<usize>,
    ) -> Result<Option<usize>> {
        match self.v.get(key) {
            None => Ok(default),
            Some(Value::Null) => Ok(None),
            Some(_) => self.opt_usize(key),
        }
    }
}

pub(crate) fn positive_number(x: &Value) -> Option<f64> {
    x.as_f64().filter(|e| e.is_finite() && *e > 0.0)
}
