//! The command line: one file per subcommand, the shared flags and output handling here.

mod audit;
mod bench;
mod check;
mod export_trace;
mod mutants;
mod reference;

use clap::{Parser, Subcommand, ValueEnum};
use ghost_oracle::options::{EpsilonBudget, Field, OptionError};
use ghost_oracle::report::{
    audit_html, audit_json, audit_junit, audit_tables, Explanation, Reader,
};
use ghost_oracle::{Accounting, AccountingRequest, ClipNorm, ClipperAudit, NoiseMultiplier};
use ghost_oracle::{Error, Precision, Verdict};
use ghost_oracle_reference::{Reduction, TiedParameter};
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

/// A floating-point format: what clippers compute in, or what a trace's tolerance assumes.
#[derive(Clone, Copy, ValueEnum)]
pub enum PrecisionArg {
    F64,
    F32,
    F16,
    Bf16,
}

impl From<PrecisionArg> for Precision {
    fn from(p: PrecisionArg) -> Self {
        match p {
            PrecisionArg::F64 => Precision::F64,
            PrecisionArg::F32 => Precision::F32,
            PrecisionArg::F16 => Precision::F16,
            PrecisionArg::Bf16 => Precision::BF16,
        }
    }
}

/// The version whose release drops the deprecated spellings of renamed flags.
pub const DEPRECATED_UNTIL: &str = "0.2";

/// `--dtype`, the name `audit` and `mutants` gave `--precision` until one flag came to mean one
/// thing across check, audit and mutants: hidden, still taken until [`DEPRECATED_UNTIL`] with a
/// note on stderr; given together with `--precision` it is a usage error (exit 2).
#[derive(clap::Args)]
pub struct DeprecatedDtype {
    #[arg(long, value_enum, hide = true, conflicts_with = "precision")]
    dtype: Option<PrecisionArg>,
}

impl DeprecatedDtype {
    /// The precision asked for: `--dtype`'s where it was given (with the note), else `precision`.
    pub fn or(self, precision: PrecisionArg) -> PrecisionArg {
        match self.dtype {
            Some(p) => {
                eprintln!(
                    "ghost-oracle: --dtype is deprecated and goes in {DEPRECATED_UNTIL}: use --precision"
                );
                p
            }
            None => precision,
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
    /// Also write a self-contained HTML report with plots to this file.
    #[arg(long)]
    html: Option<PathBuf>,
    /// Exit 1 unless every audited clipper passes.
    #[arg(long)]
    gate: bool,
    /// Exit 1 when any audited clipper's actual ε exceeds this: a CI gate stated in ε.
    #[arg(long, allow_negative_numbers = true)]
    max_epsilon: Option<f64>,
    /// Poisson sampling rate q of the DP-SGD run (default with no accounting flag: 0.01).
    #[arg(long, allow_negative_numbers = true)]
    sampling_rate: Option<f64>,
    /// Number of DP-SGD steps (default with no accounting flag: 1000).
    #[arg(long, conflicts_with = "epochs", allow_negative_numbers = true)]
    steps: Option<i64>,
    /// Number of epochs instead of --steps: steps = epochs × ⌈N / round(q·N)⌉ (needs --dataset-size).
    #[arg(long, requires = "dataset_size", allow_negative_numbers = true)]
    epochs: Option<f64>,
    /// Training set size N, for --epochs.
    #[arg(long, requires = "epochs", allow_negative_numbers = true)]
    dataset_size: Option<i64>,
    /// δ of the (ε, δ) guarantee (default with no accounting flag: 1e-5).
    #[arg(long, allow_negative_numbers = true)]
    delta: Option<f64>,
}

/// The flag a library option comes from, for its error messages.
pub fn flag(field: Field) -> &'static str {
    match field {
        Field::MaxGradNorm => "--max-grad-norm",
        Field::NoiseMultiplier => "--noise-multiplier",
        Field::SamplingRate => "--sampling-rate",
        Field::Steps => "--steps",
        Field::Epochs => "--epochs",
        Field::DatasetSize => "--dataset-size",
        Field::Delta => "--delta",
        Field::MaxEpsilon => "--max-epsilon",
    }
}

/// An option error as the CLI words it, naming the flag.
pub fn flag_error(e: OptionError) -> Error {
    Error::input(e.message(flag(e.field)))
}

/// `--max-grad-norm`, checked.
pub fn clip_norm(c: Option<f64>) -> Result<Option<ClipNorm>, Error> {
    c.map(ClipNorm::new).transpose().map_err(flag_error)
}

/// `--noise-multiplier`, checked. σ = 0 is allowed, with a warning.
pub fn noise_multiplier(sigma: f64) -> Result<NoiseMultiplier, Error> {
    let s = NoiseMultiplier::new(sigma).map_err(flag_error)?;
    if s.get() == 0.0 {
        eprintln!("warning: --noise-multiplier 0: without noise DP-SGD gives no privacy (ε = ∞)");
    }
    Ok(s)
}

impl ReportArgs {
    /// The run the ε speaks of, checked before any work is done: the flags given, the typical
    /// fine-tuning run where none is.
    pub fn accounting(&self) -> Result<Accounting, Error> {
        self.max_epsilon
            .map(EpsilonBudget::new)
            .transpose()
            .map_err(flag_error)?;
        AccountingRequest {
            sampling_rate: self.sampling_rate,
            steps: self.steps,
            epochs: self.epochs,
            dataset_size: self.dataset_size,
            delta: self.delta,
        }
        .resolve()
        .map_err(flag_error)
    }

    /// Prints the tables (and, when a clipper fails, the deciding case in words), writes the
    /// files, and gives the exit status. `tied`: a trace file's shared parameters.
    pub fn emit(
        &self,
        audits: &[ClipperAudit],
        dtype: &str,
        device: &str,
        tied: Option<&[TiedParameter]>,
    ) -> Result<ExitCode, Error> {
        if let Some(path) = &self.json {
            let doc = audit_json(audits, dtype, device);
            write_file(path, &to_json(&doc), "--json")?;
        }
        if let Some(path) = &self.junit {
            write_file(path, &audit_junit(audits), "--junit")?;
        }
        if let Some(path) = &self.html {
            write_file(path, &audit_html(audits, dtype, device)?, "--html")?;
        }
        out(&audit_tables(audits, dtype, device))?;
        let all_pass = audits.iter().all(|a| a.verdict == Verdict::Pass);
        if !all_pass {
            let explanation = Explanation {
                audits,
                precision: dtype,
                tied,
                reader: Reader::Cli,
            };
            out(&format!("\n{}\n", explanation.text()))?;
        }
        let over_budget: Vec<&str> = match self.max_epsilon {
            Some(max) => audits
                .iter()
                .filter(|a| a.privacy.actual() > max)
                .map(|a| a.name.as_str())
                .collect(),
            None => Vec::new(),
        };
        if let Some(max) = self.max_epsilon {
            out(&if over_budget.is_empty() {
                format!("every audited clipper's actual ε is within --max-epsilon {max}\n")
            } else {
                format!(
                    "actual ε above --max-epsilon {max}: {}\n",
                    over_budget.join(", ")
                )
            })?;
        }
        Ok(if (self.gate && !all_pass) || !over_budget.is_empty() {
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

/// Progress of a long run on stderr: an indicatif bar on a terminal; elsewhere (CI logs, pipes)
/// a plain line at most every few seconds, and nothing for a run that ends within two seconds.
pub struct Progress {
    bar: Option<indicatif::ProgressBar>,
    start: Instant,
    last_line: std::cell::Cell<f64>,
}

impl Progress {
    pub fn new() -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::new(0);
            if let Ok(style) = indicatif::ProgressStyle::with_template(
                "[{bar:30}] {pos}/{len} {elapsed_precise} (ETA {eta}) {msg}",
            ) {
                bar.set_style(style.progress_chars("#>-"));
            }
            bar
        });
        Progress {
            bar,
            start: Instant::now(),
            last_line: std::cell::Cell::new(0.0),
        }
    }

    pub fn update(&self, done: usize, total: usize, label: &str) {
        if total == 0 {
            return;
        }
        if let Some(bar) = &self.bar {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            bar.set_message(label.to_string());
            if done == total {
                bar.finish_and_clear();
            }
            return;
        }
        let secs = self.start.elapsed().as_secs_f64();
        if secs >= 2.0 && (secs - self.last_line.get() >= 5.0 || done == total) {
            self.last_line.set(secs);
            // Steps are alike (an example, a clipper on a case): the mean so far predicts the rest.
            let eta = if done > 0 && done < total {
                format!(
                    ", about {:.0} s left",
                    secs / done as f64 * (total - done) as f64
                )
            } else {
                String::new()
            };
            eprintln!("progress: {done}/{total} ({label}) after {secs:.0} s{eta}");
        }
    }
}

/// Writes a report whole or not at all: an error (or an interrupted run) leaves no partial
/// file at `path`.
pub fn write_file(path: &Path, content: &str, flag: &str) -> Result<(), Error> {
    ghost_oracle::atomic::write_file_atomically(path, flag, content.as_bytes())
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
        // Bad input: exit 2, the message names what to fix.
        Err(e @ Error::Input(_)) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
        // Not the input's fault: a distinct status, so that a CI gate never reads it as a
        // verdict or a bad flag.
        Err(e @ Error::Internal(_)) => {
            eprintln!(
                "internal error: {e} (a bug in ghost-oracle: please report it with the input)"
            );
            ExitCode::from(3)
        }
    }
}
