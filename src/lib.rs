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
//! # The modules, in the order data flows through them
//!
//! ```text
//! options     C, σ and the DP-SGD run, each validated once in its type
//! trace       the per-site factors of a batch, on a candle device
//!  ├─ model       candle models that produce a trace (GPT-2; Llama, Qwen2, Qwen3, Gemma 1-3,
//!  │              VaultGemma: the reference's families)
//!  ├─ clippers    the Clipper trait and the built-in clippers (materialize, ghost, ghost-tied)
//!  ├─ mutants     clippers with one seeded bug of a real DP library each
//!  └─ registry    every clipper by name
//! judge       truth, tolerance, metrics and verdict, from the reference side only
//! accountant  ε of the Poisson-subsampled Gaussian mechanism
//! audit       cases → reference → clippers → judge; trace files; the kill matrix
//! report      tables, JSON, JUnit and HTML
//! bench       timing of the clippers; synthetic: random traces for tests and fuzzing
//! ```
//!
//! # Three ways in
//!
//! The built-in suite (seeded models, no files), a checkpoint and batch, or a trace file that
//! a clipper outside Rust wrote with its claimed norms:
//!
//! ```
//! use ghost_oracle::{audit, AuditOptions, Case, CheckOptions, Verdict};
//! use std::path::Path;
//!
//! // The median true norm as C (and 0.5× / 2× that), σ = 1, f32 on the CPU.
//! let opts = AuditOptions::default();
//! let clippers = ghost_oracle::registry::clippers(&["ghost-tied".into(), "ghost".into()]).unwrap();
//!
//! // 1. The built-in suite: a tied GPT-2, T = 16, repeated tokens.
//! let audits = audit::run(&audit::builtin_suite()[1..2], &clippers, &opts, &mut |_, _, _| {}).unwrap();
//! assert_eq!(audits[0].verdict, Verdict::Pass); // exact tied ghost clipping
//! assert_eq!(audits[1].verdict, Verdict::PrivacyViolation); // the cross term dropped
//! assert!(audits[1].privacy.actual() > audits[1].privacy.stated_epsilon);
//!
//! // 2. A checkpoint directory (config.json + model.safetensors) and a batch.
//! let dir = Path::new("oracles/golden/cases/tied_l1_h2_t2");
//! let case = Case::load(dir, &dir.join("batch.safetensors")).unwrap();
//! let audits = audit::run([case], &clippers[..1], &opts, &mut |_, _, _| {}).unwrap();
//! assert_eq!(audits[0].verdict, Verdict::Pass);
//!
//! // 3. A trace file with the norms Opacus's per-sample clipper claimed.
//! let trace = Path::new("oracles/golden/traces/opacus_per_sample.safetensors");
//! let checked = audit::check_trace(trace, &CheckOptions::default()).unwrap();
//! assert_eq!(checked.audit.verdict, Verdict::Pass);
//! ```
//!
//! # Writing a clipper
//!
//! A backend implements [`Clipper::norms`]; coefficients and the clipped sum have defaults.
//! The Gram identity every built-in clipper uses is in [`clippers::gram`]:
//!
//! ```
//! use ghost_oracle::clippers::gram;
//! use ghost_oracle::{Clipper, NormReport, Result, Trace};
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

pub mod accountant;
pub mod atomic;
pub mod audit;
pub mod bench;
pub mod clippers;
mod error;
pub mod judge;
pub mod model;
pub mod mutants;
pub mod options;
pub mod registry;
pub mod report;
pub mod synthetic;
pub mod trace;

pub use audit::{AuditOptions, Case, CheckOptions, ClipperAudit};
pub use clippers::{Clipper, GhostClipper, MaterializeClipper, NormReport, TiedGhostClipper};
pub use error::{Error, Result};
pub use judge::{Judge, Verdict};
pub use options::{Accounting, AccountingRequest, ClipNorm, NoiseMultiplier};
pub use trace::{Precision, Trace};
