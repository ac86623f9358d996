//! What a clipper's norms mean for a DP-SGD run, from the least to the most severe.

use serde::Serialize;

/// What a clipper's claim for a case means for the run, ordered by severity (`Ord`: the
/// most severe of several verdicts is their maximum).
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
    /// Every verdict, from the least to the most severe (the order `Ord` gives).
    pub const ALL: [Verdict; 5] = [
        Verdict::Pass,
        Verdict::UtilityDistortion,
        Verdict::CannotJudge,
        Verdict::PrivacyViolation,
        Verdict::InvalidNorm,
    ];

    /// The verdict's name in reports, the JSON and the Python API.
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

#[cfg(test)]
mod tests {
    use super::Verdict;

    /// `ALL` lists each verdict once, in severity order: a verdict added to the enum and not to
    /// `ALL` shows as a gap here, because `name` (an exhaustive match) would be missing from it.
    #[test]
    fn all_is_every_verdict_in_severity_order() {
        for pair in Verdict::ALL.windows(2) {
            assert!(pair[0] < pair[1], "{:?} before {:?}", pair[0], pair[1]);
        }
        let every = |v: Verdict| match v {
            Verdict::Pass
            | Verdict::UtilityDistortion
            | Verdict::CannotJudge
            | Verdict::PrivacyViolation
            | Verdict::InvalidNorm => Verdict::ALL.contains(&v),
        };
        assert!(Verdict::ALL.iter().all(|&v| every(v)));
        assert_eq!(Verdict::ALL[0], Verdict::Pass);
        assert_eq!(*Verdict::ALL.last().unwrap(), Verdict::InvalidNorm);
    }
}
