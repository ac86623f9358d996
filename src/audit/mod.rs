//! The audit harness: cases (built-in or a checkpoint), the reference's truth for each, every
//! clipper run on the same trace, and the judge's verdict on each.
//!
//! `suite` holds the built-in cases, `prepare` turns a case into a judge and the clippers'
//! trace, `claim` turns a clipper's output into what the judge reads, `run` runs every clipper
//! on every case; `check` judges a trace file and `kill_matrix` the seeded bugs.

mod check;
mod claim;
mod kill_matrix;
mod prepare;
mod run;
mod suite;

pub use check::{check_trace, check_trace_with_progress, CheckOptions, CheckedTrace};
pub use claim::{claim_of, expected_batch_size, values_of};
pub use kill_matrix::{kill_matrix, KillMatrix, Row};
pub use prepare::{median, prepare, PreparedCase};
pub use run::{run, worst_case, ClipperAudit};
pub use suite::{builtin_suite, SUITE_C_MULTIPLIERS};

use crate::error::Result;
use crate::options::{Accounting, ClipNorm, NoiseMultiplier};
use crate::trace::Precision;
use candle_core::Device;
use ghost_oracle_reference::{self as reference, Batch, Model, Reduction};

/// A model and a batch to audit on, with the clipping norms to try (as multiples of the median
/// true norm, unless the user fixes C).
#[derive(Clone, Debug)]
pub struct Case {
    /// The case's name in reports.
    pub name: String,
    /// The model whose gradients are clipped.
    pub model: Model,
    /// The batch, B×T.
    pub batch: Batch,
    /// The clipping norms to try, as multiples of the case's median true norm.
    pub c_multipliers: Vec<f64>,
}

impl Case {
    /// A checkpoint directory (config.json + model.safetensors, any family the reference
    /// reads) and a batch file, checked against each other, audited at one clipping norm.
    pub fn load(model: &std::path::Path, batch: &std::path::Path) -> Result<Self> {
        let m: Model = reference::load(model)?;
        let b = Batch::load(batch)?;
        b.validate(&m, &batch.display().to_string())?;
        Ok(Case {
            name: model
                .file_name()
                .map_or("checkpoint".into(), |n| n.to_string_lossy().into_owned()),
            model: m,
            batch: b,
            c_multipliers: vec![1.0],
        })
    }
}

/// What an audit runs on: a checkpoint directory with its batch file, or neither (the built-in
/// suite). One without the other is refused, naming what is missing: the CLI's flags and the
/// Python arguments share these names (`--model`/`model`, `--batch`/`batch`).
pub fn cases_to_audit(
    model: Option<&std::path::Path>,
    batch: Option<&std::path::Path>,
) -> Result<Vec<Case>> {
    match (model, batch) {
        (Some(m), Some(b)) => Ok(vec![Case::load(m, b)?]),
        (None, None) => Ok(builtin_suite()),
        (Some(_), None) => Err(crate::error::Error::input(
            "model needs batch: a batch file (safetensors with `input_ids`) to audit the checkpoint on",
        )),
        (None, Some(_)) => Err(crate::error::Error::input(
            "batch needs model: a checkpoint directory (config.json + model.safetensors)",
        )),
    }
}

/// How an audit runs: the DP-SGD settings it judges at, and where the clippers compute.
#[derive(Clone, Debug)]
pub struct AuditOptions {
    /// C; `None`: the median true norm of each case, times each of its `c_multipliers`.
    pub max_grad_norm: Option<ClipNorm>,
    /// σ, the noise multiplier.
    pub noise_multiplier: NoiseMultiplier,
    /// The precision the clippers compute in (the reference is always f64).
    pub precision: Precision,
    /// Where the clippers compute.
    pub device: Device,
    /// How each example's loss is reduced over its targets.
    pub reduction: Reduction,
    /// The run each clipper's ε is stated for.
    pub accounting: Accounting,
    /// Also take and judge each clipper's DP-SGD step (its clipped sum, seeded noise and the
    /// division by the batch size). It holds the update beside the clipped sum.
    pub judge_step: bool,
    /// The seed of the step's noise.
    pub noise_seed: u64,
}

impl Default for AuditOptions {
    /// The built-in audit's: C from the median, σ = 1, f32 on the CPU, HF's mean loss, the
    /// typical fine-tuning run.
    fn default() -> Self {
        AuditOptions {
            max_grad_norm: None,
            noise_multiplier: NoiseMultiplier::ONE,
            precision: Precision::F32,
            device: Device::Cpu,
            reduction: Reduction::Mean,
            accounting: Accounting::typical(),
            judge_step: true,
            noise_seed: 0x5EED,
        }
    }
}
