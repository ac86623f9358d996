//! Seeded bugs: clippers that reproduce failure modes found in real DP libraries
//! (docs/detection.md). The oracle is worth its power to catch every one of them.

mod kill_matrix;

pub use kill_matrix::{
    kill_matrix, kill_matrix_html, kill_matrix_json, kill_matrix_table, KillMatrix,
};

use crate::clippers::gram::{self, Factor, Factored};
use crate::clippers::{finish, Clipper, CrossTerm, NormReport};
use crate::error::Result;
use crate::trace::{SiteKind, Trace};
use candle_core::{DType, Tensor};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutant {
    DropCross,
    LastWriter,
    FirstWriter,
    CauchySchwarz,
    NoRepeatMerge,
    BiasFrobenius,
    SequenceCollapse,
    BatchMeanLoss,
    F16Gram,
    Bf16Gram,
    FlippedCross,
}

/// What the audit must say about a mutant wherever it catches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpectedVerdict {
    /// Under-estimates norms: a privacy violation wherever an affected example is clipped.
    PrivacyViolation,
    /// Over-estimates only (safe): never a privacy violation, a utility distortion somewhere.
    NeverPrivacyViolation,
    /// Either direction depending on the data: flagged somewhere.
    Flagged,
}

impl Mutant {
    pub const ALL: [Mutant; 11] = [
        Mutant::DropCross,
        Mutant::LastWriter,
        Mutant::FirstWriter,
        Mutant::CauchySchwarz,
        Mutant::NoRepeatMerge,
        Mutant::BiasFrobenius,
        Mutant::SequenceCollapse,
        Mutant::BatchMeanLoss,
        Mutant::F16Gram,
        Mutant::Bf16Gram,
        Mutant::FlippedCross,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Mutant::DropCross => "drop-cross",
            Mutant::LastWriter => "last-writer",
            Mutant::FirstWriter => "first-writer",
            Mutant::CauchySchwarz => "cauchy-schwarz",
            Mutant::NoRepeatMerge => "no-repeat-merge",
            Mutant::BiasFrobenius => "bias-frobenius",
            Mutant::SequenceCollapse => "sequence-collapse",
            Mutant::BatchMeanLoss => "batch-mean-loss",
            Mutant::F16Gram => "f16-gram",
            Mutant::Bf16Gram => "bf16-gram",
            Mutant::FlippedCross => "flipped-cross",
        }
    }

    /// The library behaviour the mutant reproduces.
    pub fn reproduces(self) -> &'static str {
        match self {
            Mutant::DropCross => "tied sites summed as if disjoint (Opacus FSDP ghost class; JAX custom_vjp stacks)",
            Mutant::LastWriter => "per-sample norm overwritten by the last site computed in backward: embedding only (fastDP)",
            Mutant::FirstWriter => "only the first site computed in backward kept: LM head only",
            Mutant::CauchySchwarz => "sqrt(k·Σ‖G_j‖²) for a layer used k times (TF Privacy): safe, over-clips",
            Mutant::NoRepeatMerge => "embedding norm Σ_t‖e_t‖², ignoring repeated tokens",
            Mutant::BiasFrobenius => "bias norm² as ‖ΔΔᵀ‖_F instead of Σ(ΔΔᵀ) (Opacus before PR 751)",
            Mutant::SequenceCollapse => "non-sequence formula ‖Σ_t δ_t‖·‖Σ_t a_t‖ applied to sequences",
            Mutant::BatchMeanLoss => "norms of the batch-mean loss: 1/B too small",
            Mutant::F16Gram => "Gram matrices accumulated in f16",
            Mutant::Bf16Gram => "Gram matrices accumulated in bf16",
            Mutant::FlippedCross => "cross term with the wrong sign",
        }
    }

    pub fn expected(self) -> ExpectedVerdict {
        match self {
            Mutant::BatchMeanLoss => ExpectedVerdict::PrivacyViolation,
            Mutant::CauchySchwarz => ExpectedVerdict::NeverPrivacyViolation,
            _ => ExpectedVerdict::Flagged,
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Mutant::ALL.into_iter().find(|m| m.name() == name)
    }
}

/// A clipper by name: a built-in one, or `mutant:NAME` for a seeded bug.
pub fn clipper_by_name(name: &str) -> crate::error::Result<Box<dyn Clipper>> {
    if let Some(c) = crate::clippers::builtin(name) {
        return Ok(c);
    }
    match name.strip_prefix("mutant:").map(Mutant::parse) {
        Some(Some(m)) => Ok(Box::new(MutantClipper(m))),
        _ => Err(crate::error::Error::input(format!(
            "--clipper: unknown clipper `{name}`; expected one of: {}, or mutant:NAME (see `ghost-oracle mutants --list`)",
            crate::clippers::BUILTIN_CLIPPERS.join(", ")
        ))),
    }
}

/// The clippers of a list of names (`--clipper`, repeatable), or of `default` when the list is
/// empty.
pub fn clippers_by_name(
    names: &[String],
    default: &[&str],
) -> crate::error::Result<Vec<Box<dyn Clipper>>> {
    if names.is_empty() {
        default.iter().map(|n| clipper_by_name(n)).collect()
    } else {
        names.iter().map(|n| clipper_by_name(n)).collect()
    }
}

/// A clipper with one seeded bug; otherwise exact tied ghost clipping.
#[derive(Clone, Copy, Debug)]
pub struct MutantClipper(pub Mutant);

fn per_example(t: &Tensor) -> Result<Vec<f64>> {
    gram::to_f64_vec(t)
}

fn dense(f: &Factor) -> Option<&Tensor> {
    match f {
        Factor::Dense(t) => Some(t),
        _ => None,
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

impl MutantClipper {
    fn inner(&self, a: &Factored, b: &Factored, dtype: DType) -> Result<Vec<f64>> {
        match self.0 {
            Mutant::F16Gram | Mutant::Bf16Gram => {
                let half = if self.0 == Mutant::F16Gram {
                    DType::F16
                } else {
                    DType::BF16
                };
                gram::inner(&to_half(a, half)?, &to_half(b, half)?, half)
            }
            _ => gram::inner(a, b, dtype),
        }
    }

    fn own(&self, kind: SiteKind, f: &Factored, dtype: DType) -> Result<Vec<f64>> {
        match (self.0, kind) {
            (Mutant::NoRepeatMerge, SiteKind::Embedding) => {
                let r = dense(&f.right).expect("embedding right factor is dense");
                per_example(&r.sqr()?.sum((1, 2))?)
            }
            (Mutant::BiasFrobenius, SiteKind::Bias) => {
                let g = gram::gram(&f.left, &f.left, dtype)?;
                per_example(&g.sqr()?.sum((1, 2))?.sqrt()?)
            }
            (Mutant::SequenceCollapse, SiteKind::Linear | SiteKind::Conv1d) => {
                let (l, r) = (
                    dense(&f.left).expect("dense"),
                    dense(&f.right).expect("dense"),
                );
                let ls = l.sum(1)?.sqr()?.sum(1)?;
                let rs = r.sum(1)?.sqr()?.sum(1)?;
                per_example(&(ls * rs)?)
            }
            _ => self.inner(f, f, dtype),
        }
    }
}

impl Clipper for MutantClipper {
    fn name(&self) -> String {
        format!("mutant:{}", self.0.name())
    }

    fn norms(&self, trace: &Trace) -> Result<NormReport> {
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
            match self.0 {
                Mutant::DropCross => {}
                // Forward order is the reverse of backward: the embedding is the last writer.
                Mutant::LastWriter | Mutant::FirstWriter => {
                    let keep = if self.0 == Mutant::LastWriter {
                        p.sites[0]
                    } else {
                        *p.sites.last().unwrap()
                    };
                    for &j in p.sites.iter().filter(|&&j| j != keep) {
                        site_sq[j].iter_mut().for_each(|v| *v = 0.0);
                    }
                }
                Mutant::CauchySchwarz => {
                    let k = p.sites.len() as f64;
                    for &j in &p.sites {
                        site_sq[j].iter_mut().for_each(|v| *v *= k);
                    }
                }
                _ => {
                    for (a, &j) in p.sites.iter().enumerate() {
                        for &k in &p.sites[a + 1..] {
                            let mut values = self.inner(&factored[j], &factored[k], dtype)?;
                            if self.0 == Mutant::FlippedCross {
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
        if self.0 == Mutant::BatchMeanLoss {
            let b = trace.batch_size() as f64;
            report.norms.iter_mut().for_each(|n| *n /= b);
        }
        Ok(report)
    }
}
