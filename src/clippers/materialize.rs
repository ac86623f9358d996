//! Per-example materialization: the exact, memory-hungry baseline.

use super::gram;
use super::{factor_all, Clipper, CrossTerm, NormReport};
use crate::error::Result;
use crate::trace::Trace;
use candle_core::Tensor;

/// Per-example materialization: every parameter's gradient built example by example (sites of a
/// shared parameter summed), then its norm. Exact, and memory-hungry on large vocabularies.
#[derive(Clone, Copy, Debug, Default)]
pub struct MaterializeClipper;

impl MaterializeClipper {
    /// The name the registry and reports know it by.
    pub const NAME: &'static str = "materialize";
}

impl Clipper for MaterializeClipper {
    fn name(&self) -> String {
        Self::NAME.into()
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
                    .map(|&j| gram::materialize(&factored[j], i, dtype))
                    .collect::<Result<_>>()?;
                let sum = mats
                    .iter()
                    .skip(1)
                    .try_fold(mats[0].clone(), |acc, m| acc + m)?;
                total += gram::sum_sq(&sum)?;
                for (m, &j) in mats.iter().zip(&p.sites) {
                    site_sq[j][i] = gram::sum_sq(m)?;
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
                    c.values[i] = gram::dot_all(&mats[a], &mats[bb])?;
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
