//! The divisor an update was divided by, read from the update itself: without noise from the
//! scale of its signal, under noise from its projection on the clipped sum (or on S* without
//! one). An update divided by the batch's drawn size instead of the stated divisor has a
//! normalization that depends on the data.

use ghost_oracle_reference::Floats;
use serde::Serialize;

/// The divisor an update was divided by, read from the update: without noise from the scale of
/// its signal, under noise from its projection on the clipped sum (or on S* without one).
#[derive(Clone, Debug, Serialize)]
pub struct DivisorCheck {
    /// D as the library states it.
    pub stated: f64,
    /// D as read from the update.
    pub implied: f64,
    /// The relative uncertainty of `implied`: one standard deviation of what the noise adds to
    /// it, or the rounding bound without noise.
    pub spread: f64,
    /// The batch's actual size.
    pub drawn: usize,
    /// The implied divisor is off the stated one and equals the drawn size: the update's
    /// normalization depends on the data (the sampled batch's size), which the stated σ does not
    /// account for.
    pub data_dependent: bool,
}

/// How many spreads apart two divisors must be to be told apart (a normal tail of 5.7e-7).
const DIVISOR_Z: f64 = 5.0;

impl DivisorCheck {
    /// `None` where the update implies no divisor (a non-positive or undefined one).
    pub(super) fn new(stated: f64, implied: f64, spread: f64, drawn: usize) -> Option<Self> {
        if !implied.is_finite() || implied <= 0.0 {
            return None;
        }
        let apart = |a: f64, b: f64| (a - b).abs() > DIVISOR_Z * spread * implied + 1e-12 * a;
        Some(DivisorCheck {
            stated,
            implied,
            spread,
            drawn,
            data_dependent: apart(implied, stated)
                && !apart(implied, drawn as f64)
                && apart(stated, drawn as f64),
        })
    }

    /// 1/D' = ⟨u, K⟩/‖K‖² for an update u = (K + n)/D', to within σC/‖K‖ (one standard
    /// deviation).
    pub(super) fn from_clipped_sum(
        update: &[(String, Floats)],
        clipped_sum: &[(String, Floats)],
        stated: f64,
        sigma_c: f64,
        drawn: usize,
    ) -> Option<Self> {
        let (mut uk, mut kk) = (0.0, 0.0);
        for (p, u) in update {
            let k = &clipped_sum.iter().find(|(q, _)| q == p)?.1;
            u.zip_chunks(k, |u, k| {
                for (u, k) in u.iter().zip(k) {
                    uk += u * k;
                    kk += k * k;
                }
            });
        }
        DivisorCheck::new(stated, kk / uk, sigma_c / kk.sqrt(), drawn)
    }
}
