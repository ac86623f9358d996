//! The judge: the truth of a case, the tolerance that separates rounding from bugs, the metrics
//! and the verdict.
//!
//! Everything here is computed from the reference side (the f64 trace and the materialized
//! norms); a clipper contributes only its [`Claim`]. No module of the judge imports clipper,
//! Gram-kernel or mutant code, and no candle type reaches it (`tests/layout.rs` checks the
//! imports), so no bug planted in a clipper can move a bound.

mod example;
mod inner;
mod metrics;
mod numeric;
mod privacy;
mod step;
mod tolerance;
mod truth;
mod verdict;

pub use example::ExampleMetrics;
pub use metrics::{evaluate, CaseLabel, CaseMetrics, Claim, ClippingRule};
pub(crate) use numeric::nan_max;
pub use privacy::PrivacyReport;
pub use step::{
    evaluate_step, DivisorCheck, NoiseCheck, NoiseScope, NoisyUpdateCheck, StepJudge, StepMetrics,
    SumCheck, SumKind,
};
pub use tolerance::{
    contribution_slack, Arithmetic, ModelRounding, Precision, TermRoute, Tolerance,
    JUDGEABLE_BOUND, MODEL_ROUNDING_FACTOR,
};
pub use truth::{GramRoute, Truth};
pub use verdict::Verdict;

use crate::error::{Error, Result};
use crate::options::{ClipNorm, NoiseMultiplier};
use ghost_oracle_reference::{Factors, Reference, Trace};
use metrics::SumError;
use ndarray::Array3;

/// The truth and the tolerance of one batch: all a verdict needs besides the claim.
#[derive(Clone, Debug)]
pub struct Judge<F = Array3<f64>> {
    /// The case's f64 truth: norms, Gram and factors (held as `F`: f64 for the reference's own
    /// traces, as stored for a trace file's).
    pub truth: Truth<F>,
    /// The rounding bounds at the clipper's precision.
    pub tolerance: Tolerance,
}

impl Judge {
    /// From a reference run that recorded its trace (its gradients need not be kept: the
    /// judge rebuilds what it needs of them from the trace).
    pub fn from_reference(r: Reference) -> Result<Self> {
        let trace = r
            .trace
            .as_ref()
            .ok_or_else(|| Error::internal("reference ran without a trace"))?;
        let tolerance = Tolerance::from_trace(trace)?;
        Ok(Judge {
            truth: Truth::from_reference(r)?,
            tolerance,
        })
    }
}

impl<F: Factors> Judge<F> {
    /// From a trace alone: every site's gradient materialized in f64, a block at a time.
    pub fn from_trace(trace: Trace<F>) -> Result<Self> {
        Self::from_trace_with_progress(trace, &|_, _, _| {})
    }

    /// [`from_trace`](Self::from_trace), telling `progress(done, total, what)` as each
    /// parameter's truth is taken (minutes at a 1B-class trace).
    pub fn from_trace_with_progress(
        trace: Trace<F>,
        progress: &dyn Fn(usize, usize, &str),
    ) -> Result<Self> {
        let tolerance = Tolerance::from_trace(&trace)?;
        Ok(Judge {
            truth: Truth::from_trace_with_progress(trace, progress)?,
            tolerance,
        })
    }

    /// [`from_trace_with_progress`](Self::from_trace_with_progress) with the tolerance's costliest
    /// statistics deferred until a verdict needs them ([`Tolerance::from_trace_deferring`]): the
    /// truth first, whose per-parameter ‖g*_{i,p}‖² give the lower ends, then the tolerance.
    /// The verdicts are those of the exact tolerance ([`evaluate`] takes the figures of every
    /// example the two ends do not settle); a step cannot be judged on it
    /// ([`Judge::judge_step`] refuses).
    pub fn from_trace_deferring(
        trace: Trace<F>,
        progress: &dyn Fn(usize, usize, &str),
    ) -> Result<Self> {
        let truth = Truth::from_trace_with_progress(trace, progress)?;
        let factors = truth
            .factors
            .as_ref()
            .ok_or_else(|| Error::internal("a truth from a trace keeps its factors"))?;
        let mut own_sq: Vec<Option<&[f64]>> = vec![None; factors.sites.len()];
        for ((param, js), (name, sq)) in factors.params().iter().zip(&truth.param_sq) {
            if param != name {
                return Err(Error::internal(format!(
                    "the truth's parameter `{name}` where the trace lists `{param}`"
                )));
            }
            if let [j] = js.as_slice() {
                own_sq[*j] = Some(sq);
            }
        }
        let tolerance = Tolerance::from_trace_deferring(factors, &own_sq)?;
        Ok(Judge { truth, tolerance })
    }

    /// The metrics and verdict of a claim at clipping norm C and noise multiplier σ, for a
    /// clipper computing in `precision`.
    pub fn evaluate(
        &self,
        case: impl Into<CaseLabel>,
        claim: &Claim,
        max_grad_norm: ClipNorm,
        noise_multiplier: NoiseMultiplier,
        precision: Precision,
    ) -> Result<CaseMetrics> {
        let arithmetic = Arithmetic::of(precision, self.tolerance.own.len());
        self.evaluate_at(case, claim, max_grad_norm, noise_multiplier, &arithmetic)
    }

    /// Judges the step a case's clipper took and folds it into the case: the verdict, and the
    /// privacy it spends (a step that is off spends it by the contributions it implies, each
    /// weighed by the noise its tensors got: [`StepMetrics::contributions`]).
    pub fn judge_step(
        &self,
        metrics: &mut CaseMetrics,
        step: &ghost_oracle_reference::StepClaim,
        max_grad_norm: ClipNorm,
        noise_multiplier: NoiseMultiplier,
        arithmetic: &Arithmetic,
    ) -> Result<()> {
        self.fold_step(
            metrics,
            step,
            max_grad_norm,
            noise_multiplier,
            arithmetic,
            None,
        )
    }

    /// [`Judge::judge_step`] for a case evaluated from a claim without its clipped sum, when the
    /// step carries it: the sum is also compared with Σ ĉ_i g_i* at the clipper's own
    /// coefficients, as [`Judge::evaluate`] compares a claim's, from the same rebuilt gradients
    /// as the step's check at the true coefficients. Rebuilding every example's gradient once
    /// instead of twice is ~25 s a clipper at 1 B parameters and B = 4.
    pub fn judge_step_with_sum(
        &self,
        metrics: &mut CaseMetrics,
        step: &ghost_oracle_reference::StepClaim,
        max_grad_norm: ClipNorm,
        noise_multiplier: NoiseMultiplier,
        arithmetic: &Arithmetic,
    ) -> Result<()> {
        let coefs = Some(metrics.coefficients_for_sum());
        self.fold_step(
            metrics,
            step,
            max_grad_norm,
            noise_multiplier,
            arithmetic,
            coefs,
        )
    }

    /// The step judged and folded in as [`Judge::judge_step`] says, after, with
    /// `claimed_coefficients`, the clipped sum's error at them (as [`Judge::evaluate`] records
    /// it).
    fn fold_step(
        &self,
        metrics: &mut CaseMetrics,
        step: &ghost_oracle_reference::StepClaim,
        max_grad_norm: ClipNorm,
        noise_multiplier: NoiseMultiplier,
        arithmetic: &Arithmetic,
        claimed_coefficients: Option<Vec<f64>>,
    ) -> Result<()> {
        // The step's checks read every example's bound as a figure.
        if let Some(i) = metrics.examples.iter().position(|e| !e.bound_exact) {
            return Err(Error::internal(format!(
                "example {i}'s bound is not exact: a step is judged on a judge built without deferred statistics"
            )));
        }
        let at = StepJudge {
            truth: &self.truth,
            tolerance: &self.tolerance,
            arithmetic,
            examples: &metrics.examples,
            max_grad_norm,
            noise_multiplier,
        };
        let (s, at_claimed) = evaluate_step(&at, step, claimed_coefficients.as_deref())?;
        if let (Some(coefs), Some((err, reference))) = (&claimed_coefficients, at_claimed) {
            metrics.fold_clipped_sum(SumError {
                err,
                reference,
                bound: self.tolerance.clipped_sum_bound_at(coefs, arithmetic),
            });
        }
        metrics.verdict = metrics.verdict.max(s.verdict);
        if s.verdict != Verdict::Pass {
            let implied = s.contributions.iter().copied().fold(0.0, f64::max);
            metrics.worst_contribution = metrics.worst_contribution.map(|w| w.max(implied));
            // One sensitivity: the report's and the ε's.
            metrics.max_sensitivity_ratio = metrics.max_sensitivity_ratio.max(implied);
            metrics.effective_noise_multiplier =
                noise_multiplier.get() / metrics.max_sensitivity_ratio.max(1.0);
        }
        metrics.step = Some(s);
        Ok(())
    }

    /// [`Judge::evaluate`] for a clipper whose arithmetic differs by site (mixed precision).
    pub fn evaluate_at(
        &self,
        case: impl Into<CaseLabel>,
        claim: &Claim,
        max_grad_norm: ClipNorm,
        noise_multiplier: NoiseMultiplier,
        arithmetic: &Arithmetic,
    ) -> Result<CaseMetrics> {
        evaluate(
            case,
            &self.truth,
            &self.tolerance,
            claim,
            max_grad_norm,
            noise_multiplier,
            arithmetic,
        )
    }
}
