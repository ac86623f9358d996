//! The values a user chooses, each validated once, in its type: the clipping norm C, the noise
//! multiplier σ, the DP-SGD run an ε speaks of, and an ε budget. The CLI and the Python package
//! build these from their flags or arguments; the library takes only these types, so no
//! function deeper in can be handed a C ≤ 0 or a NaN.
//!
//! An [`OptionError`] names the [`Field`] that was wrong, not a flag: each front end words it
//! with its own name for the field (`--max-grad-norm`, `max_grad_norm`).

use crate::accountant::{self, AccountingError};
use serde::Serialize;
use std::fmt;

/// A value a user sets, as the library knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Field {
    /// C, the clipping norm.
    MaxGradNorm,
    /// σ, the noise multiplier.
    NoiseMultiplier,
    /// q, the Poisson sampling rate.
    SamplingRate,
    /// Number of DP-SGD steps.
    Steps,
    /// Passes over the dataset (instead of steps).
    Epochs,
    /// N, the number of examples in the dataset.
    DatasetSize,
    /// δ of the (ε, δ) guarantee.
    Delta,
    /// The largest ε a gate accepts.
    MaxEpsilon,
}

/// A chosen value that cannot be used, with the field it belongs to.
#[derive(Clone, Debug, PartialEq)]
pub struct OptionError {
    /// The value that was wrong.
    pub field: Field,
    problem: Problem,
}

#[derive(Clone, Debug, PartialEq)]
enum Problem {
    /// "must be {expected}, got {got}".
    Expected { expected: &'static str, got: String },
    /// The accountant's own words on the value.
    Accounting(AccountingError),
}

impl OptionError {
    fn expected(field: Field, expected: &'static str, got: impl fmt::Display) -> Self {
        OptionError {
            field,
            problem: Problem::Expected {
                expected,
                got: got.to_string(),
            },
        }
    }

    /// The message, with the field called `name` (a flag or an argument name).
    pub fn message(&self, name: &str) -> String {
        match &self.problem {
            Problem::Expected { expected, got } => format!("{name} must be {expected}, got {got}"),
            Problem::Accounting(e) => format!("{name}: {e}"),
        }
    }
}

/// The clipping norm C: positive and finite.
#[derive(Clone, Copy, Debug, PartialEq, PartialOrd, Serialize)]
#[serde(transparent)]
pub struct ClipNorm(f64);

impl ClipNorm {
    /// C, refused unless positive and finite.
    pub fn new(c: f64) -> Result<Self, OptionError> {
        if c.is_finite() && c > 0.0 {
            Ok(ClipNorm(c))
        } else {
            Err(OptionError::expected(
                Field::MaxGradNorm,
                "a positive number",
                c,
            ))
        }
    }

    /// C as a number.
    pub fn get(self) -> f64 {
        self.0
    }
}

/// The noise multiplier σ: finite and non-negative. σ = 0 is allowed (a run without noise can
/// still be audited for its norms), but it buys no privacy.
#[derive(Clone, Copy, Debug, PartialEq, PartialOrd, Serialize)]
#[serde(transparent)]
pub struct NoiseMultiplier(f64);

impl NoiseMultiplier {
    /// σ, refused unless non-negative and finite.
    pub fn new(sigma: f64) -> Result<Self, OptionError> {
        if sigma.is_finite() && sigma >= 0.0 {
            Ok(NoiseMultiplier(sigma))
        } else {
            Err(OptionError::expected(
                Field::NoiseMultiplier,
                "a non-negative number",
                sigma,
            ))
        }
    }

    /// σ = 1, when neither the user nor the trace states one.
    pub const ONE: NoiseMultiplier = NoiseMultiplier(1.0);

    /// σ as a number.
    pub fn get(self) -> f64 {
        self.0
    }
}

/// An ε budget for a gate: a positive number (+∞ allowed: no budget).
#[derive(Clone, Copy, Debug, PartialEq, PartialOrd)]
pub struct EpsilonBudget(f64);

impl EpsilonBudget {
    /// A budget, refused unless positive (NaN included).
    pub fn new(e: f64) -> Result<Self, OptionError> {
        if e > 0.0 {
            Ok(EpsilonBudget(e))
        } else {
            Err(OptionError::expected(
                Field::MaxEpsilon,
                "a positive number",
                e,
            ))
        }
    }

    /// The budget as a number.
    pub fn get(self) -> f64 {
        self.0
    }
}

/// The run an ε speaks of: Poisson sampling rate q, number of steps, and δ. Built only by
/// [`AccountingRequest::resolve`] or [`Accounting::typical`], so the accountant accepts it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Accounting {
    /// q, the Poisson sampling rate, in (0, 1].
    pub sampling_rate: f64,
    /// Number of DP-SGD steps.
    pub steps: u64,
    /// δ of the (ε, δ) guarantee.
    pub delta: f64,
    /// No accounting option was given: this is the typical fine-tuning run.
    pub default_setting: bool,
}

impl Accounting {
    /// A typical fine-tuning run, shown when the user names none: q = 0.01, 1000 steps, δ = 1e-5.
    pub fn typical() -> Self {
        Accounting {
            sampling_rate: 0.01,
            steps: 1000,
            delta: 1e-5,
            default_setting: true,
        }
    }
}

/// The accounting a user asked for: any of q, the steps (or epochs over a dataset size) and δ;
/// what is left out comes from the typical run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AccountingRequest {
    /// q, the Poisson sampling rate.
    pub sampling_rate: Option<f64>,
    /// Signed, so that a negative count from a front end without unsigned integers is refused
    /// here rather than wrapped.
    pub steps: Option<i64>,
    /// Epochs instead of steps: steps = ⌈epochs × ⌈N / round(q·N)⌉⌉ (needs `dataset_size`).
    pub epochs: Option<f64>,
    /// N, the number of examples in the dataset (for `epochs`).
    pub dataset_size: Option<i64>,
    /// δ of the (ε, δ) guarantee.
    pub delta: Option<f64>,
}

impl AccountingRequest {
    /// The run, checked before any work is done.
    pub fn resolve(&self) -> Result<Accounting, OptionError> {
        let typical = Accounting::typical();
        let q = self.sampling_rate.unwrap_or(typical.sampling_rate);
        let steps = match (self.steps, self.epochs, self.dataset_size) {
            (Some(_), Some(_), _) => {
                return Err(OptionError::expected(
                    Field::Epochs,
                    "left out when the steps are given",
                    "both",
                ))
            }
            (Some(s), None, _) => {
                Some(u64::try_from(s).ok().filter(|&s| s > 0).ok_or_else(|| {
                    OptionError::expected(Field::Steps, "a positive number of DP-SGD steps", s)
                })?)
            }
            (None, Some(e), Some(n)) => {
                if !(e.is_finite() && e > 0.0) {
                    return Err(OptionError::expected(Field::Epochs, "a positive number", e));
                }
                if n < 1 {
                    return Err(OptionError::expected(Field::DatasetSize, "at least 1", n));
                }
                let batch = (q * n as f64).round().max(1.0);
                Some((e * (n as f64 / batch).ceil()).ceil() as u64)
            }
            (None, Some(_), None) => {
                return Err(OptionError::expected(
                    Field::DatasetSize,
                    "given with the epochs",
                    "none",
                ))
            }
            (None, None, Some(_)) => {
                return Err(OptionError::expected(
                    Field::Epochs,
                    "given with the dataset size",
                    "none",
                ))
            }
            (None, None, None) => None,
        };
        let given = self.sampling_rate.is_some() || steps.is_some() || self.delta.is_some();
        let setting = Accounting {
            sampling_rate: q,
            steps: steps.unwrap_or(typical.steps),
            delta: self.delta.unwrap_or(typical.delta),
            default_setting: !given,
        };
        accountant::epsilon(
            setting.sampling_rate,
            1.0,
            setting.steps,
            setting.delta,
            &accountant::default_orders(),
        )
        .map_err(|e| OptionError {
            field: match e {
                AccountingError::SamplingRate(_) => Field::SamplingRate,
                AccountingError::Delta(_) => Field::Delta,
                AccountingError::NoSteps => Field::Steps,
                // σ = 1 and the default orders are the library's own: only q, δ and the steps
                // come from the user.
                AccountingError::NoiseMultiplier(_)
                | AccountingError::Order(_)
                | AccountingError::NoOrders
                | AccountingError::TargetEpsilon(_)
                | AccountingError::Unreachable { .. } => Field::SamplingRate,
            },
            problem: Problem::Accounting(e),
        })?;
        Ok(setting)
    }
}
