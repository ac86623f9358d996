//! Standard ghost clipping: every site's own norm, cross terms dropped.

use super::{factor_all, finish, own_norms, Clipper, NormReport};
use crate::error::Result;
use crate::trace::Trace;

/// Standard ghost clipping as DP libraries ship it: every site's own norm, by the Gram identity
/// or by materialization, whichever is cheaper (mixed ghost); cross terms between two uses of one
/// parameter are dropped.
#[derive(Clone, Copy, Debug, Default)]
pub struct GhostClipper;

impl GhostClipper {
    /// The name the registry and reports know it by.
    pub const NAME: &'static str = "ghost";
}

impl Clipper for GhostClipper {
    fn name(&self) -> String {
        Self::NAME.into()
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
