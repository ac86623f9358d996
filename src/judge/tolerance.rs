//! The derived tolerance bound that separates rounding from bugs (docs/tolerances.md).
//!
//! Every statistic here is computed from the reference's f64 trace with ndarray. The judge keeps
//! its own short evaluation of the Gram identity's term magnitudes instead of calling the
//! clippers' kernels: a kernel bug must never move the bound together with the error it makes.

use crate::error::{Error, Result};
use ghost_oracle_reference::{Site, SiteKind, Trace as RefTrace};
use ndarray::{s, Array2, ArrayView2};
use serde::Serialize;

/// Safety factor on the probabilistic √L growth of accumulated rounding error (Higham & Mary).
pub const LAMBDA: f64 = 8.0;
/// Rounding the trace itself to the clipper's precision perturbs each term by at most ~4u.
pub const INPUT_ROUNDING: f64 = 4.0;

/// The arithmetic a clipper computed in, which sets its unit roundoff.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    // Ordered from the finest to the coarsest unit roundoff.
    F64,
    F32,
    F16,
    BF16,
}

impl Precision {
    pub fn unit_roundoff(self) -> f64 {
        match self {
            Precision::F64 => f64::EPSILON / 2.0,
            Precision::F32 => f64::from(f32::EPSILON) / 2.0,
            Precision::F16 => 2f64.powi(-11),
            Precision::BF16 => 2f64.powi(-8),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::F64 => "f64",
            Precision::F32 => "f32",
            Precision::F16 => "f16",
            Precision::BF16 => "bf16",
        }
    }

    /// The less precise of the two: a result is no better than its coarsest step.
    pub fn coarser(self, other: Precision) -> Precision {
        self.max(other)
    }
}

/// Per-example magnitudes of the terms a norm is summed from, from the reference side only.
#[derive(Clone, Debug)]
pub struct Tolerance {
    /// `site_scale[j][i]` = Σ_t ‖l_t‖‖r_t‖ of site j, example i: bounds |terms| of anything built
    /// on it (the clipped sum).
    pub site_scale: Vec<Vec<f64>>,
    /// Parameter index of every site.
    pub site_param: Vec<usize>,
    pub n_params: usize,
    /// Per example, Σ|terms| of n² over the Gram route (own and 2× cross terms).
    pub abs_terms: Vec<f64>,
    /// Per example, Σ_params (Σ_{j∈p} √D_j)² with D_j = Σ_t ‖l_jt‖²‖r_jt‖²: the 2-norm scale of
    /// the dot-product rounding errors (Cauchy–Schwarz bound of √Σ term-scale²).
    pub dot_scale: Vec<f64>,
    /// max over sites of √p + √q (dot-product lengths).
    pub sqrt_width: f64,
    pub seq_len: usize,
    /// Entries of the largest parameter: the reference's own f64 reduction length.
    pub largest_param: usize,
}

/// One side of a site's per-example gradient Σ_t l_t r_tᵀ, in f64 (T rows).
enum Side {
    Dense(Array2<f64>),
    /// Row t is onehot(ids[t]).
    OneHot(Vec<usize>),
    /// The constant 1 (bias-like sites).
    Ones(usize),
}

fn sides(site: &Site, i: usize) -> Result<(Side, Side)> {
    let name = &site.spec.name;
    let bp = site.backprops.slice(s![i, .., ..]).to_owned();
    let t = bp.nrows();
    let act = || {
        site.activations
            .as_ref()
            .map(|a| a.slice(s![i, .., ..]).to_owned())
            .ok_or_else(|| Error::input(format!("site `{name}`: activations missing")))
    };
    Ok(match site.spec.kind {
        SiteKind::Linear => (Side::Dense(bp), Side::Dense(act()?)),
        SiteKind::Conv1d => (Side::Dense(act()?), Side::Dense(bp)),
        SiteKind::Embedding => {
            let ids = site
                .ids
                .as_ref()
                .ok_or_else(|| Error::input(format!("site `{name}`: ids missing")))?;
            let ids = ids
                .slice(s![i, ..])
                .iter()
                .map(|&x| {
                    usize::try_from(x).map_err(|_| {
                        Error::input(format!("site `{name}`: negative id {x} in `{name}.ids`"))
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            (Side::OneHot(ids), Side::Dense(bp))
        }
        SiteKind::Bias => (Side::Dense(bp), Side::Ones(t)),
        SiteKind::LayerNorm => (Side::Dense(bp * act()?), Side::Ones(t)),
    })
}

fn rows(s: &Side) -> usize {
    match s {
        Side::Dense(a) => a.nrows(),
        Side::OneHot(ids) => ids.len(),
        Side::Ones(t) => *t,
    }
}

/// The T×S matrix of ⟨a_t, b_s⟩. Both sides have the same width (validated traces write
/// gradients of one shape per parameter); the one-wide cases read a column or a one-row table.
fn side_gram(a: &Side, b: &Side) -> Array2<f64> {
    let (t, s) = (rows(a), rows(b));
    let column = |x: &ArrayView2<f64>, r: usize| x[(r, 0)];
    match (a, b) {
        (Side::Dense(x), Side::Dense(y)) => x.dot(&y.t()),
        (Side::OneHot(ix), Side::Dense(y)) => Array2::from_shape_fn((t, s), |(p, q)| y[(q, ix[p])]),
        (Side::Dense(x), Side::OneHot(iy)) => Array2::from_shape_fn((t, s), |(p, q)| x[(p, iy[q])]),
        (Side::OneHot(ix), Side::OneHot(iy)) => {
            Array2::from_shape_fn((t, s), |(p, q)| f64::from(u8::from(ix[p] == iy[q])))
        }
        (Side::Ones(_), Side::Ones(_)) => Array2::ones((t, s)),
        (Side::Ones(_), Side::Dense(y)) => {
            Array2::from_shape_fn((t, s), |(_, q)| column(&y.view(), q))
        }
        (Side::Dense(x), Side::Ones(_)) => {
            Array2::from_shape_fn((t, s), |(p, _)| column(&x.view(), p))
        }
        (Side::Ones(_), Side::OneHot(iy)) => {
            Array2::from_shape_fn((t, s), |(_, q)| f64::from(u8::from(iy[q] == 0)))
        }
        (Side::OneHot(ix), Side::Ones(_)) => {
            Array2::from_shape_fn((t, s), |(p, _)| f64::from(u8::from(ix[p] == 0)))
        }
    }
}

/// Σ_{t,s} |(l_jt·l_ks)(r_jt·r_ks)| and Σ_t (l_jt·l_kt)(r_jt·r_kt) for one example.
fn term_magnitudes(a: &(Side, Side), b: &(Side, Side)) -> (f64, f64) {
    let prod = side_gram(&a.0, &b.0) * side_gram(&a.1, &b.1);
    let abs = prod.iter().map(|v| v.abs()).sum();
    let diag = prod.diag().sum();
    (abs, diag)
}

fn row_norm(a: ndarray::ArrayView1<f64>) -> f64 {
    a.iter().map(|v| v * v).sum::<f64>().sqrt()
}

impl Tolerance {
    /// The term statistics of a trace, from its f64 factors.
    pub fn from_trace(trace: &RefTrace) -> Result<Self> {
        let params = trace.params();
        let mut site_param = vec![0; trace.sites.len()];
        for (p, (_, js)) in params.iter().enumerate() {
            for &j in js {
                site_param[j] = p;
            }
        }
        let b = trace.batch_size();
        let mut site_scale = Vec::with_capacity(trace.sites.len());
        let mut sqrt_width: f64 = 0.0;
        let mut largest_param = 1;
        for s in &trace.sites {
            let (_, t, q) = s.backprops.dim();
            let p = match s.spec.kind {
                SiteKind::Embedding => s.spec.vocab.unwrap_or(1),
                SiteKind::Bias | SiteKind::LayerNorm => 1,
                SiteKind::Linear | SiteKind::Conv1d => {
                    s.activations.as_ref().map_or(1, |a| a.dim().2)
                }
            };
            sqrt_width = sqrt_width.max((p as f64).sqrt() + (q as f64).sqrt());
            largest_param = largest_param.max(p * q);
            let scale: Vec<f64> = (0..b)
                .map(|i| {
                    (0..t)
                        .map(|tt| {
                            let bp = s.backprops.slice(s![i, tt, ..]);
                            match (s.spec.kind, &s.activations) {
                                (SiteKind::LayerNorm, Some(a)) => {
                                    let x = a.slice(s![i, tt, ..]);
                                    bp.iter()
                                        .zip(x.iter())
                                        .map(|(u, v)| (u * v) * (u * v))
                                        .sum::<f64>()
                                        .sqrt()
                                }
                                (SiteKind::Linear | SiteKind::Conv1d, Some(a)) => {
                                    row_norm(bp) * row_norm(a.slice(s![i, tt, ..]))
                                }
                                _ => row_norm(bp),
                            }
                        })
                        .sum()
                })
                .collect();
            site_scale.push(scale);
        }

        let mut abs_terms = vec![0.0; b];
        let mut sqrt_d = vec![vec![0.0; b]; params.len()];
        for (i, abs) in abs_terms.iter_mut().enumerate() {
            let factored = trace
                .sites
                .iter()
                .map(|s| sides(s, i))
                .collect::<Result<Vec<_>>>()?;
            for (j, f) in factored.iter().enumerate() {
                let (a, d) = term_magnitudes(f, f);
                *abs += a;
                sqrt_d[site_param[j]][i] += d.max(0.0).sqrt();
            }
            for (_, js) in &params {
                for (x, &j) in js.iter().enumerate() {
                    for &k in &js[x + 1..] {
                        *abs += 2.0 * term_magnitudes(&factored[j], &factored[k]).0;
                    }
                }
            }
        }
        let dot_scale = (0..b)
            .map(|i| sqrt_d.iter().map(|p| p[i] * p[i]).sum())
            .collect();
        Ok(Tolerance {
            site_scale,
            site_param,
            n_params: params.len(),
            abs_terms,
            dot_scale,
            sqrt_width,
            seq_len: trace.sites.first().map_or(0, |s| s.backprops.dim().1),
            largest_param,
        })
    }

    /// Relative bound on |n̂_i − n_i| / n_i for a clipper working in unit roundoff `u`, given the
    /// true norm n_i (docs/tolerances.md): dot-product and input rounding, the T² accumulation of
    /// the terms, and the reference's own f64 rounding.
    pub fn norm_bound(&self, i: usize, true_norm: f64, u: f64) -> f64 {
        let n2 = true_norm * true_norm;
        let t = self.seq_len as f64;
        let dots = LAMBDA * u * (INPUT_ROUNDING + self.sqrt_width) * self.dot_scale[i];
        let accumulation = LAMBDA * u * t * self.abs_terms[i];
        let reference = LAMBDA * f64::EPSILON / 2.0
            * (t + self.largest_param as f64).sqrt()
            * self.abs_terms[i];
        let absolute = 0.5 * (dots + accumulation + reference);
        // A zero gradient: with no terms at all there is no rounding (0); terms that cancel to
        // exactly zero allow any relative error.
        if n2 == 0.0 {
            return if absolute == 0.0 { 0.0 } else { f64::INFINITY };
        }
        absolute / n2
    }

    /// Absolute bound on ‖S − S*‖ for the clipped sum S = Σ_i c_i g_i in unit roundoff `u`: each
    /// entry accumulates B·T products of the sites' factors.
    pub fn clipped_sum_bound(&self, coefs: &[f64], u: f64) -> f64 {
        let mut per_param = vec![0.0; self.n_params];
        for (j, s) in self.site_scale.iter().enumerate() {
            per_param[self.site_param[j]] +=
                s.iter().zip(coefs).map(|(v, c)| v * c.abs()).sum::<f64>();
        }
        let abs = per_param.iter().map(|v| v * v).sum::<f64>().sqrt();
        let len = (coefs.len() * self.seq_len) as f64;
        u * (INPUT_ROUNDING + LAMBDA * len.sqrt()) * abs
    }
}
