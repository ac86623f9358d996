//! What a clipper's norms do to DP-SGD, measured against the truth (DESIGN.md §4), and the
//! derived tolerance bound that separates rounding from bugs (docs/tolerances.md).

use crate::clipper::Clipped;
use crate::error::{Error, Result};
use crate::factor::{self, Factored};
use candle_core::DType;
use ghost_oracle_reference::{Reference, SiteKind, Trace as RefTrace};
use serde::Serialize;

/// Unit roundoff of a dtype.
pub fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => f64::EPSILON / 2.0,
        DType::F16 => 2f64.powi(-11),
        DType::BF16 => 2f64.powi(-8),
        _ => f64::from(f32::EPSILON) / 2.0,
    }
}

/// Safety factor on the probabilistic √L growth of accumulated rounding error (Higham & Mary).
pub const LAMBDA: f64 = 8.0;
/// Rounding the trace itself to the clipper's precision perturbs each term by at most ~4u.
pub const INPUT_ROUNDING: f64 = 4.0;

/// Everything about a case that comes from the reference, not from the clipper.
#[derive(Clone, Debug)]
pub struct Truth {
    pub norms: Vec<f64>,
    /// ⟨g_i*, g_k*⟩ for every pair of examples.
    pub gram: Vec<Vec<f64>>,
    /// `scale[j][i]` = Σ_t ‖l_t‖‖r_t‖ of site j, example i: bounds |terms| of anything built on it.
    pub site_scale: Vec<Vec<f64>>,
    /// Parameter index of every site.
    pub site_param: Vec<usize>,
    pub params: Vec<String>,
    /// Per example, Σ|terms| of n² over the Gram route (own and 2× cross terms).
    pub abs_terms: Vec<f64>,
    /// Per example, Σ_params (Σ_{j∈p} √D_j)² with D_j = Σ_t ‖l_jt‖²‖r_jt‖²: the 2-norm scale of
    /// the dot-product rounding errors (Cauchy–Schwarz bound of √Σ term-scale²).
    pub dot_scale: Vec<f64>,
    /// max over sites of √p + √q (dot-product lengths).
    pub sqrt_width: f64,
    pub seq_len: usize,
    /// Per-example flattened true gradients (reference layout) and that layout.
    pub gradients: Vec<Vec<f64>>,
    pub layout: Vec<(String, Vec<usize>)>,
    /// 2⟨g_in, g_out⟩ / ‖g‖² per example, summed over shared parameters.
    pub cross_share: Vec<f64>,
}

fn row_norm(a: ndarray::ArrayView1<f64>) -> f64 {
    a.iter().map(|v| v * v).sum::<f64>().sqrt()
}

impl Truth {
    pub fn from_reference(r: &Reference) -> Result<Self> {
        let trace: &RefTrace = r
            .trace
            .as_ref()
            .ok_or_else(|| Error::internal("reference ran without a trace"))?;
        let gram = r
            .gradient_gram()
            .ok_or_else(|| Error::internal("reference ran without gradients"))?;
        let cross_share = r
            .examples
            .iter()
            .map(|e| e.shared.iter().map(|(_, s)| 2.0 * s.cross).sum::<f64>() / (e.norm * e.norm))
            .collect();
        let norms = r.examples.iter().map(|e| e.norm).collect();
        let gradients = r.gradients.clone().unwrap_or_default();
        Self::build(trace, norms, gram, gradients, r.layout.clone(), cross_share)
    }

    /// The truth of any trace, by the reference's brute force: every site's gradient
    /// materialized in f64, sites of a parameter summed (no model needed).
    pub fn from_trace(trace: &RefTrace) -> Result<Self> {
        let params = trace.params();
        let mut gradients = Vec::new();
        let mut layout = Vec::new();
        let mut norms = Vec::new();
        let mut cross_share = Vec::new();
        for i in 0..trace.batch_size() {
            // One pass materializes every site once: the summed gradient of each parameter,
            // and Σ_{j≠k}⟨G_j, G_k⟩ = ‖Σ_j G_j‖² − Σ_j ‖G_j‖² for the cross share.
            let (mut flat, mut total_sq, mut cross) = (Vec::new(), 0.0, 0.0);
            for (param, js) in &params {
                let mut sum: Option<ndarray::Array2<f64>> = None;
                let mut own_sq = 0.0;
                for &j in js {
                    let g = trace.site_gradient(j, i)?;
                    own_sq += g.iter().map(|v| v * v).sum::<f64>();
                    sum = Some(match sum {
                        None => g,
                        Some(acc) if acc.dim() == g.dim() => acc + g,
                        Some(acc) => {
                            return Err(Error::input(format!(
                                "parameter `{param}`: site `{}` writes a {:?} gradient but an earlier site writes {:?}",
                                trace.sites[j].spec.name,
                                g.dim(),
                                acc.dim()
                            )))
                        }
                    });
                }
                let sum = sum.expect("parameter has a site");
                let sq = sum.iter().map(|v| v * v).sum::<f64>();
                total_sq += sq;
                if js.len() > 1 {
                    cross += sq - own_sq;
                }
                if i == 0 {
                    layout.push((param.clone(), sum.shape().to_vec()));
                }
                flat.extend(sum.iter().copied());
            }
            if !total_sq.is_finite() {
                return Err(Error::input(format!(
                    "example {i}: the squared gradient norm overflows f64"
                )));
            }
            norms.push(total_sq.sqrt());
            cross_share.push(cross / total_sq);
            gradients.push(flat);
        }
        let gram = gradients
            .iter()
            .map(|a| {
                gradients
                    .iter()
                    .map(|b| a.iter().zip(b).map(|(x, y)| x * y).sum())
                    .collect()
            })
            .collect();
        Self::build(trace, norms, gram, gradients, layout, cross_share)
    }

    fn build(
        trace: &RefTrace,
        norms: Vec<f64>,
        gram: Vec<Vec<f64>>,
        gradients: Vec<Vec<f64>>,
        layout: Vec<(String, Vec<usize>)>,
        cross_share: Vec<f64>,
    ) -> Result<Self> {
        let params: Vec<String> = trace.params().into_iter().map(|(p, _)| p).collect();
        let mut site_param = Vec::new();
        let mut site_scale = Vec::new();
        let mut sqrt_width: f64 = 0.0;
        for s in &trace.sites {
            site_param.push(
                params
                    .iter()
                    .position(|p| *p == s.spec.param)
                    .expect("param of site"),
            );
            let (b, t, q) = s.backprops.dim();
            let p = match s.spec.kind {
                SiteKind::Embedding => s.spec.vocab.unwrap_or(1),
                SiteKind::Bias | SiteKind::LayerNorm => 1,
                _ => s.activations.as_ref().map_or(1, |a| a.dim().2),
            };
            sqrt_width = sqrt_width.max((p as f64).sqrt() + (q as f64).sqrt());
            let scale: Vec<f64> = (0..b)
                .map(|i| {
                    (0..t)
                        .map(|tt| {
                            let bp = s.backprops.slice(ndarray::s![i, tt, ..]);
                            match (s.spec.kind, &s.activations) {
                                (SiteKind::LayerNorm, Some(a)) => {
                                    let x = a.slice(ndarray::s![i, tt, ..]);
                                    bp.iter()
                                        .zip(x.iter())
                                        .map(|(u, v)| (u * v) * (u * v))
                                        .sum::<f64>()
                                        .sqrt()
                                }
                                (SiteKind::Linear | SiteKind::Conv1d, Some(a)) => {
                                    row_norm(bp) * row_norm(a.slice(ndarray::s![i, tt, ..]))
                                }
                                _ => row_norm(bp),
                            }
                        })
                        .sum()
                })
                .collect();
            site_scale.push(scale);
        }
        let (abs_terms, dot_scale) = term_statistics(trace, &site_param, params.len())?;
        Ok(Truth {
            norms,
            gram,
            site_scale,
            site_param,
            params,
            abs_terms,
            dot_scale,
            sqrt_width,
            seq_len: trace.sites.first().map_or(0, |s| s.backprops.dim().1),
            gradients,
            layout,
            cross_share,
        })
    }

    /// Relative bound on |n̂_i − n_i| / n_i for a clipper working in unit roundoff `u`
    /// (docs/tolerances.md): dot-product and input rounding, the T² accumulation of the terms,
    /// and the reference's own f64 rounding.
    pub fn norm_bound(&self, i: usize, u: f64) -> f64 {
        let n2 = self.norms[i] * self.norms[i];
        let t = self.seq_len as f64;
        let dots = LAMBDA * u * (INPUT_ROUNDING + self.sqrt_width) * self.dot_scale[i];
        let accumulation = LAMBDA * u * t * self.abs_terms[i];
        let largest = self
            .layout
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .max()
            .unwrap_or(1);
        let reference =
            LAMBDA * f64::EPSILON / 2.0 * (t + largest as f64).sqrt() * self.abs_terms[i];
        0.5 * (dots + accumulation + reference) / n2
    }
}

/// Σ|terms| and the dot-product scale per example, from the reference's f64 trace, with the same
/// Gram identity the clippers use (evaluated in f64 on the CPU).
fn term_statistics(
    trace: &RefTrace,
    site_param: &[usize],
    n_params: usize,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let t = crate::trace::Trace::from_reference(trace, DType::F64, &candle_core::Device::Cpu)?;
    let factored: Vec<Factored> = t.sites.iter().map(Factored::of).collect::<Result<_>>()?;
    let b = t.batch_size();
    let mut abs_terms = vec![0.0; b];
    let mut sqrt_d = vec![vec![0.0; b]; n_params];
    for (j, f) in factored.iter().enumerate() {
        let (abs, diag) = factor::term_magnitudes(f, f, DType::F64)?;
        for (i, (a, d)) in factor::to_f64_vec(&abs)?
            .into_iter()
            .zip(factor::to_f64_vec(&diag)?)
            .enumerate()
        {
            abs_terms[i] += a;
            sqrt_d[site_param[j]][i] += d.max(0.0).sqrt();
        }
    }
    for (_, j, k) in t.shared_pairs() {
        let (abs, _) = factor::term_magnitudes(&factored[j], &factored[k], DType::F64)?;
        for (i, a) in factor::to_f64_vec(&abs)?.into_iter().enumerate() {
            abs_terms[i] += 2.0 * a;
        }
    }
    let dot_scale = (0..b)
        .map(|i| sqrt_d.iter().map(|p| p[i] * p[i]).sum())
        .collect();
    Ok((abs_terms, dot_scale))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    Pass,
    UtilityDistortion,
    PrivacyViolation,
}

impl Verdict {
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::UtilityDistortion => "utility-distortion",
            Verdict::PrivacyViolation => "privacy-violation",
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct ExampleMetrics {
    pub true_norm: f64,
    pub norm: f64,
    pub norm_rel_err: f64,
    pub bound: f64,
    /// norm_rel_err / bound.
    pub err_units: f64,
    pub coefficient: f64,
    pub true_coefficient: f64,
    pub sensitivity: f64,
    pub flipped: bool,
    pub cross_share: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct CaseMetrics {
    pub case: String,
    pub max_grad_norm: f64,
    pub noise_multiplier: f64,
    pub verdict: Verdict,
    pub worst_example: usize,
    pub max_norm_rel_err: f64,
    pub max_err_units: f64,
    pub max_coef_abs_diff: f64,
    pub decision_flips: usize,
    pub max_sensitivity_ratio: f64,
    pub effective_noise_multiplier: f64,
    pub effective_noise_ratio: f64,
    pub reference_noise_ratio: f64,
    pub clipped_sum_cosine: f64,
    pub clipped_sum_rel_err: f64,
    pub clipped_sum_bound: f64,
    pub max_cross_share: f64,
    pub examples: Vec<ExampleMetrics>,
}

fn quad(k: &[Vec<f64>], a: &[f64], b: &[f64]) -> f64 {
    let mut s = 0.0;
    for (i, ai) in a.iter().enumerate() {
        for (j, bj) in b.iter().enumerate() {
            s += ai * k[i][j] * bj;
        }
    }
    s
}

/// Compares a clipper's output with the truth at clipping norm C and noise multiplier σ.
pub fn evaluate(
    case: &str,
    truth: &Truth,
    clipped: &Clipped,
    max_grad_norm: f64,
    noise_multiplier: f64,
    u: f64,
) -> Result<CaseMetrics> {
    let c = max_grad_norm;
    let b = truth.norms.len();
    if clipped.report.norms.len() != b || clipped.coefficients.len() != b {
        return Err(Error::input(format!(
            "case {case}: the clipper returned {} norms and {} coefficients for a batch of {b}",
            clipped.report.norms.len(),
            clipped.coefficients.len()
        )));
    }
    let true_coefs = crate::clipper::clip_coefficients(&truth.norms, c);
    let mut examples = Vec::with_capacity(b);
    for (i, &true_coef) in true_coefs.iter().enumerate() {
        let (n, nt) = (clipped.report.norms[i], truth.norms[i]);
        let bound = truth.norm_bound(i, u);
        let rel = if nt > 0.0 {
            (n - nt).abs() / nt
        } else if n == 0.0 {
            0.0
        } else {
            f64::INFINITY
        };
        let coef = clipped.coefficients[i];
        examples.push(ExampleMetrics {
            true_norm: nt,
            norm: n,
            norm_rel_err: if rel.is_nan() { f64::INFINITY } else { rel },
            bound,
            err_units: if rel.is_nan() {
                f64::INFINITY
            } else {
                rel / bound
            },
            coefficient: coef,
            true_coefficient: true_coef,
            sensitivity: if coef.is_nan() {
                f64::INFINITY
            } else {
                coef * nt / c
            },
            flipped: (n > c) != (nt > c),
            cross_share: truth.cross_share[i],
        });
    }
    let fmax = |f: &dyn Fn(&ExampleMetrics) -> f64| examples.iter().map(f).fold(0.0_f64, f64::max);
    let privacy = examples.iter().any(|e| e.sensitivity > 1.0 + e.bound);
    let coef_off = examples.iter().any(|e| {
        let d = (e.coefficient - e.true_coefficient).abs();
        d.is_nan() || d > e.true_coefficient * 2.0 * e.bound + f64::EPSILON
    });
    let norms_off = examples.iter().any(|e| e.err_units > 1.0);

    // Noise over clipped signal, from the true per-example gradients: ‖Σ c_i g_i*‖² = cᵀKc.
    let coefs_for_sum: Vec<f64> = clipped
        .coefficients
        .iter()
        .map(|v| if v.is_nan() { 0.0 } else { *v })
        .collect();
    let sig = quad(&truth.gram, &coefs_for_sum, &coefs_for_sum)
        .max(0.0)
        .sqrt();
    let sig_ref = quad(&truth.gram, &true_coefs, &true_coefs).max(0.0).sqrt();
    let cosine = quad(&truth.gram, &coefs_for_sum, &true_coefs) / (sig * sig_ref);
    let (sum_err, sum_bound) = clipped_sum_error(truth, clipped, &coefs_for_sum, u)?;
    let sum_off = sum_err > sum_bound;

    let verdict = if privacy {
        Verdict::PrivacyViolation
    } else if norms_off || coef_off || sum_off {
        Verdict::UtilityDistortion
    } else {
        Verdict::Pass
    };
    let worst_example = match verdict {
        Verdict::PrivacyViolation => argmax(examples.iter().map(|e| e.sensitivity - e.bound)),
        _ => argmax(examples.iter().map(|e| e.err_units)),
    };
    let max_ratio = fmax(&|e| e.sensitivity);
    Ok(CaseMetrics {
        case: case.to_string(),
        max_grad_norm: c,
        noise_multiplier,
        verdict,
        worst_example,
        max_norm_rel_err: fmax(&|e| e.norm_rel_err),
        max_err_units: fmax(&|e| e.err_units),
        max_coef_abs_diff: fmax(&|e| (e.coefficient - e.true_coefficient).abs()),
        decision_flips: examples.iter().filter(|e| e.flipped).count(),
        max_sensitivity_ratio: max_ratio,
        effective_noise_multiplier: noise_multiplier / max_ratio.max(1.0),
        effective_noise_ratio: noise_multiplier * c / sig,
        reference_noise_ratio: noise_multiplier * c / sig_ref,
        clipped_sum_cosine: cosine,
        clipped_sum_rel_err: sum_err,
        clipped_sum_bound: sum_bound,
        max_cross_share: fmax(&|e| e.cross_share.abs()),
        examples,
    })
}

fn argmax(v: impl Iterator<Item = f64>) -> usize {
    let mut best = (0, f64::NEG_INFINITY);
    for (i, x) in v.enumerate() {
        let x = if x.is_nan() { f64::INFINITY } else { x };
        if x > best.1 {
            best = (i, x);
        }
    }
    best.0
}

/// ‖S − S*‖ / ‖S*‖ for the clipped sum, with S* = Σ_i c_i g_i* from the true gradients and the
/// clipper's own coefficients, and its bound from the same per-site scales.
fn clipped_sum_error(
    truth: &Truth,
    clipped: &Clipped,
    coefs: &[f64],
    u: f64,
) -> Result<(f64, f64)> {
    // An external clipper's trace carries norms only: there is no clipped sum to check.
    if truth.gradients.is_empty() || clipped.clipped_sum.is_empty() {
        return Ok((0.0, f64::INFINITY));
    }
    let mut err2 = 0.0;
    let mut ref2 = 0.0;
    let mut offset = 0;
    for (name, shape) in &truth.layout {
        let n: usize = shape.iter().product();
        let got = clipped
            .clipped_sum
            .iter()
            .find(|(p, _)| p == name)
            .ok_or_else(|| {
                Error::input(format!(
                    "the clipper's clipped sum has no entry for parameter `{name}`"
                ))
            })?;
        let got: Vec<f64> = got.1.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        if got.len() != n {
            return Err(Error::input(format!(
                "clipped sum of `{name}` has {} values; expected {n}",
                got.len()
            )));
        }
        for (k, g) in got.iter().enumerate() {
            let want: f64 = truth
                .gradients
                .iter()
                .zip(coefs)
                .map(|(gi, c)| c * gi[offset + k])
                .sum();
            err2 += (g - want) * (g - want);
            ref2 += want * want;
        }
        offset += n;
    }
    let mut per_param = vec![0.0; truth.params.len()];
    for (j, s) in truth.site_scale.iter().enumerate() {
        per_param[truth.site_param[j]] +=
            s.iter().zip(coefs).map(|(v, c)| v * c.abs()).sum::<f64>();
    }
    let abs = per_param.iter().map(|v| v * v).sum::<f64>().sqrt();
    // Each entry of S accumulates B·T products.
    let len = (truth.norms.len() * truth.seq_len) as f64;
    let bound = u * (INPUT_ROUNDING + LAMBDA * len.sqrt()) * abs / ref2.sqrt();
    Ok(((err2 / ref2).sqrt(), bound))
}
