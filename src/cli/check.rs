//! `check`: the norms a clipper outside Rust claimed in a trace file.

use super::{noise_multiplier, PrecisionArg, Progress, ReportArgs};
use ghost_oracle::{audit, CheckOptions, Error};
use ghost_oracle_reference::MemoryBudget;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Trace file (safetensors, format ghost-oracle-trace/1 or /2; docs/trace-format.md).
    trace: PathBuf,
    /// Precision the tolerance assumes. Default: the coarser of the stored factors' dtype and
    /// the trace's `compute_dtype`.
    #[arg(long, value_enum)]
    precision: Option<PrecisionArg>,
    /// Noise multiplier σ. Default: the trace's, else 1.
    #[arg(long, allow_negative_numbers = true)]
    noise_multiplier: Option<f64>,
    /// Most memory reading and judging the trace may take, e.g. 8G or 512M (binary units;
    /// bytes without one). A trace that would need more is refused before it is read. Default:
    /// the machine's available memory.
    #[arg(long, value_name = "SIZE")]
    max_memory: Option<String>,
    #[command(flatten)]
    report: ReportArgs,
}

pub fn run(a: Args) -> Result<ExitCode, Error> {
    let opts = CheckOptions {
        precision: a.precision.map(Into::into),
        noise_multiplier: a.noise_multiplier.map(noise_multiplier).transpose()?,
        accounting: a.report.accounting()?,
        max_memory: a
            .max_memory
            .as_deref()
            .map(|m| MemoryBudget::parse(m, "--max-memory"))
            .transpose()?,
    };
    let progress = Progress::new();
    let checked =
        audit::check_trace_with_progress(&a.trace, &opts, &|d, t, l| progress.update(d, t, l))?;
    let precision = checked.audit.precision;
    a.report.emit(
        &[checked.audit],
        precision.name(),
        "trace file",
        Some(&checked.tied),
    )
}
