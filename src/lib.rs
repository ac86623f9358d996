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
    builtin_suite, prepare, run as run_audit, worst_case, AuditOptions, Case, ClipperAudit,
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
