//! The step's noise: per tensor r = u·D − K against N(0, σ²C²) per entry where the clipped sum K
//! is given, and without it the update decomposed against the batch's gradients (signal and
//! noise told apart by G). Then what too little noise on a tensor costs each example.

use super::divisor::DivisorCheck;
use super::sum::sums;
use crate::error::Result;
use crate::judge::numeric::{bilinear, ratio, GramSolver};
use crate::judge::truth::Truth;
use crate::judge::verdict::Verdict;
use ghost_oracle_reference::Factors;
use ghost_oracle_reference::Floats;
use serde::Serialize;
use std::fmt;

/// The family-wise false-alarm rate of the noise test over one step's tensors.
const NOISE_ALPHA: f64 = 1e-6;

/// What a noise check measures: one parameter tensor, or the whole update at once.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NoiseScope {
    /// One parameter tensor, by name.
    Tensor(String),
    /// Every tensor of the update together.
    Whole,
}

impl fmt::Display for NoiseScope {
    /// "`name`" for a tensor, "the whole update" for the whole.
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            NoiseScope::Tensor(name) => write!(f, "`{name}`"),
            NoiseScope::Whole => f.write_str("the whole update"),
        }
    }
}

/// The noise of one parameter tensor (or of the whole update): r = u·D − K, whose squared norm
/// over (σC)² is χ² with as many degrees of freedom as the tensor has entries when the library
/// added N(0, σ²C²) to each.
#[derive(Clone, Debug, Serialize)]
pub struct NoiseCheck {
    /// The tensor checked, or the whole update.
    pub scope: NoiseScope,
    /// Entries of the tensor: χ²'s degrees of freedom.
    pub entries: usize,
    /// ‖r‖² / (σC)².
    pub chi2: f64,
    /// The acceptance interval of χ² at the step's false-alarm rate (Laurent–Massart).
    pub low: f64,
    /// Upper end of the acceptance interval.
    pub high: f64,
    /// σ̂ / σ = √(χ² / entries): the noise the tensor got, in units of the stated.
    pub sigma_ratio: f64,
    /// Whether the noise is within the acceptance interval.
    pub verdict: Verdict,
}

/// An update under noise without its clipped sum: signal and noise told apart by the batch's own
/// gradients. ĉ = G⁺b (b_i = ⟨g*_i, u·D⟩) has mean c* and covariance σ²C²G⁻¹ for a correct
/// update, so (ĉ − c*)ᵀG(ĉ − c*)/(σC)² is χ² with rank(G) degrees of freedom; what is left,
/// u·D − Σ ĉ_i g*_i, is the noise with those directions projected out, χ² with N − rank(G).
#[derive(Clone, Debug, Serialize)]
pub struct NoisyUpdateCheck {
    /// ĉ_i, the coefficients the update implies, recovered with the true gradients.
    pub implied_coefficients: Vec<f64>,
    /// (ĉ − c*)ᵀG(ĉ − c*)/(σC)², its degrees of freedom and its acceptance interval.
    pub chi2: f64,
    /// Degrees of freedom of `chi2`.
    pub dof: usize,
    /// Upper end of `chi2`'s acceptance interval.
    pub high: f64,
    /// The smallest error of the clipped signal this test can see from one update, as a
    /// fraction of ‖S*‖: σC·√high / ‖S*‖. Under σ ≈ 1 a few-percent signal error hides here.
    pub smallest_visible: Option<f64>,
    /// The residual noise over the whole update.
    pub residual: NoiseCheck,
    /// Whether the implied coefficients and the residual noise pass.
    pub verdict: Verdict,
    /// Reported once, in the step's `divisor`.
    #[serde(skip)]
    pub(super) divisor: Option<DivisorCheck>,
}

/// Laurent and Massart's bounds for χ²_N: P(χ² ≥ N + 2√(Nx) + 2x) ≤ e⁻ˣ and
/// P(χ² ≤ N − 2√(Nx)) ≤ e⁻ˣ, exact for every N; x = ln(2m/α) makes the two-sided test over m
/// tensors (and their total) family-wise α.
fn chi2_interval(entries: usize, tests: usize) -> (f64, f64) {
    let n = entries as f64;
    let x = (2.0 * tests as f64 / NOISE_ALPHA).ln();
    (
        (n - 2.0 * (n * x).sqrt()).max(0.0),
        n + 2.0 * (n * x).sqrt() + 2.0 * x,
    )
}

/// A χ² of noise with `dof` degrees of freedom against its interval: below it less noise than
/// stated (the stated σ no longer buys the stated ε), above it more.
fn noise_check(scope: NoiseScope, dof: usize, chi2: f64, tests: usize) -> NoiseCheck {
    let (low, high) = chi2_interval(dof, tests);
    let verdict = if !chi2.is_finite() {
        Verdict::InvalidNorm
    } else if chi2 < low {
        Verdict::PrivacyViolation
    } else if chi2 > high {
        Verdict::UtilityDistortion
    } else {
        Verdict::Pass
    };
    NoiseCheck {
        scope,
        entries: dof,
        chi2,
        low,
        high,
        sigma_ratio: (chi2 / dof.max(1) as f64).sqrt(),
        verdict,
    }
}

/// The noise of every tensor, u·D − K, then of the whole update.
pub(super) fn noise_checks(
    update: &[(String, Floats)],
    clipped_sum: &[(String, Floats)],
    divisor: f64,
    sigma_c: f64,
) -> Vec<NoiseCheck> {
    let tests = update.len() + 1;
    let check = |scope: NoiseScope, entries: usize, sq: f64| {
        noise_check(scope, entries, sq / (sigma_c * sigma_c), tests)
    };
    let mut out: Vec<NoiseCheck> = update
        .iter()
        .map(|(p, u)| {
            let k = &clipped_sum
                .iter()
                .find(|(q, _)| q == p)
                .expect("the reader gives both sums for every parameter")
                .1;
            let mut sq = 0.0;
            u.zip_chunks(k, |u, k| {
                sq += u
                    .iter()
                    .zip(k)
                    .map(|(u, k)| (u * divisor - k).powi(2))
                    .sum::<f64>();
            });
            check(NoiseScope::Tensor(p.clone()), u.len(), sq)
        })
        .collect();
    let (entries, sq) = out.iter().fold((0, 0.0), |(n, s), c| {
        (n + c.entries, s + c.chi2 * sigma_c * sigma_c)
    });
    out.push(check(NoiseScope::Whole, entries, sq));
    out
}

/// The update under noise, decomposed against the batch's gradients (see [`NoisyUpdateCheck`]).
pub(super) fn check_noisy_update<F: Factors>(
    update: &[(String, Floats)],
    divisor: f64,
    truth: &Truth<F>,
    coefs: &[f64],
    sigma_c: f64,
) -> Result<NoisyUpdateCheck> {
    let gram = &truth.gram;
    let s = sums(truth, coefs, update, divisor, None)?;
    let solver = GramSolver::new(gram);
    let implied = solver.solve(&s.b);
    let rank = solver.rank();
    let diff: Vec<f64> = implied.iter().zip(coefs).map(|(a, b)| a - b).collect();
    let chi2 = bilinear(gram, &diff, &diff) / (sigma_c * sigma_c);
    let tests = 2;
    let (_, high) = chi2_interval(rank, tests);
    let explained: f64 = implied.iter().zip(&s.b).map(|(ci, bi)| ci * bi).sum();
    let residual2 = (s.x2 - 2.0 * explained + bilinear(gram, &implied, &implied)).max(0.0);
    let entries: usize = update.iter().map(|(_, v)| v.len()).sum();
    let dof = entries.saturating_sub(rank);
    let residual = noise_check(
        NoiseScope::Whole,
        dof,
        residual2 / (sigma_c * sigma_c),
        tests,
    );
    // ĉ = (D/D')(c* + G⁻¹⟨g, n⟩): its projection on c* in G's metric reads D/D', to within
    // σC/‖S*‖ (one standard deviation).
    let signal2 = bilinear(gram, coefs, coefs);
    let along = bilinear(gram, &implied, coefs);
    let divisor = DivisorCheck::new(
        divisor,
        divisor * signal2 / along,
        sigma_c / signal2.sqrt(),
        coefs.len(),
    );
    let signal = if !chi2.is_finite() {
        Verdict::InvalidNorm
    } else if chi2 > high {
        Verdict::UtilityDistortion
    } else {
        Verdict::Pass
    };
    Ok(NoisyUpdateCheck {
        implied_coefficients: implied,
        chi2,
        dof: rank,
        high,
        smallest_visible: ratio(sigma_c * high.sqrt(), s.ref2.sqrt()),
        verdict: signal.max(residual.verdict),
        residual,
        divisor,
    })
}

/// (scope, f) for every noise measured: 1 where its χ² is consistent with the stated σ or
/// above, else the low end of σ_p / σ, √(χ²_p / high_p). An update judged without its clipped
/// sum measures the noise over the whole update at once.
pub(super) fn noise_fractions(
    noise: &[NoiseCheck],
    noisy_update: Option<&NoisyUpdateCheck>,
) -> Vec<(NoiseScope, f64)> {
    noise
        .iter()
        .chain(noisy_update.map(|n| &n.residual))
        .map(|n| {
            let f = if n.chi2 < n.low {
                (n.chi2 / n.high).sqrt()
            } else {
                1.0
            };
            (n.scope.clone(), f)
        })
        .collect()
}

/// √(Σ_p w_ip / f_p²), w_ip = ‖g*_{i,p}‖² / ‖g*_i‖²: how much an example's privacy loss grows
/// when tensor p gets σ f_p instead of σ. Where no single tensor shows too little noise, every
/// tensor takes the whole update's fraction (1 when it passes); a tensor measured only within
/// the whole takes the whole's; a truth without per-tensor norms, the smallest fraction.
pub(super) fn spread_over_tensors<F: Factors>(
    truth: &Truth<F>,
    i: usize,
    fractions: &[(NoiseScope, f64)],
    least: f64,
) -> f64 {
    let whole = fractions
        .iter()
        .find(|(s, _)| *s == NoiseScope::Whole)
        .map_or(least, |(_, f)| *f);
    let some_tensor_low = fractions
        .iter()
        .any(|(s, f)| matches!(s, NoiseScope::Tensor(_)) && *f < 1.0);
    let total: f64 = truth.param_sq.iter().map(|(_, v)| v[i]).sum();
    if truth.param_sq.is_empty() || total <= 0.0 {
        return 1.0 / least;
    }
    let weighted: f64 = truth
        .param_sq
        .iter()
        .map(|(p, v)| {
            let own = fractions
                .iter()
                .find(|(s, _)| matches!(s, NoiseScope::Tensor(q) if q == p));
            let f = match own {
                Some((_, f)) if some_tensor_low => *f,
                // Jointly too little noise that no one tensor shows is too little on each.
                Some(_) | None => whole,
            };
            v[i] / total / (f * f)
        })
        .sum();
    weighted.sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A parameter named `all` is one tensor, never the whole update: jointly too little noise
    /// (half of σ over the whole update) that no single tensor shows is too little on each,
    /// `all` included, so an example split evenly between the two tensors contributes
    /// √(½/½² + ½/½²) = 2 times its clipped contribution.
    #[test]
    fn a_tensor_named_all_is_not_the_whole_update() {
        let truth: Truth = Truth {
            norms: vec![1.0],
            gram: vec![vec![1.0]],
            cross_share: vec![None],
            factors: None,
            param_sq: vec![("all".into(), vec![0.5]), ("w".into(), vec![0.5])],
        };
        let fractions = [
            (NoiseScope::Tensor("all".into()), 1.0),
            (NoiseScope::Tensor("w".into()), 1.0),
            (NoiseScope::Whole, 0.5),
        ];
        assert_eq!(spread_over_tensors(&truth, 0, &fractions, 0.5), 2.0);
        // Too little noise on `all` alone: only its share is weighed up, √(½/¼ + ½).
        let fractions = [
            (NoiseScope::Tensor("all".into()), 0.5),
            (NoiseScope::Tensor("w".into()), 1.0),
            (NoiseScope::Whole, 0.9),
        ];
        let f = spread_over_tensors(&truth, 0, &fractions, 0.5);
        assert!((f - 2.5f64.sqrt()).abs() < 1e-15, "{f}");
    }

    #[test]
    fn the_whole_update_and_a_tensor_serialize_apart() {
        let tensor = serde_json::to_value(NoiseScope::Tensor("all".into())).unwrap();
        let whole = serde_json::to_value(NoiseScope::Whole).unwrap();
        assert_eq!(tensor, serde_json::json!({"tensor": "all"}));
        assert_eq!(whole, serde_json::json!("whole"));
    }
}
