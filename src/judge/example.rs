//! One example's figures: its norm against the truth, its coefficient and its clipped
//! contribution. A leaf: the case's metrics gather them, and the step reads the rounding bounds
//! and contributions they hold.

use serde::Serialize;

/// One example of a case: the clipper's claim for it against the truth.
#[derive(Clone, Debug, Serialize)]
pub struct ExampleMetrics {
    /// n*_i, from the f64 reference.
    pub true_norm: f64,
    /// n_i, as the clipper claims it.
    pub norm: f64,
    /// |n_i − n*_i| / n*_i (infinite where it is undefined).
    pub norm_rel_err: f64,
    /// The rounding bound on `norm_rel_err` at the clipper's precision, the model's own rounding
    /// included.
    pub bound: f64,
    /// Whether `bound` is the figure: false where the tolerance's statistics were left as
    /// bounds because both ends gave this example the same verdict; `bound` is then the end
    /// that puts `err_units` on the verdict's side of the exact figure: the lower end for an
    /// example within it (its `err_units` at least the exact one), the upper for one beyond it
    /// (docs/tolerances.md, "Statistics deferred until a verdict needs them").
    pub bound_exact: bool,
    /// The part of `bound` that is the model's own rounding (the trace's `model.rounding`, times
    /// `MODEL_ROUNDING_FACTOR`, over n*_i); 0 without it.
    pub model_rounding: f64,
    /// The largest clipped contribution, in units of C, of a claim within the bound: the clipper's
    /// rule applied to n*_i·(1 − bound). Above 1 + δ the example cannot be judged.
    pub allowed_contribution: f64,
    /// norm_rel_err / bound.
    pub err_units: f64,
    /// c_i, the clipper's clipping coefficient, and c*_i from the true norm by the same rule.
    pub coefficient: f64,
    /// c*_i, from n*_i by the clipper's rule.
    pub true_coefficient: f64,
    /// c_i n*_i / C: the example's clipped contribution in units of C.
    pub sensitivity: f64,
    /// The clipping decision differs: (n_i clipped) ≠ (n*_i clipped).
    pub flipped: bool,
    /// 2⟨g_in, g_out⟩ / ‖g*‖²; `null` where the true gradient is zero.
    pub cross_share: Option<f64>,
    /// The norm or coefficient is NaN, infinite, or negative beyond rounding.
    pub invalid: bool,
    /// The bound is tight enough to judge the norm: at most the tolerance's `judgeable_bound` (a
    /// tenth of the norm), and no claim within it clips the example above C·(1 + δ)
    /// (`allowed_contribution`).
    pub judgeable: bool,
}
