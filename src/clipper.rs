//! The `Clipper` trait and the built-in clippers: `materialize`, `ghost` and `ghost-tied`.

use crate::error::{Error, Result};
use crate::factor::{self, Factored};
use crate::trace::Trace;
use candle_core::{DType, Tensor};

/// ⟨G_j, G_k⟩ per example for two sites of one parameter.
#[derive(Clone, Debug, PartialEq)]
pub struct CrossTerm {
    pub param: String,
    pub sites: (usize, usize),
    pub values: Vec<f64>,
}

/// Per-example norms with the parts they were summed from.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct NormReport {
    /// The norm each example is clipped by.
    pub norms: Vec<f64>,
    /// `site_sq[j][i]`: site j's own squared norm for example i, as this clipper computed it.
    pub site_sq: Vec<Vec<f64>>,
    /// Cross terms this clipper included (empty for `ghost`).
    pub cross: Vec<CrossTerm>,
    /// Things a user must know (e.g. `ghost` ignoring a shared parameter).
    pub warnings: Vec<String>,
}

/// What a clipper hands the optimizer: coefficients and the clipped gradient sum Σ_i c_i g_i.
#[derive(Clone, Debug)]
pub struct Clipped {
    pub report: NormReport,
    pub coefficients: Vec<f64>,
    /// (parameter, Σ_i c_i g_i in the parameter's layout), in first-use order.
    pub clipped_sum: Vec<(String, Tensor)>,
}

/// The interface a clipper backend implements. A clipper sees only the trace (per-site
/// factors); it must not run the model again.
///
/// ```
/// use ghost_oracle::{Clipper, TiedGhostClipper};
/// let clipper = TiedGhostClipper;
/// assert_eq!(clipper.name(), "ghost-tied");
/// ```
pub trait Clipper {
    fn name(&self) -> String;

    /// Per-example gradient norms from the trace, in the trace's dtype and device.
    fn norms(&self, trace: &Trace) -> Result<NormReport>;

    /// Norms, clipping coefficients c_i = min(1, C / n_i) and Σ_i c_i g_i from the factors.
    fn clip(&self, trace: &Trace, max_grad_norm: f64) -> Result<Clipped> {
        let report = self.norms(trace)?;
        let coefficients = clip_coefficients(&report.norms, max_grad_norm);
        let clipped_sum = clipped_sum(trace, &coefficients)?;
        Ok(Clipped {
            report,
            coefficients,
            clipped_sum,
        })
    }
}

/// c = min(1, C / n). A NaN norm gives a NaN coefficient rather than silently 1.
pub fn clip_coefficients(norms: &[f64], max_grad_norm: f64) -> Vec<f64> {
    norms
        .iter()
        .map(|&n| {
            if n.is_nan() {
                f64::NAN
            } else if n > max_grad_norm {
                max_grad_norm / n
            } else {
                1.0
            }
        })
        .collect()
}

/// Σ_i c_i g_i per parameter, from the factors (one weighted product per site).
pub fn clipped_sum(trace: &Trace, coefficients: &[f64]) -> Result<Vec<(String, Tensor)>> {
    let dtype = trace.dtype();
    let w = Tensor::from_vec(coefficients.to_vec(), coefficients.len(), &trace.device())?
        .to_dtype(dtype)?;
    trace
        .params()
        .into_iter()
        .map(|p| {
            let mut acc: Option<Tensor> = None;
            for &j in &p.sites {
                let s = factor::weighted_sum(&Factored::of(&trace.sites[j])?, &w)?;
                acc = Some(match acc {
                    None => s,
                    Some(a) => (a + s)?,
                });
            }
            Ok((p.param, acc.expect("a parameter has at least one site")))
        })
        .collect()
}

fn own_norms(trace: &Trace, factored: &[Factored], dtype: DType) -> Result<Vec<Vec<f64>>> {
    factored
        .iter()
        .map(|f| {
            if f.prefers_gram() {
                factor::inner(f, f, dtype)
            } else {
                (0..trace.batch_size())
                    .map(|i| factor::sum_sq(&factor::materialize(f, i, dtype)?))
                    .collect()
            }
        })
        .collect()
}

fn factor_all(trace: &Trace) -> Result<Vec<Factored>> {
    trace.sites.iter().map(Factored::of).collect()
}

pub(crate) fn finish(
    site_sq: Vec<Vec<f64>>,
    cross: Vec<CrossTerm>,
    batch: usize,
    warnings: Vec<String>,
) -> NormReport {
    let norms = (0..batch)
        .map(|i| {
            let own: f64 = site_sq.iter().map(|s| s[i]).sum();
            let x: f64 = cross.iter().map(|c| 2.0 * c.values[i]).sum();
            (own + x).max(0.0).sqrt()
        })
        .collect();
    NormReport {
        norms,
        site_sq,
        cross,
        warnings,
    }
}

/// Standard ghost clipping as DP libraries ship it: every site's own norm, by the Gram identity
/// or by materialization, whichever is cheaper (mixed ghost); cross terms between two uses of one
/// parameter are dropped.
#[derive(Clone, Copy, Debug, Default)]
pub struct GhostClipper;

impl Clipper for GhostClipper {
    fn name(&self) -> String {
        "ghost".into()
    }

    fn norms(&self, trace: &Trace) -> Result<NormReport> {
        let factored = factor_all(trace)?;
        let site_sq = own_norms(trace, &factored, trace.dtype())?;
        let warnings = trace
            .params()
            .into_iter()
            .filter(|p| p.sites.len() > 1)
            .map(|p| {
                format!(
                    "ghost: parameter `{}` is used by {} sites; their cross terms are ignored, so its norm is wrong",
                    p.param,
                    p.sites.len()
                )
            })
            .collect();
        Ok(finish(site_sq, Vec::new(), trace.batch_size(), warnings))
    }
}

/// Exact ghost clipping for shared parameters: standard ghost plus 2⟨G_j, G_k⟩ for every pair of
/// sites of one parameter, by the same Gram identity. For a tied embedding / LM head the cross
/// term costs O(T²d) against the head's own O(T²V).
#[derive(Clone, Copy, Debug, Default)]
pub struct TiedGhostClipper;

impl Clipper for TiedGhostClipper {
    fn name(&self) -> String {
        "ghost-tied".into()
    }

    fn norms(&self, trace: &Trace) -> Result<NormReport> {
        let factored = factor_all(trace)?;
        let dtype = trace.dtype();
        // Cross terms before the own norms: the site's d-wide factors they read are then still
        // in cache for the own norms' small Grams. Computed after the head's V-wide Gram, which
        // streams B×T×V values through the cache, they cost twice as much (docs/results.md).
        let cross = trace
            .shared_pairs()
            .into_iter()
            .map(|(param, j, k)| {
                let values = factor::inner(&factored[j], &factored[k], dtype)
                    .map_err(|e| e.context(format!("parameter `{param}`")))?;
                Ok(CrossTerm {
                    param,
                    sites: (j, k),
                    values,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let site_sq = own_norms(trace, &factored, dtype)?;
        Ok(finish(site_sq, cross, trace.batch_size(), Vec::new()))
    }
}

/// Per-example materialization: every parameter's gradient built example by example (sites of a
/// shared parameter summed), then its norm. Exact, and memory-hungry on large vocabularies.
#[derive(Clone, Copy, Debug, Default)]
pub struct MaterializeClipper;

impl Clipper for MaterializeClipper {
    fn name(&self) -> String {
        "materialize".into()
    }

    fn norms(&self, trace: &Trace) -> Result<NormReport> {
        let factored = factor_all(trace)?;
        let dtype = trace.dtype();
        let b = trace.batch_size();
        let mut site_sq = vec![vec![0.0; b]; trace.sites.len()];
        let mut cross: Vec<CrossTerm> = trace
            .shared_pairs()
            .into_iter()
            .map(|(param, j, k)| CrossTerm {
                param,
                sites: (j, k),
                values: vec![0.0; b],
            })
            .collect();
        let mut norms = vec![0.0; b];
        for (i, norm) in norms.iter_mut().enumerate() {
            let mut total = 0.0;
            for p in trace.params() {
                let mats: Vec<Tensor> = p
                    .sites
                    .iter()
                    .map(|&j| factor::materialize(&factored[j], i, dtype))
                    .collect::<Result<_>>()?;
                let sum = mats
                    .iter()
                    .skip(1)
                    .try_fold(mats[0].clone(), |acc, m| acc + m)?;
                total += factor::sum_sq(&sum)?;
                for (m, &j) in mats.iter().zip(&p.sites) {
                    site_sq[j][i] = factor::sum_sq(m)?;
                }
                for c in cross.iter_mut().filter(|c| c.param == p.param) {
                    let a = p
                        .sites
                        .iter()
                        .position(|&j| j == c.sites.0)
                        .expect("site of param");
                    let bb = p
                        .sites
                        .iter()
                        .position(|&j| j == c.sites.1)
                        .expect("site of param");
                    c.values[i] = factor::dot_all(&mats[a], &mats[bb])?;
                }
            }
            *norm = total.sqrt();
        }
        // The norm of the summed gradient itself, not own + 2·cross: that is what materializing means.
        Ok(NormReport {
            norms,
            site_sq,
            cross,
            warnings: Vec::new(),
        })
    }
}

/// The built-in clipper of a CLI name.
pub fn builtin(name: &str) -> Result<Box<dyn Clipper>> {
    match name {
        "materialize" => Ok(Box::new(MaterializeClipper)),
        "ghost" => Ok(Box::new(GhostClipper)),
        "ghost-tied" => Ok(Box::new(TiedGhostClipper)),
        other => match other.strip_prefix("mutant:").map(crate::mutants::Mutant::parse) {
            Some(Some(m)) => Ok(Box::new(crate::mutants::MutantClipper(m))),
            _ => Err(Error::input(format!(
                "--clipper: unknown clipper `{other}`; expected one of: {}, or mutant:NAME (see `ghost-oracle mutants --list`)",
                BUILTIN_CLIPPERS.join(", ")
            ))),
        },
    }
}

pub const BUILTIN_CLIPPERS: [&str; 3] = ["materialize", "ghost", "ghost-tied"];
