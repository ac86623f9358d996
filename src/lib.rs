//! ghost-oracle: ground truth for DP-SGD per-example gradient clipping.
//!
//! # Sites and traces
//!
//! Every use of a parameter in a model is a **site**; its per-example gradient is a sum over
//! positions of outer products G = Σ_t l_t r_tᵀ (a linear layer: backprop ⊗ input; an embedding:
//! one-hot id ⊗ backprop; a bias or a norm weight: one column). A **trace** holds, for a batch,
//! the factors of every site. Two sites with the same `param` are tied (GPT-2's `wte`, Llama's
//! `embed_tokens` shared with the LM head), and the norm of their parameter has a cross term.
//!
//! A clipper turns a trace into per-example norms. The **judge** compares them with the truth
//! from the independent f64 reference (`ghost_oracle_reference`), and says what a wrong norm
//! does to privacy. The judge computes everything from the reference side (truth, tolerance,
//! true coefficients): it shares no code with the clippers it judges.
//!
//! # Three ways in
//!
//! The built-in suite (seeded models, no files), a checkpoint and batch, or a trace file that
//! a clipper outside Rust wrote with its claimed norms:
//!
//! ```
//! use candle_core::{DType, Device};
//! use ghost_oracle::*;
//! use ghost_oracle_reference::{Batch, Model, Reduction};
//! use std::path::Path;
//!
//! let opts = AuditOptions {
//!     max_grad_norm: None, // the median true norm, and 0.5× / 2× that
//!     noise_multiplier: 1.0,
//!     dtype: DType::F32,
//!     device: Device::Cpu,
//!     reduction: Reduction::Mean,
//! };
//! let clippers: Vec<Box<dyn Clipper>> = vec![Box::new(TiedGhostClipper), Box::new(GhostClipper)];
//!
//! // 1. The built-in suite: a tied GPT-2, T = 64, repeated tokens.
//! let audits = run_audit(&builtin_suite()[1..2], &clippers, &opts, &mut |_, _, _| {}).unwrap();
//! assert_eq!(audits[0].verdict, Verdict::Pass); // exact tied ghost clipping
//! assert_eq!(audits[1].verdict, Verdict::PrivacyViolation); // the cross term dropped
//!
//! // 2. A checkpoint directory (config.json + model.safetensors) and a batch.
//! let dir = Path::new("oracles/golden/cases/tied_l1_h2_t2");
//! let case = Case {
//!     name: "tied_l1_h2_t2".into(),
//!     model: Model::load(dir).unwrap(),
//!     batch: Batch::load(&dir.join("batch.safetensors")).unwrap(),
//!     c_multipliers: vec![1.0],
//! };
//! let audits = run_audit(&[case], &clippers[..1], &opts, &mut |_, _, _| {}).unwrap();
//! assert_eq!(audits[0].verdict, Verdict::Pass);
//!
//! // 3. A trace file with the norms Opacus's per-sample clipper claimed.
//! let trace = Path::new("oracles/golden/traces/opacus_per_sample.safetensors");
//! let (audit, precision) = check_trace(trace, None, None).unwrap();
//! assert_eq!(audit.verdict, Verdict::Pass);
//! ```
//!
//! # Writing a clipper
//!
//! A backend implements [`Clipper::norms`]; coefficients and the clipped sum have defaults.
//! The Gram identity every built-in clipper uses is in [`gram`]:
//!
//! ```
//! use ghost_oracle::{gram, Clipper, NormReport, Result, Trace};
//!
//! /// Standard ghost clipping written by hand: every site's own norm, no cross terms.
//! struct OwnNormsOnly;
//!
//! impl Clipper for OwnNormsOnly {
//!     fn name(&self) -> String {
//!         "own-norms-only".into()
//!     }
//!     fn norms(&self, trace: &Trace) -> Result<NormReport> {
//!         let mut sq = vec![0.0; trace.batch_size()];
//!         for site in &trace.sites {
//!             let f = gram::Factored::of(site)?;
//!             for (total, v) in sq.iter_mut().zip(gram::inner(&f, &f, trace.dtype())?) {
//!                 *total += v;
//!             }
//!         }
//!         Ok(NormReport { norms: sq.iter().map(|v| v.sqrt()).collect(), ..Default::default() })
//!     }
//! }
//! # let _ = OwnNormsOnly;
//! ```
//!
//! # Verdicts
//!
//! - [`Verdict::Pass`]: every norm within the derived rounding bound of the truth.
//! - [`Verdict::UtilityDistortion`]: norms, coefficients or the clipped sum off beyond rounding,
//!   but no example contributes more than C: the guarantee holds, signal is lost.
//! - [`Verdict::PrivacyViolation`]: some example's clipped contribution c·n*/C exceeds 1 beyond
//!   rounding: at the stated noise multiplier σ the run really has σ/that.
//! - [`Verdict::InvalidNorm`]: a NaN, infinite or far negative norm or coefficient.
//!
//! [`synthetic`] makes random traces for property tests and fuzzing.

pub mod accountant;
mod audit;
mod bench;
mod clippers;
mod error;
mod judge;
mod model;
mod mutants;
mod report;
pub mod synthetic;
mod trace;

pub use audit::{
    account, builtin_suite, check_trace, claim_of, median, precision_of, prepare, run as run_audit,
    worst_case, AuditOptions, Case, ClipperAudit, PreparedCase, SUITE_C_MULTIPLIERS,
};
pub use bench::{bench, tied_head_trace, BenchResult};
pub use clippers::{
    builtin, clip_coefficients, clipped_sum, gram, Clipped, Clipper, CrossTerm, GhostClipper,
    MaterializeClipper, NormReport, TiedGhostClipper, BUILTIN_CLIPPERS,
};
pub use error::{Error, Result};
pub use judge::{
    evaluate, Accounting, CaseMetrics, Claim, ExampleMetrics, Judge, Precision, PrivacyReport,
    Tolerance, Truth, Verdict,
};
pub use model::{CandleGpt2, CandleLlama, CandleModel, Extracted};
pub use mutants::{
    clipper_by_name, clippers_by_name, kill_matrix, kill_matrix_html, kill_matrix_json,
    kill_matrix_table, ExpectedVerdict, KillMatrix, Mutant, MutantClipper,
};
pub use report::{audit_html, audit_json, audit_junit, audit_tables, reference_table, summary};
pub use trace::{stored_dtype, write_claimed_trace, ParamSites, Site, SiteKind, SiteSpec, Trace};
