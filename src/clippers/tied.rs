//! Exact ghost clipping for parameters used more than once.

use super::gram;
use super::{factor_all, finish, own_norms, Clipper, CrossTerm, NormReport};
use crate::error::Result;
use crate::trace::Trace;

/// Exact ghost clipping for shared parameters: standard ghost plus 2⟨G_j, G_k⟩ for every pair of
/// sites of one parameter, by the same Gram identity. For a tied embedding / LM head the cross
/// term costs O(T²d) against the head's own O(T²V).
#[derive(Clone, Copy, Debug, Default)]
pub struct TiedGhostClipper;

impl TiedGhostClipper {
    /// The name the registry and reports know it by.
    pub const NAME: &'static str = "ghost-tied";
}

impl Clipper for TiedGhostClipper {
    fn name(&self) -> String {
        Self::NAME.into()
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
                let values = gram::inner(&factored[j], &factored[k], dtype)
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
