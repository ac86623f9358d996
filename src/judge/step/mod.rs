//! The DP-SGD step a library applies, judged against the true per-example gradients
//! (docs/tolerances.md, "The step"): its clipped sum before noise, and, without noise, its update
//! times the divisor it states. Both are compared with S* = Σ_i c*_i g_i*, the exact clipped sum,
//! rebuilt from the reference's f64 factors a block of rows at a time; neither is ever
//! materialized per example in full.
//!
//! Where a sum is off, it is decomposed against the batch's own gradients: ĉ = G⁺b with
//! G_ik = ⟨g_i*, g_k*⟩ and b_i = ⟨g_i*, X⟩ are the coefficients the sum implies. That says which
//! examples it dropped or over-weighted (a lost micro-batch: ĉ_i = 0 for its examples), whether
//! any example's contribution exceeds C (ĉ_i n*_i / C > 1), what scale a wrong divisor applied,
//! and how much of X no combination of this batch's gradients explains (another batch's update).

mod divisor;
mod noise;
mod sum;

pub use divisor::DivisorCheck;
pub use noise::{NoiseCheck, NoiseScope, NoisyUpdateCheck};
pub use sum::{SumCheck, SumKind};

use super::example::ExampleMetrics;
use super::tolerance::{Arithmetic, Tolerance};
use super::truth::Truth;
use super::verdict::Verdict;
use crate::error::Result;
use crate::options::{ClipNorm, NoiseMultiplier};
use ghost_oracle_reference::Factors;
use ghost_oracle_reference::StepClaim;
use noise::{check_noisy_update, noise_checks, noise_fractions, spread_over_tensors};
use serde::Serialize;
use sum::{check_sum, ClaimedSum, SumContext};

/// The step's figures and verdict.
#[derive(Clone, Debug, Serialize)]
pub struct StepMetrics {
    /// c*_i from the true norms with the library's clipping rule and stabilizer.
    pub true_coefficients: Vec<f64>,
    /// The clipped sum before noise checked against Σ_i c*_i g_i*, when the trace has it.
    pub clipped_sum: Option<SumCheck>,
    /// Judged as a sum only without noise (σ = 0).
    pub update: Option<SumCheck>,
    /// Under noise with the clipped sum given: per tensor, then over all of them.
    pub noise: Vec<NoiseCheck>,
    /// An update under noise without the clipped sum, judged by its implied coefficients.
    pub noisy_update: Option<NoisyUpdateCheck>,
    /// The update under noise was not judged (no way to separate it was available).
    pub update_not_judged: bool,
    /// The divisor the update implies, when one can be read from it.
    pub divisor: Option<DivisorCheck>,
    /// The least noise, as a fraction of the stated σ, of any tensor: 1 where every tensor's χ²
    /// is consistent with the stated σ or above it; below, the low end of σ_p / σ at the noise
    /// test's confidence, √(χ²_p / high_p).
    pub noise_fraction: f64,
    /// Per example, its contribution to the step in units of what the stated σ and C allow:
    /// √(Σ_p ĉ_i² ‖g*_{i,p}‖² / (f_p² C²)), the Gaussian mechanism with per-tensor noise σ f_p
    /// (diagonal covariance). ĉ_i is the clipper's coefficient, or the high end of the
    /// coefficient the step implies where its sum is off. 1 or below: as private as stated.
    pub contributions: Vec<f64>,
    /// σ / max(1, max_i contribution): the noise multiplier the step acts with.
    pub sigma_eff: f64,
    /// The most severe finding over the step's checks.
    pub verdict: Verdict,
}

/// What a step is judged against: the truth and its tolerance, the clipper's arithmetic, the
/// metrics of its norms (their rounding bounds and contributions), C and σ.
pub struct StepJudge<'a, F = ndarray::Array3<f64>> {
    /// The f64 truth of the batch.
    pub truth: &'a Truth<F>,
    /// The rounding bounds of the clipper's precision.
    pub tolerance: &'a Tolerance,
    /// How the library computed (precision, accumulation).
    pub arithmetic: &'a Arithmetic,
    /// The case's per-example figures (their bounds and contributions).
    pub examples: &'a [ExampleMetrics],
    /// C.
    pub max_grad_norm: ClipNorm,
    /// σ.
    pub noise_multiplier: NoiseMultiplier,
}

/// The step's checks: the clipped sum when given, and the update times its divisor when there
/// is no noise. With `claimed_coefficients`, also the clipped sum's distance from Σ ĉ_i g_i* at
/// those coefficients, ‖X − Σ ĉ_i g_i*‖ and ‖Σ ĉ_i g_i*‖, taken from the same rebuilt gradients
/// as the check at the true coefficients.
pub fn evaluate_step<F: Factors>(
    at: &StepJudge<F>,
    step: &StepClaim,
    claimed_coefficients: Option<&[f64]>,
) -> Result<(StepMetrics, Option<(f64, f64)>)> {
    let c = at.max_grad_norm.get();
    let sigma_c = at.noise_multiplier.get() * c;
    let without_noise = at.noise_multiplier.get() == 0.0;
    let true_coefficients: Vec<f64> = at
        .truth
        .norms
        .iter()
        .map(|&n| step.clipping.coefficient(n, c, step.clip_stabilizer))
        .collect();
    let ctx = SumContext {
        truth: at.truth,
        tolerance: at.tolerance,
        arithmetic: at.arithmetic,
        examples: at.examples,
        true_coefficients: &true_coefficients,
        max_grad_norm: c,
    };
    let (clipped_sum, sum_at_claimed) = match &step.clipped_sum {
        Some(k) => {
            let (check, at_claimed) =
                check_sum(&ctx, &ClaimedSum::clipped_sum(k), claimed_coefficients)?;
            (Some(check), at_claimed)
        }
        None => (None, None),
    };
    let update = match (&step.update, step.batch_divisor) {
        (Some(u), Some(d)) if without_noise => {
            Some(check_sum(&ctx, &ClaimedSum::update(u, d), None)?.0)
        }
        (Some(_), Some(_)) | (Some(_), None) | (None, Some(_)) | (None, None) => None,
    };
    let (noise, noisy_update) = match (&step.update, &step.clipped_sum, step.batch_divisor) {
        (Some(u), Some(k), Some(d)) if !without_noise => (noise_checks(u, k, d, sigma_c), None),
        (Some(u), None, Some(d)) if !without_noise => (
            Vec::new(),
            Some(check_noisy_update(
                u,
                d,
                at.truth,
                &true_coefficients,
                sigma_c,
            )?),
        ),
        _ => (Vec::new(), None),
    };
    let update_not_judged =
        step.update.is_some() && !without_noise && noise.is_empty() && noisy_update.is_none();
    let drawn = true_coefficients.len();
    let divisor = implied_divisor(
        step,
        (update.as_ref(), noisy_update.as_ref()),
        !without_noise,
        sigma_c,
        drawn,
    );
    let mut metrics = StepMetrics {
        true_coefficients,
        clipped_sum,
        update,
        noise,
        noisy_update,
        update_not_judged,
        divisor,
        noise_fraction: 1.0,
        contributions: Vec::new(),
        sigma_eff: at.noise_multiplier.get(),
        verdict: Verdict::Pass,
    };
    metrics.weigh(at);
    Ok((metrics, sum_at_claimed))
}

/// The divisor the update implies: without noise from its signal's scale, under noise from its
/// projection on the clipped sum, or, without one, from its implied coefficients.
fn implied_divisor(
    step: &StepClaim,
    (update, noisy_update): (Option<&SumCheck>, Option<&NoisyUpdateCheck>),
    under_noise: bool,
    sigma_c: f64,
    drawn: usize,
) -> Option<DivisorCheck> {
    match (update, &step.update, &step.clipped_sum, step.batch_divisor) {
        (Some(check), _, _, Some(d)) => check
            .scale
            .and_then(|k| DivisorCheck::new(d, d / k, check.bound.unwrap_or(0.0), drawn)),
        (None, Some(u), Some(k), Some(d)) if under_noise => {
            DivisorCheck::from_clipped_sum(u, k, d, sigma_c, drawn)
        }
        (Some(_), _, _, None) | (None, _, _, _) => noisy_update.and_then(|n| n.divisor.clone()),
    }
}

impl StepMetrics {
    /// The sums that are off in a way that says what the step gave each example: neither
    /// passing, nor with unidentifiable coefficients, nor an update scaled by its divisor (which
    /// scales signal and noise alike).
    fn off_sums(&self) -> Vec<&SumCheck> {
        [&self.clipped_sum, &self.update]
            .into_iter()
            .flatten()
            .filter(|x| x.verdict != Verdict::Pass && !x.singular && !x.scaled_by_divisor())
            .collect()
    }

    /// The noise fraction, each example's contribution weighed by the noise its tensors got,
    /// σ_eff and the verdict, from the checks.
    fn weigh<F: Factors>(&mut self, at: &StepJudge<F>) {
        let c = at.max_grad_norm.get();
        let fractions = noise_fractions(&self.noise, self.noisy_update.as_ref());
        self.noise_fraction = fractions.iter().map(|(_, f)| *f).fold(1.0, f64::min);
        // The coefficients the step acted with: the clipper's where its sum is consistent with
        // them (then c_i n*_i / C is exact), else the high end of those the sum implies.
        let off = self.off_sums();
        let contributions: Vec<f64> = (0..self.true_coefficients.len())
            .map(|i| {
                let (own, claimed) = at
                    .examples
                    .get(i)
                    .map_or((0.0, f64::NAN), |e| (e.sensitivity.max(0.0), e.coefficient));
                let implied = off
                    .iter()
                    .filter(|x| {
                        let spread = x.coefficient_high[i] - x.implied_coefficients[i];
                        let d = (x.implied_coefficients[i] - claimed).abs();
                        d.is_nan() || d > spread
                    })
                    .map(|x| x.coefficient_high[i] * at.truth.norms[i] / c)
                    .fold(own, f64::max);
                implied * spread_over_tensors(at.truth, i, &fractions, self.noise_fraction)
            })
            .collect();
        let worst = contributions.iter().copied().fold(0.0, f64::max);
        self.contributions = contributions;
        self.sigma_eff = at.noise_multiplier.get() / worst.max(1.0);
        self.verdict = [&self.clipped_sum, &self.update]
            .into_iter()
            .flatten()
            .map(|s| s.verdict)
            .chain(self.noise.iter().map(|n| n.verdict))
            .chain(self.noisy_update.iter().map(|n| n.verdict))
            .max()
            .unwrap_or(Verdict::Pass);
    }
}
