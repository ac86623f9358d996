//! `check`: the norms a clipper outside Rust claimed in a trace file.

use super::{check_flags, ReportArgs};
use clap::ValueEnum;
use ghost_oracle::{account, check_trace, Error, Precision};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Clone, Copy, ValueEnum)]
enum PrecisionArg {
    F16,
    Bf16,
    F32,
    F64,
}

#[derive(clap::Args)]
pub struct Args {
    /// Trace file (safetensors, format ghost-oracle-trace/1; docs/trace-format.md).
    trace: PathBuf,
    /// Precision the tolerance assumes. Default: the coarser of the stored factors' dtype and
    /// the trace's `compute_dtype`.
    #[arg(long, value_enum)]
    precision: Option<PrecisionArg>,
    /// Noise multiplier σ. Default: the trace's, else 1.
    #[arg(long, allow_negative_numbers = true)]
    noise_multiplier: Option<f64>,
    #[command(flatten)]
    report: ReportArgs,
}

pub fn run(a: Args) -> Result<ExitCode, Error> {
    check_flags(None, a.noise_multiplier)?;
    let accounting = a.report.accounting()?;
    let precision = a.precision.map(|p| match p {
        PrecisionArg::F16 => Precision::F16,
        PrecisionArg::Bf16 => Precision::BF16,
        PrecisionArg::F32 => Precision::F32,
        PrecisionArg::F64 => Precision::F64,
    });
    let (audit, precision) = check_trace(&a.trace, precision, a.noise_multiplier)?;
    let sigma = audit.cases.first().map_or(1.0, |c| c.noise_multiplier);
    let mut audits = [audit];
    account(&mut audits, &accounting, sigma)?;
    a.report.emit(&audits, precision.name(), "trace file")
}
