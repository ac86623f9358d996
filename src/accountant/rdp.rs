//! log A_α of the Poisson-subsampled Gaussian mechanism (Mironov, Talwar, Zhang 2019).
//!
//! With μ₀ = N(0, σ²), μ₁ = N(1, σ²) and L(z) = μ₁(z)/μ₀(z) = e^{(2z−1)/(2σ²)},
//!
//! ```text
//! A_α = E_{z∼μ₀}[((1 − q) + q·L(z))^α],    RDP(α) = ln A_α / (α − 1).
//! ```
//!
//! A_α is 1 plus something that is O(q²) for small q, and at q = 1e-4, σ = 5 that something is
//! 2e-11: summing terms of size 1 would leave it with five correct digits. Both expansions
//! below therefore compute A_α − 1 as a sum of small terms and take ln A_α = ln1p(A_α − 1) at
//! the end.
//!
//! * Integer α: E[L^i] = e^{i(i−1)/(2σ²)} and the binomial theorem give
//!   A_α − 1 = Σ_{i=2}^{α} C(α,i) q^i (1−q)^{α−i} (e^{i(i−1)/(2σ²)} − 1), every term ≥ 0.
//! * Fractional α: split the line at z₀ = σ² ln((1−q)/q) + ½, where qL = 1 − q, and expand
//!   the power in qL/(1−q) below z₀ and in (1−q)/(qL) above (the two series of Mironov et al.,
//!   Sec. 3.3); each term integrates to a normal CDF. Subtracting 1 + αq(L − 1), whose mean is
//!   1, removes the O(1) and O(q) parts in closed form. Past i = ⌈α⌉ the terms alternate in
//!   sign with magnitudes that form a Hausdorff moment sequence (|C(α,i)| is a Beta integral
//!   in i, erfcx of a linear function of i is a Laplace transform); the Euler transform sums
//!   such a tail with a ratio ≤ ½ per term, where the plain series decays like i^{−α−2}.

use super::special::{ln1p_exp, ln_erfcx, ln_expm1, ln_sub_exp, log_ndtr, LogSum};
use std::f64::consts::{LN_2, SQRT_2};

/// Orders above this (except +∞) are refused: the expansions cost O(α) terms.
pub(crate) const MAX_ORDER: f64 = 1e6;
/// Below this σ the mechanism is treated as noiseless (RDP +∞): 1/(2σ²) overflows there.
const SIGMA_TINY: f64 = 1e-150;
/// Above this σ the RDP underflows to 0 and is returned as 0.
const SIGMA_HUGE: f64 = 1e150;
/// Terms of the Euler transform of the alternating tail (its ratio is ≤ ½).
const EULER_TERMS: usize = 64;

/// ln A_α for q ∈ [0, 1], σ ∈ [0, ∞), α ∈ (1, MAX_ORDER] ∪ {+∞} (checked by the caller).
pub(crate) fn log_a(q: f64, sigma: f64, alpha: f64) -> f64 {
    if q == 0.0 {
        0.0
    } else if sigma == 0.0 || alpha == f64::INFINITY {
        f64::INFINITY
    } else if q == 1.0 {
        alpha * (alpha - 1.0) / (2.0 * sigma * sigma)
    } else if sigma < SIGMA_TINY {
        f64::INFINITY
    } else if sigma > SIGMA_HUGE {
        0.0
    } else if alpha.fract() == 0.0 {
        ln1p_exp(int_log_a_minus_1(q, sigma, alpha as u64))
    } else {
        ln1p_exp(frac_log_a_minus_1(q, sigma, alpha))
    }
}

/// RDP(α) = ln A_α / (α − 1), same domain as [`log_a`]; α/(2σ²) at q = 1.
pub(crate) fn rdp(q: f64, sigma: f64, alpha: f64) -> f64 {
    if q == 0.0 {
        0.0
    } else if sigma == 0.0 {
        f64::INFINITY
    } else if q == 1.0 {
        alpha / (2.0 * sigma * sigma)
    } else if alpha == f64::INFINITY {
        f64::INFINITY
    } else {
        log_a(q, sigma, alpha) / (alpha - 1.0)
    }
}

/// ln(A_n − 1) for an integer order n ≥ 2, 0 < q < 1.
fn int_log_a_minus_1(q: f64, sigma: f64, n: u64) -> f64 {
    let lq = q.ln();
    let l1q = (-q).ln_1p();
    let inv = 0.5 / (sigma * sigma);
    let nf = n as f64;
    let mut ln_binom = 0.0; // ln C(n, i)
    let mut acc = LogSum::new();
    for i in 1..=n {
        let fi = i as f64;
        ln_binom += ((nf - fi + 1.0) / fi).ln();
        if i >= 2 {
            acc.add(ln_binom + fi * lq + (nf - fi) * l1q + ln_expm1(fi * (fi - 1.0) * inv));
        }
    }
    acc.ln()
}

/// ln d₀ with d₀ = (1−q)^α − 1 + αq > 0 (α > 1).
fn ln_d0(q: f64, alpha: f64) -> f64 {
    if alpha * q <= 0.5 {
        // Σ_{k≥2} C(α,k)(−q)^k: no cancellation against the 1 and the αq.
        let mut term = 0.5 * alpha * (alpha - 1.0) * q * q;
        let mut sum = term;
        let mut k = 2.0;
        while term.abs() > 1e-17 * sum.abs() && k < 10_000.0 {
            term *= (alpha - k) / (k + 1.0) * -q;
            sum += term;
            k += 1.0;
        }
        sum.ln()
    } else {
        ((alpha * (-q).ln_1p()).exp_m1() + alpha * q).ln()
    }
}

/// ln(A_α − 1) for a fractional order α > 1, 0 < q < 1.
fn frac_log_a_minus_1(q: f64, sigma: f64, alpha: f64) -> f64 {
    let lq = q.ln();
    let l1q = (-q).ln_1p();
    let s2 = sigma * sigma;
    let inv = 0.5 / s2;
    let rs = SQRT_2 * sigma;
    let z0 = s2 * (l1q - lq) + 0.5;
    // Past z₀ (below it for the upper series) a term's q-powers, e^{c}, and the Gaussian tail
    // collapse to this common factor times erfcx.
    let ltail = alpha * l1q - z0 * z0 * inv - LN_2;

    // ln of the i-th term of the series below z₀, without its binomial coefficient:
    // q^i (1−q)^{α−i} e^{i(i−1)/(2σ²)} Φ((z₀ − i)/σ).
    let lower = |i: f64| {
        if i <= z0 {
            i * lq + (alpha - i) * l1q + i * (i - 1.0) * inv + log_ndtr((z0 - i) / sigma)
        } else {
            ltail + ln_erfcx((i - z0) / rs)
        }
    };
    // ... and above z₀, with j = α − i: (1−q)^i q^j e^{j(j−1)/(2σ²)} Φ((j − z₀)/σ).
    let upper = |i: f64| {
        let j = alpha - i;
        if j >= z0 {
            i * l1q + j * lq + j * (j - 1.0) * inv + log_ndtr((j - z0) / sigma)
        } else {
            ltail + ln_erfcx((z0 - j) / rs)
        }
    };

    let mut pos = LogSum::new();
    let mut neg = LogSum::new();
    let ln_aq = alpha.ln() + lq;
    // Terms i = 0 and 1 of the lower series minus (1 − αq) + αqL below z₀:
    // d₀ Φ(z₀/σ) + αq((1−q)^{α−1} − 1) Φ((z₀−1)/σ).
    pos.add(ln_d0(q, alpha) + log_ndtr(z0 / sigma));
    neg.add(ln_aq + (-((alpha - 1.0) * l1q).exp_m1()).ln() + log_ndtr((z0 - 1.0) / sigma));
    // Minus (1 − αq) + αqL above z₀.
    let one_minus_aq = (-alpha).mul_add(q, 1.0);
    let ln_tail_mass = log_ndtr(-z0 / sigma);
    if one_minus_aq > 0.0 {
        neg.add(one_minus_aq.ln() + ln_tail_mass);
    } else if one_minus_aq < 0.0 {
        pos.add((-one_minus_aq).ln() + ln_tail_mass);
    }
    neg.add(ln_aq + log_ndtr((1.0 - z0) / sigma));

    // i < ⌈α⌉: C(α, i) > 0.
    let first_alternating = alpha.ceil();
    let mut ln_binom = 0.0; // ln |C(α, i)|
    let mut i = 0.0;
    while i < first_alternating {
        if i > 0.0 {
            ln_binom += ((alpha - i + 1.0) / i).ln();
        }
        if i >= 2.0 {
            pos.add(ln_binom + lower(i));
        }
        pos.add(ln_binom + upper(i));
        i += 1.0;
    }

    // i ≥ ⌈α⌉: the signs alternate, starting positive; Euler transform of the magnitudes g_k.
    let mut g = [0.0; EULER_TERMS + 1];
    for (k, gk) in g.iter_mut().enumerate() {
        let fi = first_alternating + k as f64;
        ln_binom += ((fi - 1.0 - alpha).abs() / fi).ln();
        let (a, b) = (lower(fi), upper(fi));
        let (hi, lo) = if a >= b { (a, b) } else { (b, a) };
        *gk = if hi == f64::NEG_INFINITY {
            hi
        } else {
            ln_binom + hi + ln1p_exp(lo - hi)
        };
    }
    let top = g[0];
    if top > f64::NEG_INFINITY {
        let mut r = g.map(|l| (l - top).exp());
        let mut weight = 0.5;
        let mut tail = 0.0;
        for k in 0..=EULER_TERMS {
            // r[0] = ((−Δ)^k g)_0 / e^top ≥ 0
            let term = r[0] * weight;
            tail += term;
            if term <= 1e-17 * tail {
                break;
            }
            for j in 0..EULER_TERMS - k {
                r[j] -= r[j + 1];
            }
            weight *= 0.5;
        }
        if tail > 0.0 {
            pos.add(top + tail.ln());
        }
    }
    ln_sub_exp(pos.ln(), neg.ln())
}
