//! The floating-point formats ghost-oracle speaks of: how a trace's factors are stored, what a
//! model or a clipper computed in, and what the judge's tolerance assumes. One enum for all of
//! them, so that bf16 and f16 are handled wherever a format is, and a new one is a compile error
//! wherever it is not.

use safetensors::Dtype;
use serde::Serialize;

/// A floating-point format, ordered from the finest unit roundoff to the coarsest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// IEEE binary64.
    F64,
    /// IEEE binary32.
    F32,
    /// IEEE binary16 (half).
    F16,
    /// bfloat16: binary32's exponent range with 8 significand bits.
    BF16,
}

impl Precision {
    /// Every format, finest first.
    pub const ALL: [Precision; 4] = [
        Precision::F64,
        Precision::F32,
        Precision::F16,
        Precision::BF16,
    ];

    /// The name traces, flags and reports use (`f64`, `f32`, `f16`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            Precision::F64 => "f64",
            Precision::F32 => "f32",
            Precision::F16 => "f16",
            Precision::BF16 => "bf16",
        }
    }

    /// The format of a name as [`Precision::name`] writes it.
    pub fn parse(name: &str) -> Option<Self> {
        Precision::ALL.into_iter().find(|p| p.name() == name)
    }

    /// The names, for error messages: "f64, f32, f16, bf16".
    pub fn names() -> String {
        Precision::ALL.map(Precision::name).join(", ")
    }

    /// u = 2⁻ᵖ for a p-bit significand (with the implicit bit).
    pub fn unit_roundoff(self) -> f64 {
        match self {
            Precision::F64 => 2f64.powi(-53),
            Precision::F32 => 2f64.powi(-24),
            Precision::F16 => 2f64.powi(-11),
            Precision::BF16 => 2f64.powi(-8),
        }
    }

    /// The less precise of the two: a result is no better than its coarsest step.
    pub fn coarser(self, other: Precision) -> Precision {
        self.max(other)
    }

    /// `x` rounded to the nearest value of this format (ties to even), as an f64.
    pub fn round(self, x: f64) -> f64 {
        match self {
            Precision::F64 => x,
            Precision::F32 => f64::from(x as f32),
            Precision::F16 => half::f16::from_f64(x).to_f64(),
            Precision::BF16 => half::bf16::from_f64(x).to_f64(),
        }
    }

    /// The format of a stored safetensors dtype; `None` for integers and formats no trace uses.
    pub fn of_stored(d: Dtype) -> Option<Self> {
        match d {
            Dtype::F64 => Some(Precision::F64),
            Dtype::F32 => Some(Precision::F32),
            Dtype::F16 => Some(Precision::F16),
            Dtype::BF16 => Some(Precision::BF16),
            _ => None,
        }
    }

    /// The safetensors dtype a tensor in this format is stored as.
    pub fn stored(self) -> Dtype {
        match self {
            Precision::F64 => Dtype::F64,
            Precision::F32 => Dtype::F32,
            Precision::F16 => Dtype::F16,
            Precision::BF16 => Dtype::BF16,
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
