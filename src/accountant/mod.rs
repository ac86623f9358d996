//! Rényi-DP accountant for DP-SGD: the Poisson-subsampled Gaussian mechanism, composed over
//! steps and converted to (ε, δ).
//!
//! One step samples each example with probability `q`, clips, sums, and adds Gaussian noise
//! of standard deviation σ times the clipping norm (σ is the noise multiplier). Its Rényi
//! divergence of order α is RDP(α) = ln A_α / (α − 1) with
//!
//! ```text
//! A_α = E_{z∼N(0,σ²)}[((1 − q) + q·e^{(2z−1)/(2σ²)})^α]
//! ```
//!
//! (Mironov, Talwar, Zhang 2019, "Rényi Differential Privacy of the Sampled Gaussian
//! Mechanism"), computed exactly: by the binomial sum for integer α and by the two-series
//! expansion with normal CDFs for fractional α, both arranged to give A_α − 1 without
//! cancellation (details in the `rdp` submodule). RDP composes additively, so `steps` steps
//! cost `steps`·RDP(α), and the conversion of Balle et al. 2020 (Thm 21),
//!
//! ```text
//! ε = steps·RDP(α) + ln(1 − 1/α) − (ln δ + ln α)/(α − 1),
//! ```
//!
//! is minimized over a grid of orders, [`default_orders`] unless the caller gives one.
//!
//! Agreement, measured by `oracles/golden/make_accounting.py` and asserted by the tests:
//! ln A_α equals a 40-digit quadrature of the definition to 1e-10 relative (2.4e-13 measured)
//! over the grid σ ∈ {0.3 … 5}, q ∈ {1e-4 … 1} and every default order, and ε equals Opacus
//! 1.6's `get_privacy_spent`, with the same optimal order, to 1e-9 relative beyond Opacus's own
//! rounding (which reaches 5e-9 after a million steps). The arrangement of the fractional-order
//! series loses about σ² ulps, so its relative accuracy drifts with σ (2.9e-12 at worst on 40
//! random points up to σ = 50); the absolute error of ln A_α stays near 1e-16.
//!
//! Conventions (Opacus's where it has one):
//! * q = 0 gives RDP 0; σ = 0 or α = +∞ (with q > 0) gives +∞; q = 1 gives α/(2σ²) exactly.
//!   σ below 1e-150 is treated as 0, σ above 1e150 as infinite noise (RDP 0).
//! * The minimum over orders is returned as it is, not clamped at 0: it is negative only for a
//!   large δ (roughly δ·α ≥ 1 at the optimum). Where every order gives +∞ (σ = 0) the result
//!   is +∞ at the first order. Ties go to the first order listed.
//! * An order of +∞ contributes the limit of the bound, steps·RDP(∞): 0 when q = 0, else +∞.
//! * `steps = 0` is an error rather than ε = 0: nothing ran, and the conversion would report
//!   a positive ε for it.
//!
//! ```
//! use ghost_oracle::accountant::{default_orders, epsilon, sigma_for_epsilon};
//!
//! // 10 000 steps at sampling rate 1 %, noise multiplier 1, δ = 1e-5.
//! let spent = epsilon(0.01, 1.0, 10_000, 1e-5, &default_orders()).unwrap();
//! assert!((spent.epsilon - 6.7128).abs() < 1e-4);
//! assert_eq!(spent.order, 4.1);
//! assert!(!spent.at_grid_edge);
//!
//! // The noise multiplier that brings the same run to ε = 3.
//! let sigma = sigma_for_epsilon(0.01, 10_000, 1e-5, 3.0, &default_orders()).unwrap();
//! assert!(sigma > 1.0);
//! ```

mod rdp;
mod special;

use std::fmt;

/// The largest finite order accepted (the expansions cost O(α) terms).
pub const MAX_ORDER: f64 = rdp::MAX_ORDER;

/// A bad argument to the accountant; the message names it and its valid range.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum AccountingError {
    /// The sampling rate q is not in [0, 1].
    SamplingRate(f64),
    /// The noise multiplier σ is negative or not finite.
    NoiseMultiplier(f64),
    /// An order α is not in (1, [`MAX_ORDER`]] and not +∞.
    Order(f64),
    /// The list of orders is empty.
    NoOrders,
    /// δ is not in (0, 1).
    Delta(f64),
    /// steps = 0.
    NoSteps,
    /// The target ε is not a finite number.
    TargetEpsilon(f64),
    /// No σ reaches the target: ε tends to `floor` as σ → ∞ and stays above it.
    Unreachable {
        /// The target ε asked for.
        target: f64,
        /// The infimum of ε over all σ for these orders and δ.
        floor: f64,
    },
}

impl fmt::Display for AccountingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            AccountingError::SamplingRate(q) => {
                write!(f, "sampling rate q = {q} is outside [0, 1]")
            }
            AccountingError::NoiseMultiplier(s) => write!(
                f,
                "noise multiplier σ = {s} is outside [0, ∞) (it must be finite and non-negative)"
            ),
            AccountingError::Order(a) => {
                write!(f, "order α = {a} is outside (1, {MAX_ORDER}] and is not +∞")
            }
            AccountingError::NoOrders => write!(
                f,
                "the list of orders is empty; give at least one order in (1, {MAX_ORDER}]"
            ),
            AccountingError::Delta(d) => write!(f, "δ = {d} is outside (0, 1)"),
            AccountingError::NoSteps => write!(
                f,
                "steps = 0 is outside [1, 2^64): no step ran, there is nothing to account for"
            ),
            AccountingError::TargetEpsilon(e) => {
                write!(f, "target ε = {e} is not a finite number")
            }
            AccountingError::Unreachable { target, floor } => write!(
                f,
                "target ε = {target} is unreachable: with these orders and δ, ε stays above \
                 {floor} for every σ (it only tends to that as σ → ∞)"
            ),
        }
    }
}

impl std::error::Error for AccountingError {}

/// The (ε, δ) guarantee of a run and the order that gave it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrivacySpent {
    /// The smallest ε over the orders (+∞ when σ = 0).
    pub epsilon: f64,
    /// The order α at which it was reached.
    pub order: f64,
    /// The optimal order is the smallest or the largest of the grid: a wider grid may give a
    /// smaller ε (Opacus warns in the same case).
    pub at_grid_edge: bool,
}

/// Opacus's `RDPAccountant.DEFAULT_ALPHAS`: 1.1, 1.2, …, 10.9 (as `1 + x/10`), then 12, 13,
/// …, 63.
pub fn default_orders() -> Vec<f64> {
    (1..100)
        .map(|x| 1.0 + f64::from(x) / 10.0)
        .chain((12..64).map(f64::from))
        .collect()
}

fn check_q(q: f64) -> Result<(), AccountingError> {
    if (0.0..=1.0).contains(&q) {
        Ok(())
    } else {
        Err(AccountingError::SamplingRate(q))
    }
}

fn check_sigma(sigma: f64) -> Result<(), AccountingError> {
    if sigma.is_finite() && sigma >= 0.0 {
        Ok(())
    } else {
        Err(AccountingError::NoiseMultiplier(sigma))
    }
}

fn check_order(alpha: f64) -> Result<(), AccountingError> {
    if alpha > 1.0 && (alpha <= MAX_ORDER || alpha == f64::INFINITY) {
        Ok(())
    } else {
        Err(AccountingError::Order(alpha))
    }
}

fn check_orders(orders: &[f64]) -> Result<(), AccountingError> {
    if orders.is_empty() {
        return Err(AccountingError::NoOrders);
    }
    orders.iter().try_for_each(|&a| check_order(a))
}

fn check_delta(delta: f64) -> Result<(), AccountingError> {
    if delta > 0.0 && delta < 1.0 {
        Ok(())
    } else {
        Err(AccountingError::Delta(delta))
    }
}

fn check_steps(steps: u64) -> Result<(), AccountingError> {
    if steps == 0 {
        Err(AccountingError::NoSteps)
    } else {
        Ok(())
    }
}

/// ln A_α of one step of the Poisson-subsampled Gaussian mechanism (see the module docs).
///
/// Errors unless q ∈ [0, 1], σ ∈ [0, ∞) and α ∈ (1, [`MAX_ORDER`]] or α = +∞.
pub fn log_a(q: f64, sigma: f64, alpha: f64) -> Result<f64, AccountingError> {
    check_q(q)?;
    check_sigma(sigma)?;
    check_order(alpha)?;
    Ok(rdp::log_a(q, sigma, alpha))
}

/// RDP of order α of one step: ln A_α / (α − 1); α/(2σ²) at q = 1, 0 at q = 0, +∞ at σ = 0 or
/// α = +∞. Same argument ranges as [`log_a`].
pub fn rdp(q: f64, sigma: f64, alpha: f64) -> Result<f64, AccountingError> {
    check_q(q)?;
    check_sigma(sigma)?;
    check_order(alpha)?;
    Ok(rdp::rdp(q, sigma, alpha))
}

/// The Balle et al. conversion at one order for a composed RDP value.
fn epsilon_at(total_rdp: f64, alpha: f64, ln_delta: f64) -> f64 {
    if alpha == f64::INFINITY {
        total_rdp
    } else {
        total_rdp + (-1.0 / alpha).ln_1p() - (ln_delta + alpha.ln()) / (alpha - 1.0)
    }
}

/// Minimizes the conversion over `orders` (already checked), `total_rdp(α)` giving the
/// composed RDP.
fn best_order(orders: &[f64], ln_delta: f64, total_rdp: impl Fn(f64) -> f64) -> PrivacySpent {
    let mut best: Option<(f64, f64)> = None;
    for &alpha in orders {
        let e = epsilon_at(total_rdp(alpha), alpha, ln_delta);
        if !e.is_nan() && best.is_none_or(|(b, _)| e < b) {
            best = Some((e, alpha));
        }
    }
    let (epsilon, order) = best.unwrap_or((f64::INFINITY, orders[0]));
    let lowest = orders.iter().copied().fold(f64::INFINITY, f64::min);
    let highest = orders.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    PrivacySpent {
        epsilon,
        order,
        at_grid_edge: order == lowest || order == highest,
    }
}

/// ε of `steps` steps at sampling rate `q` and noise multiplier `sigma`, for `delta`,
/// minimized over `orders` (usually [`default_orders`]).
///
/// Errors unless q ∈ [0, 1], σ ∈ [0, ∞), steps ≥ 1, δ ∈ (0, 1) and `orders` is non-empty with
/// every order in (1, [`MAX_ORDER`]] or +∞.
pub fn epsilon(
    q: f64,
    sigma: f64,
    steps: u64,
    delta: f64,
    orders: &[f64],
) -> Result<PrivacySpent, AccountingError> {
    check_q(q)?;
    check_sigma(sigma)?;
    check_steps(steps)?;
    check_delta(delta)?;
    check_orders(orders)?;
    Ok(spent(q, sigma, steps, delta.ln(), orders))
}

fn spent(q: f64, sigma: f64, steps: u64, ln_delta: f64, orders: &[f64]) -> PrivacySpent {
    let n = steps as f64;
    best_order(orders, ln_delta, |alpha| {
        let r = rdp::rdp(q, sigma, alpha);
        // 0·∞ cannot happen (steps ≥ 1), but keep RDP 0 exact.
        if r == 0.0 {
            0.0
        } else {
            n * r
        }
    })
}

/// The smallest noise multiplier σ for which `steps` steps at sampling rate `q` stay within
/// `target_epsilon` at `delta` (ε minimized over `orders`), found by bisection to 1e-12
/// relative; ε at the returned σ is ≤ the target.
///
/// Errors on the arguments as [`epsilon`] does, when the target is not finite, and with
/// [`AccountingError::Unreachable`] when no σ gets there: as σ → ∞ the RDP vanishes and ε only
/// falls to the floor min_α [ln(1 − 1/α) − (ln δ + ln α)/(α − 1)] (about 0.10 at δ = 1e-5 with
/// the default orders), so a target at or below it is unreachable. At q = 0 the noise does not
/// matter: the answer is 0 when the floor is within the target.
pub fn sigma_for_epsilon(
    q: f64,
    steps: u64,
    delta: f64,
    target_epsilon: f64,
    orders: &[f64],
) -> Result<f64, AccountingError> {
    check_q(q)?;
    check_steps(steps)?;
    check_delta(delta)?;
    check_orders(orders)?;
    if !target_epsilon.is_finite() {
        return Err(AccountingError::TargetEpsilon(target_epsilon));
    }
    let ln_delta = delta.ln();
    let floor = best_order(orders, ln_delta, |_| 0.0).epsilon;
    let unreachable = AccountingError::Unreachable {
        target: target_epsilon,
        floor,
    };
    if q == 0.0 {
        return if floor <= target_epsilon {
            Ok(0.0)
        } else {
            Err(unreachable)
        };
    }
    if target_epsilon <= floor {
        return Err(unreachable);
    }
    let eps = |sigma: f64| spent(q, sigma, steps, ln_delta, orders).epsilon;
    // ε(0) = +∞ > target; find hi with ε(hi) ≤ target.
    let mut lo = 0.0;
    let mut hi = 1.0;
    while eps(hi) > target_epsilon {
        lo = hi;
        hi *= 2.0;
        if hi > 1e12 {
            return Err(unreachable);
        }
    }
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if mid <= lo || mid >= hi || hi - lo <= 1e-12 * hi {
            break;
        }
        if eps(mid) > target_epsilon {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(hi)
}
