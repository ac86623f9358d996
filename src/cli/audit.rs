//! `audit`: every chosen clipper on the built-in suite or on a checkpoint and batch.

use super::ReportArgs;
use super::{
    clip_norm, noise_multiplier, DeprecatedDtype, DeviceArg, PrecisionArg, Progress, ReductionArg,
};
use ghost_oracle::{audit, registry, AuditOptions, Error, Precision};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory (config.json + model.safetensors) to audit on instead of the
    /// built-in suite, e.g. oracles/golden/cases/tied_l2_h4_t33. Needs --batch.
    #[arg(long, requires = "batch")]
    model: Option<PathBuf>,
    /// Batch file for --model: safetensors with `input_ids` (i64, B×T) and optional `labels`.
    #[arg(long, requires = "model")]
    batch: Option<PathBuf>,
    /// Clipper to audit (repeatable): materialize, ghost, ghost-tied, or mutant:NAME for a
    /// seeded bug (`ghost-oracle mutants --list`). Default: the three built-in clippers.
    #[arg(long = "clipper")]
    clippers: Vec<String>,
    /// Clipping norm C. Default: the median true norm of each case (the built-in suite also
    /// tries 0.5× and 2× that).
    #[arg(long, allow_negative_numbers = true)]
    max_grad_norm: Option<f64>,
    /// Noise multiplier σ of the DP-SGD run being audited.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    noise_multiplier: f64,
    /// Precision the clippers compute in (the reference is always f64).
    #[arg(long, value_enum, default_value = "f32")]
    precision: PrecisionArg,
    #[command(flatten)]
    dtype: DeprecatedDtype,
    /// Device the clippers run on (cuda needs a build with `--features cuda`).
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceArg,
    /// How each example's loss is reduced over its tokens: mean (HF's loss) or sum.
    #[arg(long, value_enum, default_value = "mean")]
    reduction: ReductionArg,
    /// Skip each clipper's DP-SGD step (its clipped sum, seeded noise and the division by the
    /// batch size): judge the norms only, and hold no update beside the clipped sum.
    #[arg(long)]
    no_step: bool,
    #[command(flatten)]
    report: ReportArgs,
}

pub fn run(a: Args) -> Result<ExitCode, Error> {
    let max_grad_norm = clip_norm(a.max_grad_norm)?;
    let noise_multiplier = noise_multiplier(a.noise_multiplier)?;
    let accounting = a.report.accounting()?;
    let clippers = registry::clippers(&a.clippers).map_err(|e| e.context("--clipper"))?;
    // clap already requires each of --model and --batch with the other.
    let cases = audit::cases_to_audit(a.model.as_deref(), a.batch.as_deref())?;
    let precision = Precision::from(a.dtype.or(a.precision));
    let opts = AuditOptions {
        max_grad_norm,
        noise_multiplier,
        precision,
        device: a.device.device()?,
        reduction: a.reduction.into(),
        accounting,
        judge_step: !a.no_step,
        ..AuditOptions::default()
    };
    let progress = Progress::new();
    let audits = audit::run(cases, &clippers, &opts, &mut |d, t, l| {
        progress.update(d, t, l)
    })?;
    a.report
        .emit(&audits, precision.name(), a.device.name(), None)
}
