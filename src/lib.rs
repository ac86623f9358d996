//! ghost-oracle: ground truth for DP-SGD per-example gradient clipping.
//!
//! A clipper turns a batch **trace** (per parameter use, the factors of each example's gradient)
//! into per-example norms; the audit compares them with the truth from the independent f64
//! reference (`ghost_oracle_reference`) and says what a wrong norm does to privacy.
//!
//! ```
//! use candle_core::{DType, Device};
//! use ghost_oracle::{builtin_suite, run_audit, AuditOptions, Clipper, GhostClipper, TiedGhostClipper, Verdict};
//! use ghost_oracle_reference::Reduction;
//!
//! let cases = &builtin_suite()[1..2]; // tied GPT-2, T = 16, repeated tokens
//! let clippers: Vec<Box<dyn Clipper>> = vec![Box::new(TiedGhostClipper), Box::new(GhostClipper)];
//! let opts = AuditOptions {
//!     max_grad_norm: None, // the median true norm, and 0.5× / 2× that
//!     noise_multiplier: 1.0,
//!     dtype: DType::F32,
//!     device: Device::Cpu,
//!     reduction: Reduction::Mean,
//! };
//! let audits = run_audit(cases, &clippers, &opts, &mut |_, _, _| {}).unwrap();
//! assert_eq!(audits[0].verdict, Verdict::Pass); // exact tied ghost clipping
//! assert_eq!(audits[1].verdict, Verdict::PrivacyViolation); // the cross term dropped
//! ```
//!
//! A new backend implements [`Clipper`]; the Gram identity every built-in clipper uses lives in
//! [`factor`]; [`synthetic`] makes random traces for property tests and fuzzing.

mod audit;
mod bench;
mod check;
mod clipper;
mod detection;
mod error;
pub mod factor;
mod metrics;
mod model;
mod mutants;
mod report;
pub mod synthetic;
mod trace;

pub use audit::{
    builtin_suite, median, prepare, run as run_audit, worst_case, AuditOptions, Case, ClipperAudit,
    PreparedCase, SUITE_C_MULTIPLIERS,
};
pub use bench::{bench, tied_head_trace, BenchResult};
pub use check::{check_trace, stored_dtype, write_claimed_trace};
pub use clipper::{
    builtin, clip_coefficients, clipped_sum, Clipped, Clipper, CrossTerm, GhostClipper,
    MaterializeClipper, NormReport, TiedGhostClipper, BUILTIN_CLIPPERS,
};
pub use detection::{kill_matrix, kill_matrix_json, kill_matrix_table, KillMatrix};
pub use error::{Error, Result};
pub use metrics::{evaluate, unit_roundoff, CaseMetrics, ExampleMetrics, Truth, Verdict};
pub use model::{CandleGpt2, Extracted};
pub use mutants::{ExpectedVerdict, Mutant, MutantClipper};
pub use report::{audit_json, audit_junit, audit_tables, reference_table};
pub use trace::{ParamSites, Site, SiteKind, SiteSpec, Trace};
