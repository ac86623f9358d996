mod clipper;
mod error;
mod model;
pub mod factor;
mod trace;

pub use clipper::{
    builtin, clip_coefficients, clipped_sum, Clipped, Clipper, CrossTerm, GhostClipper, MaterializeClipper, NormReport,
    TiedGhostClipper, BUILTIN_CLIPPERS,
};
pub use error::{Error, Result};
pub use trace::{ParamSites, Site, SiteKind, SiteSpec, Trace};
pub use model::{CandleGpt2, Extracted};
