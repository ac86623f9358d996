//! Deviations in how per-example norms are formed: the Gram products' precision, a site's own
//! norm, the sites of a shared parameter, a factor on every norm.

use super::Deviation;
use crate::clippers::gram::{self, Factor, Factored};
use crate::clippers::{finish, Clipper, CrossTerm, NormReport, TiedGhostClipper};
use crate::error::Result;
use crate::trace::{SiteKind, Trace};
use candle_core::{DType, Tensor};

/// The dtype the Gram products are accumulated in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GramIn {
    /// The dtype the clipper computes in.
    ClipperDtype,
    F16,
    Bf16,
}

/// How a site's own norm² is formed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OwnNorm {
    /// By the Gram identity, every site.
    Exact,
    /// An embedding's as Σ_t‖e_t‖², as if no token repeated; other sites exact.
    EmbeddingWithoutRepeats,
    /// A bias's as ‖ΔΔᵀ‖_F instead of Σ(ΔΔᵀ); other sites exact.
    BiasFrobenius,
    /// A linear or Conv1D weight's as ‖Σ_t δ_t‖²·‖Σ_t a_t‖², the non-sequence formula; other
    /// sites exact.
    SequenceCollapsed,
}

/// How the sites of a shared parameter combine into its norm².
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shared {
    /// Own norms plus 2⟨G_j, G_k⟩ for every pair of sites.
    Exact,
    /// Own norms only, as if the sites were different parameters.
    NoCross,
    /// Only the site backward computes last (the first in forward order: the embedding).
    LastWriter,
    /// Only the site backward computes first (the last in forward order: the LM head).
    FirstWriter,
    /// k times the sum of the own norms, for k uses: the Cauchy–Schwarz bound.
    CauchySchwarz,
    /// Own norms minus the cross terms.
    FlippedCross,
}

/// A factor on every per-example norm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormScale {
    Exact,
    /// 1/B: the norms of the batch-mean loss.
    BatchMean,
}

/// The arithmetic the final sum of squares is taken in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SquaresIn {
    /// The clipper's own (the Gram identity's per-site terms, summed in f64).
    ClipperDtype,
    /// The example's gradient materialized, every entry squared into f16 and the squares
    /// added into an f16 running sum: a square below f16's smallest subnormal (an entry under
    /// about 2.4e-4) is 0, an addend below half an ulp of the running sum is lost, so the norm
    /// only ever comes out low; one whose every square underflows is 0, and an example with
    /// norm 0 is never clipped.
    F16,
}

impl Deviation {
    /// Whether every column that forms the norms is exact.
    fn norms_are_exact(&self) -> bool {
        self.gram == GramIn::ClipperDtype
            && self.own_norm == OwnNorm::Exact
            && self.shared == Shared::Exact
            && self.norm_scale == NormScale::Exact
            && self.squares_in == SquaresIn::ClipperDtype
    }

    /// The per-example norms of `trace` this deviation computes: exact tied ghost clipping's
    /// where no norm column deviates, else the Gram identity with the deviating steps.
    pub(super) fn norms(&self, trace: &Trace) -> Result<NormReport> {
        if self.norms_are_exact() {
            return TiedGhostClipper.norms(trace);
        }
        if self.squares_in == SquaresIn::F16 {
            return f16_sum_of_squares(trace);
        }
        let dtype = trace.dtype();
        let factored: Vec<Factored> = trace
            .sites
            .iter()
            .map(Factored::of)
            .collect::<Result<_>>()?;
        let mut site_sq = trace
            .sites
            .iter()
            .zip(&factored)
            .map(|(s, f)| self.own(s.spec.kind, f, dtype))
            .collect::<Result<Vec<_>>>()?;
        let mut cross = Vec::new();
        for p in trace.params().into_iter().filter(|p| p.sites.len() > 1) {
            // Forward order is the reverse of backward: the embedding is the last writer.
            let keep_only = |keep: usize, site_sq: &mut [Vec<f64>]| {
                for &j in p.sites.iter().filter(|&&j| j != keep) {
                    site_sq[j].iter_mut().for_each(|v| *v = 0.0);
                }
            };
            match self.shared {
                Shared::NoCross => {}
                Shared::LastWriter => keep_only(p.sites[0], &mut site_sq),
                Shared::FirstWriter => keep_only(*p.sites.last().unwrap(), &mut site_sq),
                Shared::CauchySchwarz => {
                    let k = p.sites.len() as f64;
                    for &j in &p.sites {
                        site_sq[j].iter_mut().for_each(|v| *v *= k);
                    }
                }
                Shared::Exact | Shared::FlippedCross => {
                    for (a, &j) in p.sites.iter().enumerate() {
                        for &k in &p.sites[a + 1..] {
                            let mut values = self.inner(&factored[j], &factored[k], dtype)?;
                            if self.shared == Shared::FlippedCross {
                                values.iter_mut().for_each(|v| *v = -*v);
                            }
                            cross.push(CrossTerm {
                                param: p.param.clone(),
                                sites: (j, k),
                                values,
                            });
                        }
                    }
                }
            }
        }
        let mut report = finish(site_sq, cross, trace.batch_size(), Vec::new());
        match self.norm_scale {
            NormScale::Exact => {}
            NormScale::BatchMean => {
                let b = trace.batch_size() as f64;
                report.norms.iter_mut().for_each(|n| *n /= b);
            }
        }
        Ok(report)
    }

    /// The dtype the Gram products are accumulated in, for a clipper computing in `dtype`.
    fn gram_dtype(&self, dtype: DType) -> DType {
        match self.gram {
            GramIn::ClipperDtype => dtype,
            GramIn::F16 => DType::F16,
            GramIn::Bf16 => DType::BF16,
        }
    }

    /// ⟨G_a, G_b⟩ per example, by the Gram identity in [`Self::gram_dtype`].
    fn inner(&self, a: &Factored, b: &Factored, dtype: DType) -> Result<Vec<f64>> {
        let gram_dtype = self.gram_dtype(dtype);
        if gram_dtype == dtype {
            gram::inner(a, b, dtype)
        } else {
            gram::inner(
                &to_half(a, gram_dtype)?,
                &to_half(b, gram_dtype)?,
                gram_dtype,
            )
        }
    }

    /// A site's own norm² per example.
    fn own(&self, kind: SiteKind, f: &Factored, dtype: DType) -> Result<Vec<f64>> {
        match self.own_norm {
            OwnNorm::EmbeddingWithoutRepeats if kind == SiteKind::Embedding => {
                let r = dense(&f.right).expect("embedding right factor is dense");
                per_example(&r.sqr()?.sum((1, 2))?)
            }
            OwnNorm::BiasFrobenius if kind == SiteKind::Bias => {
                let g = gram::gram(&f.left, &f.left, dtype)?;
                per_example(&g.sqr()?.sum((1, 2))?.sqrt()?)
            }
            OwnNorm::SequenceCollapsed if matches!(kind, SiteKind::Linear | SiteKind::Conv1d) => {
                let (l, r) = (
                    dense(&f.left).expect("dense"),
                    dense(&f.right).expect("dense"),
                );
                let ls = l.sum(1)?.sqr()?.sum(1)?;
                let rs = r.sum(1)?.sqr()?.sum(1)?;
                per_example(&(ls * rs)?)
            }
            // Every other site of those three: the exact own norm.
            OwnNorm::Exact
            | OwnNorm::EmbeddingWithoutRepeats
            | OwnNorm::BiasFrobenius
            | OwnNorm::SequenceCollapsed => self.inner(f, f, dtype),
        }
    }
}

/// Every example's norm from its materialized gradient, the squares and their running sum in
/// f16 (parameter by parameter, the sites of a shared parameter summed first, so the norm is of
/// the right gradient and only the arithmetic is wrong). Per-site terms are reported as the
/// exact clipper's, the norms as computed here.
fn f16_sum_of_squares(trace: &Trace) -> Result<NormReport> {
    use half::f16;
    let mut report = TiedGhostClipper.norms(trace)?;
    let factored: Vec<Factored> = trace
        .sites
        .iter()
        .map(Factored::of)
        .collect::<Result<_>>()?;
    let params = trace.params();
    for (i, norm) in report.norms.iter_mut().enumerate() {
        let mut sum = f16::ZERO;
        for p in &params {
            let mut g: Option<Tensor> = None;
            for &j in &p.sites {
                let m = gram::materialize(&factored[j], i, trace.dtype())?.to_dtype(DType::F64)?;
                g = Some(match g {
                    None => m,
                    Some(acc) => (acc + m)?,
                });
            }
            let g = g.expect("a parameter has at least one site");
            for v in g.flatten_all()?.to_vec1::<f64>()? {
                let x = f16::from_f64(v);
                sum = f16::from_f32(f32::from(sum) + f32::from(x * x));
            }
        }
        *norm = f64::from(sum).sqrt();
    }
    Ok(report)
}

fn per_example(t: &Tensor) -> Result<Vec<f64>> {
    crate::trace::to_f64_vec(t)
}

fn dense(f: &Factor) -> Option<&Tensor> {
    match f {
        Factor::Dense(t) => Some(t),
        Factor::OneHot { .. } | Factor::Ones { .. } => None,
    }
}

fn to_half(f: &Factored, half: DType) -> Result<Factored> {
    let conv = |x: &Factor| -> Result<Factor> {
        Ok(match x {
            Factor::Dense(t) => Factor::Dense(t.to_dtype(half)?),
            other => other.clone(),
        })
    };
    Ok(Factored {
        left: conv(&f.left)?,
        right: conv(&f.right)?,
    })
}
