//! The special functions the accountant needs, in f64 with std only: the log of the standard
//! normal CDF and of the scaled complementary error function, accurate far into the tails, and
//! sums of exponentials kept in log space.

use std::f64::consts::{FRAC_1_SQRT_2, FRAC_2_SQRT_PI, LN_2};

/// Below this argument erfc is computed as 1 − erf (erf by a series of positive terms, so the
/// only rounding that matters is the subtraction: erfc(2) ≈ 4.7e-3 keeps it under 1e-13
/// relative); above, by the continued fraction, which converges fast there.
const SERIES_LIMIT: f64 = 2.0;

/// erf(t) for 0 ≤ t < [`SERIES_LIMIT`]: (2/√π) e^{−t²} Σ_n (2t²)^n t / (1·3·…·(2n+1)), every
/// term positive.
fn erf_series(t: f64) -> f64 {
    let x2 = 2.0 * t * t;
    let mut term = t;
    let mut sum = t;
    let mut n = 0.0;
    while term > 1e-17 * sum {
        n += 1.0;
        term *= x2 / (2.0 * n + 1.0);
        sum += term;
    }
    FRAC_2_SQRT_PI * (-t * t).exp() * sum
}

/// erfcx(t) = e^{t²} erfc(t) for t ≥ [`SERIES_LIMIT`], by the continued fraction
/// erfc(t) = e^{−t²}/√π · 1/(t + (1/2)/(t + (2/2)/(t + (3/2)/(t + …)))) (modified Lentz).
fn erfcx_fraction(t: f64) -> f64 {
    const TINY: f64 = 1e-300;
    let mut f = t;
    let mut c = f;
    let mut d = 0.0;
    for k in 1..10_000 {
        let a = 0.5 * k as f64;
        d = t + a * d;
        if d == 0.0 {
            d = TINY;
        }
        d = 1.0 / d;
        c = t + a / c;
        if c == 0.0 {
            c = TINY;
        }
        let delta = c * d;
        f *= delta;
        // Two ulps: closer than that, rounding alone moves delta.
        if (delta - 1.0).abs() <= 4.5e-16 {
            break;
        }
    }
    0.5 * FRAC_2_SQRT_PI / f
}

/// erfc(t) for t ≥ 0 (underflows to 0 past t ≈ 27).
fn erfc_nonneg(t: f64) -> f64 {
    if t < SERIES_LIMIT {
        1.0 - erf_series(t)
    } else {
        (-t * t).exp() * erfcx_fraction(t)
    }
}

/// ln erfcx(t) = t² + ln erfc(t), for every real t (+∞ when t² overflows for t < 0).
pub(crate) fn ln_erfcx(t: f64) -> f64 {
    if t < 0.0 {
        // erfc(t) = 2 − erfc(−t) ∈ (1, 2]
        t * t + (2.0 - erfc_nonneg(-t)).ln()
    } else if t < SERIES_LIMIT {
        t * t + (1.0 - erf_series(t)).ln()
    } else {
        erfcx_fraction(t).ln()
    }
}

/// ln Φ(x), Φ the standard normal CDF, accurate in both tails.
pub(crate) fn log_ndtr(x: f64) -> f64 {
    if x >= 0.0 {
        (-0.5 * erfc_nonneg(x * FRAC_1_SQRT_2)).ln_1p()
    } else {
        // Φ(x) = erfc(t)/2, t = −x/√2 > 0
        let t = -x * FRAC_1_SQRT_2;
        if t < SERIES_LIMIT {
            (1.0 - erf_series(t)).ln() - LN_2
        } else {
            -t * t + erfcx_fraction(t).ln() - LN_2
        }
    }
}

/// ln(e^c − 1) for c ≥ 0 (−∞ at 0, +∞ at +∞).
pub(crate) fn ln_expm1(c: f64) -> f64 {
    if c > LN_2 {
        c + (-(-c).exp()).ln_1p()
    } else {
        c.exp_m1().ln()
    }
}

/// ln(1 + e^l).
pub(crate) fn ln1p_exp(l: f64) -> f64 {
    if l > 0.0 {
        l + (-l).exp().ln_1p()
    } else {
        l.exp().ln_1p()
    }
}

/// ln(e^a − e^b), or −∞ when that is not positive.
pub(crate) fn ln_sub_exp(a: f64, b: f64) -> f64 {
    if b == f64::NEG_INFINITY || a == f64::INFINITY {
        a
    } else if a <= b {
        f64::NEG_INFINITY
    } else {
        a + (-(b - a).exp()).ln_1p()
    }
}

/// A running sum of e^{l_i}, held as e^{max} · sum so that nothing overflows.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LogSum {
    max: f64,
    sum: f64,
}

impl LogSum {
    pub(crate) fn new() -> Self {
        LogSum {
            max: f64::NEG_INFINITY,
            sum: 0.0,
        }
    }

    /// Adds e^l (l = −∞ adds nothing).
    pub(crate) fn add(&mut self, l: f64) {
        if l == f64::NEG_INFINITY || self.max == f64::INFINITY {
            return;
        }
        if l == f64::INFINITY {
            self.max = l;
            self.sum = 1.0;
        } else if l <= self.max {
            self.sum += (l - self.max).exp();
        } else {
            self.sum = self.sum * (self.max - l).exp() + 1.0;
            self.max = l;
        }
    }

    /// ln of the sum (−∞ when empty).
    pub(crate) fn ln(&self) -> f64 {
        if self.sum == 0.0 {
            f64::NEG_INFINITY
        } else {
            self.max + self.sum.ln()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // ln Φ(x) from mpmath at 60 digits (log1p(-ncdf(-x)) for x > 0).
    #[test]
    fn log_ndtr_matches_mpmath() {
        let cases = [
            (-40.0, -804.608_442_013_753_8),
            (-5.0, -15.064_998_393_988_726),
            (-2.0, -3.783_184_333_682_032),
            (-0.5, -1.175_911_761_593_618_6),
            (0.0, -std::f64::consts::LN_2),
            (1.0, -0.172_753_779_023_449_9),
            (3.0, -0.001_350_809_964_748_193_8),
            (9.0, -1.128_588_405_953_840_6e-19),
        ];
        for (x, want) in cases {
            let got = log_ndtr(x);
            assert!(
                ((got - want) / want).abs() < 1e-13,
                "x = {x}: {got} vs {want}"
            );
        }
    }

    // ln erfc(t) + t² from mpmath at 60 digits.
    #[test]
    fn ln_erfcx_matches_mpmath() {
        let cases = [
            (-3.0, 9.693_136_135_250_447),
            (0.1, -0.109_304_973_737_395_6),
            (1.9, -1.322_345_862_780_269_3),
            (2.5, -1.556_815_272_727_264_4),
            (30.0, -3.974_117_110_643_878),
            (1e8, -18.993_045_686_877_066),
        ];
        for (t, want) in cases {
            let got = ln_erfcx(t);
            assert!(
                ((got - want) / want).abs() < 1e-13,
                "t = {t}: {got} vs {want}"
            );
        }
    }
}
