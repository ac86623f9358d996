//! The command line: one file per subcommand, the shared flags and output handling here.

mod audit;
mod bench;
mod check;
mod export_trace;
mod mutants;
mod reference;

use clap::{Parser, Subcommand, ValueEnum};
use ghost_oracle::{audit_json, audit_junit, audit_tables, clipper_by_name, ClipperAudit};
use ghost_oracle::{Clipper, Error, Verdict};
use ghost_oracle_reference::Reduction;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

#[derive(Parser)]
#[command(
    name = "ghost-oracle",
    version,
    about = "Test oracle for DP-SGD per-example gradient clipping (exact norms for tied parameters)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Per-example gradient norms of a checkpoint on a batch, from the f64 reference.
    Reference(reference::Args),
    /// Audit clippers against the reference: the built-in suite, or a checkpoint and batch.
    Audit(audit::Args),
    /// Audit the norms a clipper claimed in a trace file (see docs/trace-format.md).
    Check(check::Args),
    /// Write a trace of the built-in candle model, with a clipper's norms as the claim.
    ExportTrace(export_trace::Args),
    /// Time per-example norm computation (a random tied LM head by default, or a trace file) and
    /// measure peak memory with a counting allocator.
    Bench(bench::Args),
    /// Run every seeded-bug clipper (and the correct ones) on the built-in suite: the kill matrix.
    Mutants(mutants::Args),
}

/// How each example's loss is reduced over its tokens.
#[derive(Clone, Copy, ValueEnum)]
pub enum ReductionArg {
    /// Mean over the example's kept targets (HF's causal-LM loss, per example).
    Mean,
    /// Sum over the example's kept targets.
    Sum,
}

impl From<ReductionArg> for Reduction {
    fn from(r: ReductionArg) -> Self {
        match r {
            ReductionArg::Mean => Reduction::Mean,
            ReductionArg::Sum => Reduction::Sum,
        }
    }
}

/// The precision a clipper computes in.
#[derive(Clone, Copy, ValueEnum)]
pub enum DtypeArg {
    F32,
    F64,
}

impl DtypeArg {
    pub fn dtype(self) -> candle_core::DType {
        match self {
            DtypeArg::F32 => candle_core::DType::F32,
            DtypeArg::F64 => candle_core::DType::F64,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DtypeArg::F32 => "f32",
            DtypeArg::F64 => "f64",
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
pub enum DeviceArg {
    Cpu,
    Cuda,
}

impl DeviceArg {
    pub fn name(self) -> &'static str {
        match self {
            DeviceArg::Cpu => "cpu",
            DeviceArg::Cuda => "cuda",
        }
    }

    pub fn device(self) -> Result<candle_core::Device, Error> {
        match self {
            DeviceArg::Cpu => Ok(candle_core::Device::Cpu),
            #[cfg(feature = "cuda")]
            DeviceArg::Cuda => candle_core::Device::new_cuda(0)
                .map_err(|e| Error::input(format!("--device cuda: no usable GPU: {e}"))),
            #[cfg(not(feature = "cuda"))]
            DeviceArg::Cuda => Err(Error::input(
                "--device cuda: this binary was built without CUDA; rebuild with `--features cuda`",
            )),
        }
    }
}

/// Where an audit's results go, and whether they decide the exit status.
#[derive(clap::Args)]
pub struct ReportArgs {
    /// Also write the full metrics as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also write JUnit XML to this file: one testcase per clipper × case.
    #[arg(long)]
    junit: Option<PathBuf>,
    /// Exit 1 unless every audited clipper passes.
    #[arg(long)]
    gate: bool,
}

impl ReportArgs {
    /// Prints the tables, writes the files, and gives the exit status.
    pub fn emit(
        &self,
        audits: &[ClipperAudit],
        dtype: &str,
        device: &str,
    ) -> Result<ExitCode, Error> {
        if let Some(path) = &self.json {
            let doc = audit_json(audits, dtype, device);
            write_file(path, &to_json(&doc), "--json")?;
        }
        if let Some(path) = &self.junit {
            write_file(path, &audit_junit(audits), "--junit")?;
        }
        out(&audit_tables(audits, dtype, device))?;
        let all_pass = audits.iter().all(|a| a.verdict == Verdict::Pass);
        Ok(if self.gate && !all_pass {
            ExitCode::from(1)
        } else {
            ExitCode::SUCCESS
        })
    }
}

/// Writes to stdout. A reader that went away is not an error of ours: the run ends quietly.
pub fn out(text: &str) -> Result<(), Error> {
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|_| stdout.flush())
    {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(Error::OutputClosed),
        Err(e) => Err(Error::input(format!("cannot write to stdout: {e}"))),
    }
}

pub fn to_json(v: &impl serde::Serialize) -> String {
    // Serializing our own documents cannot fail: every map key is a string.
    serde_json::to_string_pretty(v).unwrap_or_default()
}

/// A progress bar on stderr, drawn only on a terminal.
pub struct Progress {
    enabled: bool,
    start: Instant,
}

impl Progress {
    pub fn new() -> Self {
        Progress {
            enabled: std::io::stderr().is_terminal(),
            start: Instant::now(),
        }
    }

    pub fn update(&self, done: usize, total: usize, label: &str) {
        if !self.enabled || total == 0 {
            return;
        }
        let width = 30;
        let filled = width * done / total;
        let secs = self.start.elapsed().as_secs_f64();
        eprint!(
            "\r[{}{}] {done}/{total} {secs:.1}s {label:<30}",
            "#".repeat(filled),
            " ".repeat(width - filled)
        );
        if done == total {
            eprintln!();
        }
        let _ = std::io::stderr().flush();
    }
}

pub fn write_file(path: &Path, content: &str, flag: &str) -> Result<(), Error> {
    std::fs::write(path, content)
        .map_err(|e| Error::input(format!("{flag} {}: cannot write: {e}", path.display())))
}

/// C must be positive and σ non-negative, checked before any work is done. σ = 0 is allowed
/// (a run without noise can still be audited for its norms) but it buys no privacy.
pub fn check_flags(max_grad_norm: Option<f64>, noise_multiplier: Option<f64>) -> Result<(), Error> {
    if let Some(c) = max_grad_norm.filter(|c| !(c.is_finite() && *c > 0.0)) {
        return Err(Error::input(format!(
            "--max-grad-norm must be a positive number, got {c}"
        )));
    }
    if let Some(s) = noise_multiplier.filter(|s| !(s.is_finite() && *s >= 0.0)) {
        return Err(Error::input(format!(
            "--noise-multiplier must be a non-negative number, got {s}"
        )));
    }
    if noise_multiplier == Some(0.0) {
        eprintln!("warning: --noise-multiplier 0: without noise DP-SGD gives no privacy (ε = ∞)");
    }
    Ok(())
}

/// The clippers named by `--clipper`, or `default` when none is.
pub fn clippers_or(names: &[String], default: &[&str]) -> Result<Vec<Box<dyn Clipper>>, Error> {
    if names.is_empty() {
        default.iter().map(|n| clipper_by_name(n)).collect()
    } else {
        names.iter().map(|n| clipper_by_name(n)).collect()
    }
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Reference(a) => reference::run(a),
        Command::Audit(a) => audit::run(a),
        Command::Check(a) => check::run(a),
        Command::ExportTrace(a) => export_trace::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Mutants(a) => mutants::run(a),
    };
    match result {
        Ok(code) => code,
        Err(Error::OutputClosed) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
