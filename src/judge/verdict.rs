//! What a clipper's norms mean for a DP-SGD run, from the least to the most severe.

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    /// Every norm within the rounding bound of the truth.
    Pass,
    /// Norms or coefficients off beyond rounding, but no clipped contribution above C: the run
    /// keeps its guarantee and loses signal.
    UtilityDistortion,
    /// The rounding bound at the clipper's precision is too loose to tell a right norm from a
    /// wrong one (over a tenth of some norm): never a pass, since a claim that far off would
    /// pass too.
    CannotJudge,
    /// Some example's clipped contribution exceeds C: the stated noise no longer buys the stated ε.
    PrivacyViolation,
    /// A norm or coefficient is NaN, infinite, or a negative squared norm beyond rounding: the
    /// clipper's output cannot be used at all.
    InvalidNorm,
}

impl Verdict {
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::UtilityDistortion => "utility-distortion",
            Verdict::CannotJudge => "cannot-judge",
            Verdict::PrivacyViolation => "privacy-violation",
            Verdict::InvalidNorm => "invalid-norm",
        }
    }
}
