//! What a clipper's worst overshoot does to the (ε, δ) a DP-SGD run claims.
//!
//! A clipped contribution of s·C (s > 1) at noise σC is the Gaussian mechanism at noise
//! multiplier σ/s: sensitivity is a worst case over examples and steps, so one example that can
//! overshoot by s at any step makes every step's guarantee that of σ/s.

use crate::accountant::{self, AccountingError};
use crate::options::Accounting;
use ghost_oracle_reference::Precision;
use serde::Serialize;

/// Stated and actual ε of one clipper's run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PrivacyReport {
    /// q, the Poisson sampling rate.
    pub sampling_rate: f64,
    /// Number of DP-SGD steps.
    pub steps: u64,
    /// δ of the (ε, δ) guarantee.
    pub delta: f64,
    /// No accounting option was given: the run is the typical fine-tuning run.
    pub default_setting: bool,
    /// The stated noise multiplier σ.
    pub noise_multiplier: f64,
    /// ε at the stated σ.
    pub stated_epsilon: f64,
    /// The largest clipped contribution max c·n*/C over every case, at least 1 (`null` when a
    /// norm was invalid): what the ε is computed from, whatever the verdict.
    pub worst_contribution: Option<f64>,
    /// Set when any overshoot above C is within the clipper's rounding bound (its verdict is
    /// neither a privacy violation nor an invalid norm): the precision whose rounding would
    /// spend the extra privacy. Used only where the worst contribution exceeds 1.
    pub rounding_at: Option<Precision>,
    /// σ / max(1, worst contribution).
    pub effective_noise_multiplier: Option<f64>,
    /// ε at the effective σ: the guarantee that holds when every step can meet the worst
    /// overshoot. +∞ (`null` in JSON) when a norm was invalid.
    pub actual_epsilon: Option<f64>,
    /// The σ that would keep the stated ε at that overshoot.
    pub sigma_needed: Option<f64>,
    /// The optimal Rényi order of the actual ε, and whether it sits at an end of the grid.
    pub order: f64,
    /// The optimal order is the smallest or the largest of the grid (the ε may be loose).
    pub order_at_grid_edge: bool,
}

impl PrivacyReport {
    /// ε before and after the overshoot. `worst_contribution` is `None` for an invalid norm.
    pub fn new(
        setting: &Accounting,
        noise_multiplier: f64,
        worst_contribution: Option<f64>,
        rounding_at: Option<Precision>,
    ) -> Result<Self, AccountingError> {
        let orders = accountant::default_orders();
        let (q, steps, delta) = (setting.sampling_rate, setting.steps, setting.delta);
        let stated = accountant::epsilon(q, noise_multiplier, steps, delta, &orders)?;
        let overshoot = worst_contribution.map(|s| s.max(1.0));
        let effective = overshoot.map(|s| noise_multiplier / s);
        let actual = effective
            .map(|sigma| accountant::epsilon(q, sigma, steps, delta, &orders))
            .transpose()?;
        // The smallest σ that reaches the stated ε, scaled by the overshoot: at σ' the run
        // behaves as σ'/s. Unreachable only without noise (stated ε = ∞).
        let sigma_needed = match overshoot {
            Some(s) if stated.epsilon.is_finite() => {
                Some(s * accountant::sigma_for_epsilon(q, steps, delta, stated.epsilon, &orders)?)
            }
            _ => None,
        };
        let at = actual.unwrap_or(stated);
        Ok(PrivacyReport {
            sampling_rate: q,
            steps,
            delta,
            default_setting: setting.default_setting,
            noise_multiplier,
            stated_epsilon: stated.epsilon,
            worst_contribution: overshoot,
            rounding_at,
            effective_noise_multiplier: effective,
            actual_epsilon: actual.map(|a| a.epsilon),
            sigma_needed,
            order: at.order,
            order_at_grid_edge: at.at_grid_edge,
        })
    }

    /// ε of the run as it really is: +∞ for an invalid norm.
    pub fn actual(&self) -> f64 {
        self.actual_epsilon.unwrap_or(f64::INFINITY)
    }

    /// One sentence: stated ε, actual ε, and the σ that would keep the stated one.
    pub fn sentence(&self) -> String {
        let stated = format!(
            "stated ε = {} (δ = {:e})",
            eps(self.stated_epsilon),
            self.delta
        );
        match (self.worst_contribution, self.actual_epsilon) {
            (None, _) | (_, None) => {
                format!("{stated}; with invalid norms no ε holds (the run is ε = ∞)")
            }
            // Without noise there is no ε to spend: no overshoot changes that.
            (Some(_), Some(_)) if !self.stated_epsilon.is_finite() => {
                format!("{stated}; without noise DP-SGD gives no privacy (the run is ε = ∞)")
            }
            (Some(s), Some(actual)) if s > 1.0 => match self.rounding_at {
                // Too small an overshoot to show in ε's two decimals: say by how much.
                Some(p) if eps(actual) == eps(self.stated_epsilon) => format!(
                    "{stated}; {p} rounding lets clipped contributions reach {}·C, which raises ε by {:.1e}: the run is ε = {}",
                    factor(s),
                    actual - self.stated_epsilon,
                    eps(actual)
                ),
                Some(p) => format!(
                    "{stated}; {p} rounding lets clipped contributions reach {}·C: the run is ε = {}, not {}; clip at C/{} or take the norms in {} to keep ε = {}",
                    factor(s),
                    eps(actual),
                    eps(self.stated_epsilon),
                    factor(s),
                    finer(p),
                    eps(self.stated_epsilon)
                ),
                None => format!(
                    "{stated}; with clipped contributions up to {}·C the run is ε = {}; σ = {} would keep ε = {}",
                    factor(s),
                    eps(actual),
                    self.sigma_needed.map_or("∞".into(), |v| format!("{v:.4}")),
                    eps(self.stated_epsilon)
                ),
            },
            (Some(_), Some(actual)) => format!(
                "{stated}; no clipped contribution above C: the run is ε = {}",
                eps(actual)
            ),
        }
    }

    /// Where the numbers come from.
    pub fn setting(&self) -> String {
        format!(
            "{}q = {}, {} steps, δ = {:e}, σ = {}",
            if self.default_setting {
                "typical fine-tuning run (no sampling rate, steps or δ given): "
            } else {
                ""
            },
            self.sampling_rate,
            self.steps,
            self.delta,
            self.noise_multiplier
        )
    }
}

/// An overshoot factor s > 1: four decimals, or 1 + (s − 1) where those would read 1.0000.
fn factor(s: f64) -> String {
    if s - 1.0 >= 5e-5 {
        format!("{s:.4}")
    } else {
        format!("(1 + {:.1e})", s - 1.0)
    }
}

/// The precision to take norms in instead, to keep rounding from spending privacy.
fn finer(p: Precision) -> &'static str {
    match p {
        Precision::BF16 | Precision::F16 => "f32",
        Precision::F32 | Precision::F64 => "f64",
    }
}

fn eps(e: f64) -> String {
    if e.is_finite() {
        format!("{e:.2}")
    } else {
        "∞".into()
    }
}
