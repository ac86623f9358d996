use clap::{Parser, Subcommand, ValueEnum};
use ghost_oracle::{
    audit_json, audit_junit, audit_tables, builtin, builtin_suite, reference_table, run_audit,
    AuditOptions, Case, Error, Verdict,
};
use ghost_oracle::{
    bench as bench_clipper, check_trace, clip_coefficients, kill_matrix, kill_matrix_json,
    kill_matrix_table, median, tied_head_trace, write_claimed_trace, CandleGpt2, Mutant,
};
use ghost_oracle_reference::{self as reference, Batch, Gpt2, Reduction};
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

#[derive(Clone, Copy, ValueEnum)]
enum ReductionArg {
    Mean,
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

#[derive(Clone, Copy, ValueEnum)]
enum DtypeArg {
    F32,
    F64,
}

/// Where an audit's results go, and whether they decide the exit status.
#[derive(clap::Args)]
struct ReportArgs {
    /// Also write the full metrics as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// JUnit XML: one testcase per clipper × case.
    #[arg(long)]
    junit: Option<PathBuf>,
    /// Exit 1 unless every audited clipper passes.
    #[arg(long)]
    gate: bool,
}

impl ReportArgs {
    /// Prints the tables, writes the files, and gives the exit status.
    fn emit(
        &self,
        audits: &[ghost_oracle::ClipperAudit],
        dtype: &str,
        device: &str,
    ) -> Result<ExitCode, Error> {
        print!("{}", audit_tables(audits, dtype, device));
        if let Some(path) = &self.json {
            let doc = audit_json(audits, dtype, device);
            write_file(
                path,
                &serde_json::to_string_pretty(&doc).expect("json"),
                "--json",
            )?;
        }
        if let Some(path) = &self.junit {
            write_file(path, &audit_junit(audits), "--junit")?;
        }
        let all_pass = audits.iter().all(|a| a.verdict == Verdict::Pass);
        println!(
            "\n{}",
            if all_pass {
                "all audited clippers pass"
            } else {
                "some audited clippers fail"
            }
        );
        Ok(if self.gate && !all_pass {
            ExitCode::from(1)
        } else {
            ExitCode::SUCCESS
        })
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum PrecisionArg {
    F16,
    Bf16,
    F32,
    F64,
}

impl From<DtypeArg> for candle_core::DType {
    fn from(d: DtypeArg) -> Self {
        match d {
            DtypeArg::F32 => candle_core::DType::F32,
            DtypeArg::F64 => candle_core::DType::F64,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum DeviceArg {
    Cpu,
    Cuda,
}

#[derive(Subcommand)]
enum Command {
    /// Per-example gradient norms of a GPT-2 checkpoint on a batch, from the f64 reference.
    Reference {
        /// Directory with config.json and model.safetensors (as written by save_pretrained).
        #[arg(long)]
        model: PathBuf,
        /// Safetensors file with `input_ids` (i64, B×T) and optional `labels` (-100 = ignored).
        #[arg(long)]
        batch: PathBuf,
        #[arg(long, value_enum, default_value = "mean")]
        reduction: ReductionArg,
        /// Also write the results as JSON.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Audit clippers against the reference: the built-in suite, or a checkpoint and batch.
    Audit {
        #[arg(long, requires = "batch")]
        model: Option<PathBuf>,
        #[arg(long, requires = "model")]
        batch: Option<PathBuf>,
        /// Clipper to audit (repeatable): materialize, ghost, ghost-tied. Default: all.
        #[arg(long = "clipper")]
        clippers: Vec<String>,
        /// Clipping norm C. Default: the median true norm of each case (the built-in suite also
        /// tries 0.5× and 2× that).
        #[arg(long, allow_negative_numbers = true)]
        max_grad_norm: Option<f64>,
        /// Noise multiplier σ of the DP-SGD run being audited.
        #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
        noise_multiplier: f64,
        #[arg(long, value_enum, default_value = "f32")]
        dtype: DtypeArg,
        #[arg(long, value_enum, default_value = "cpu")]
        device: DeviceArg,
        #[arg(long, value_enum, default_value = "mean")]
        reduction: ReductionArg,
        #[command(flatten)]
        report: ReportArgs,
    },
    /// Audit the norms a clipper claimed in a trace file (see docs/trace-format.md).
    Check {
        /// Trace file (safetensors, format ghost-oracle-trace/1).
        trace: PathBuf,
        /// Precision the bound assumes. Default: that of the stored factors.
        #[arg(long, value_enum)]
        precision: Option<PrecisionArg>,
        /// Noise multiplier σ. Default: the trace's, else 1.
        #[arg(long, allow_negative_numbers = true)]
        noise_multiplier: Option<f64>,
        #[command(flatten)]
        report: ReportArgs,
    },
    /// Write a trace of the built-in candle model, with a clipper's norms as the claim.
    ExportTrace {
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        batch: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value = "ghost-tied")]
        clipper: String,
        /// Default: the median of the clipper's norms.
        #[arg(long, allow_negative_numbers = true)]
        max_grad_norm: Option<f64>,
        #[arg(long, value_enum, default_value = "f32")]
        dtype: DtypeArg,
        #[arg(long, value_enum, default_value = "mean")]
        reduction: ReductionArg,
    },
    /// Time per-example norm computation from a trace (median of repeated runs after a
    /// warm-up) and measure its peak memory with a counting allocator.
    Bench {
        #[arg(long, default_value_t = 50257)]
        vocab: usize,
        #[arg(long, default_value_t = 768)]
        hidden: usize,
        #[arg(long, default_value_t = 128)]
        seq: usize,
        #[arg(long, default_value_t = 1)]
        batch: usize,
        /// Clipper to time (repeatable). Default: ghost, ghost-tied, materialize.
        #[arg(long = "clipper")]
        clippers: Vec<String>,
        /// Time on this trace file instead of a random tied GPT-2 head of the given shape.
        #[arg(long)]
        trace: Option<PathBuf>,
        #[arg(long, default_value_t = 3)]
        runs: usize,
        #[arg(long, value_enum, default_value = "f32")]
        dtype: DtypeArg,
        #[arg(long, value_enum, default_value = "cpu")]
        device: DeviceArg,
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Run every seeded-bug clipper (and the correct ones) on the built-in suite: the kill matrix.
    Mutants {
        /// Only list the mutants and the library behaviour each reproduces.
        #[arg(long)]
        list: bool,
        #[arg(long, value_enum, default_value = "f32")]
        dtype: DtypeArg,
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

/// Peak-memory measurement for `bench`: every allocation of the process is counted.
mod alloc {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

    pub struct Counting;
    static CURRENT: AtomicU64 = AtomicU64::new(0);
    static PEAK: AtomicU64 = AtomicU64::new(0);
    static BASE: AtomicU64 = AtomicU64::new(0);

    fn grow(n: usize) {
        let now = CURRENT.fetch_add(n as u64, Relaxed) + n as u64;
        PEAK.fetch_max(now, Relaxed);
    }

    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, l: Layout) -> *mut u8 {
            let p = unsafe { System.alloc(l) };
            if !p.is_null() {
                grow(l.size());
            }
            p
        }
        unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
            let p = unsafe { System.alloc_zeroed(l) };
            if !p.is_null() {
                grow(l.size());
            }
            p
        }
        unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
            unsafe { System.dealloc(p, l) };
            CURRENT.fetch_sub(l.size() as u64, Relaxed);
        }
        unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
            let q = unsafe { System.realloc(p, l, new) };
            if !q.is_null() {
                CURRENT.fetch_sub(l.size() as u64, Relaxed);
                grow(new);
            }
            q
        }
    }

    /// `reset = true`: start a measurement now; `false`: bytes above the start's level at peak.
    pub fn peak_probe(reset: bool) -> u64 {
        if reset {
            let now = CURRENT.load(Relaxed);
            BASE.store(now, Relaxed);
            PEAK.store(now, Relaxed);
            0
        } else {
            PEAK.load(Relaxed).saturating_sub(BASE.load(Relaxed))
        }
    }
}

#[global_allocator]
static ALLOCATOR: alloc::Counting = alloc::Counting;

/// A progress bar on stderr, drawn only on a terminal.
struct Progress {
    enabled: bool,
    start: Instant,
}

impl Progress {
    fn new() -> Self {
        Progress {
            enabled: std::io::stderr().is_terminal(),
            start: Instant::now(),
        }
    }

    fn update(&self, done: usize, total: usize, label: &str) {
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

fn write_file(path: &Path, content: &str, flag: &str) -> Result<(), Error> {
    std::fs::write(path, content)
        .map_err(|e| Error::input(format!("{flag} {}: cannot write: {e}", path.display())))
}

fn device(arg: DeviceArg) -> Result<candle_core::Device, Error> {
    match arg {
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

/// C must be positive and σ non-negative, checked before any work is done.
fn check_flags(max_grad_norm: Option<f64>, noise_multiplier: Option<f64>) -> Result<(), Error> {
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
    Ok(())
}

/// The clippers named by `--clipper`, or `default` when none is.
fn clippers_or(
    names: Vec<String>,
    default: &[&str],
) -> Result<Vec<Box<dyn ghost_oracle::Clipper>>, Error> {
    if names.is_empty() {
        default.iter().map(|n| builtin(n)).collect()
    } else {
        names.iter().map(|n| builtin(n)).collect()
    }
}

fn load_case(model: &Path, batch: &Path) -> Result<Case, Error> {
    let m = Gpt2::load(model)?;
    let b = Batch::load(batch)?;
    b.validate(&m.config, &batch.display().to_string())?;
    Ok(Case {
        name: model
            .file_name()
            .map_or("checkpoint".into(), |n| n.to_string_lossy().into_owned()),
        model: m,
        batch: b,
        c_multipliers: vec![1.0],
    })
}

fn run(cli: Cli) -> Result<ExitCode, Error> {
    match cli.command {
        Command::Reference {
            model,
            batch,
            reduction,
            json,
        } => {
            let m = Gpt2::load(&model)?;
            let b = Batch::load(&batch)?;
            b.validate(&m.config, &batch.display().to_string())?;
            let progress = Progress::new();
            let opts = reference::Options {
                reduction: reduction.into(),
                ..Default::default()
            };
            let r =
                reference::compute(&m, &b, &opts, &mut |d, t| progress.update(d, t, "examples"))?;
            print!("{}", reference_table(&r));
            if let Some(path) = json {
                write_file(
                    &path,
                    &serde_json::to_string_pretty(&r.to_json()).expect("json"),
                    "--json",
                )?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Audit {
            model,
            batch,
            clippers,
            max_grad_norm,
            noise_multiplier,
            dtype,
            device: dev,
            reduction,
            report,
        } => {
            check_flags(max_grad_norm, Some(noise_multiplier))?;
            let clippers = clippers_or(clippers, &ghost_oracle::BUILTIN_CLIPPERS)?;
            let cases = match (model, batch) {
                (Some(m), Some(b)) => vec![load_case(&m, &b)?],
                _ => builtin_suite(),
            };
            let (dtype, dtype_name) = match dtype {
                DtypeArg::F32 => (candle_core::DType::F32, "f32"),
                DtypeArg::F64 => (candle_core::DType::F64, "f64"),
            };
            let device_name = match dev {
                DeviceArg::Cpu => "cpu",
                DeviceArg::Cuda => "cuda",
            };
            let opts = AuditOptions {
                max_grad_norm,
                noise_multiplier,
                dtype,
                device: device(dev)?,
                reduction: reduction.into(),
            };
            let progress = Progress::new();
            let audits = run_audit(&cases, &clippers, &opts, &mut |d, t, l| {
                progress.update(d, t, l)
            })?;
            report.emit(&audits, dtype_name, device_name)
        }
        Command::Mutants { list, dtype, json } => mutants(list, dtype, json),
        Command::Bench {
            vocab,
            hidden,
            seq,
            batch,
            clippers,
            trace,
            runs,
            dtype,
            device: dev,
            json,
        } => {
            for (flag, v) in [
                ("--vocab", vocab),
                ("--hidden", hidden),
                ("--seq", seq),
                ("--batch", batch),
                ("--runs", runs),
            ] {
                if v == 0 {
                    return Err(Error::input(format!("{flag} must be at least 1")));
                }
            }
            let clippers = clippers_or(clippers, &["ghost", "ghost-tied", "materialize"])?;
            let device = device(dev)?;
            let dtype: candle_core::DType = dtype.into();
            let (t, shape) = match &trace {
                Some(path) => {
                    let (rt, _) = reference::read_trace(path)?;
                    let t = ghost_oracle::Trace::from_reference(&rt, dtype, &device)?;
                    (t, format!("trace {}", path.display()))
                }
                None => (
                    tied_head_trace(vocab, hidden, seq, batch, dtype, &device)?,
                    format!("tied head V={vocab} d={hidden} T={seq} B={batch}"),
                ),
            };
            println!("{shape}, {dtype:?}, {runs} timed runs after a warm-up");
            println!("{:<14} {:>12} {:>14}", "clipper", "seconds", "peak MiB");
            let results = bench_clipper(&clippers, &t, runs, &mut alloc::peak_probe)?;
            for r in &results {
                println!(
                    "{:<14} {:>12.4} {:>14.1}",
                    r.clipper,
                    r.seconds,
                    r.peak_bytes as f64 / (1 << 20) as f64
                );
            }
            let find = |n: &str| results.iter().find(|r| r.clipper == n);
            if let (Some(g), Some(gt)) = (find("ghost"), find("ghost-tied")) {
                println!(
                    "ghost-tied / ghost: time {:.3}, peak memory {:.3}",
                    gt.seconds / g.seconds,
                    gt.peak_bytes as f64 / g.peak_bytes as f64
                );
            }
            if let (Some(gt), Some(m)) = (find("ghost-tied"), find("materialize")) {
                println!(
                    "materialize / ghost-tied: time {:.3}, peak memory {:.3}",
                    m.seconds / gt.seconds,
                    m.peak_bytes as f64 / gt.peak_bytes as f64
                );
            }
            if let Some(path) = json {
                let doc = serde_json::json!({"shape": {"vocab": vocab, "hidden": hidden, "seq": seq, "batch": batch}, "trace": trace, "results": results});
                write_file(
                    &path,
                    &serde_json::to_string_pretty(&doc).expect("json"),
                    "--json",
                )?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Check {
            trace,
            precision,
            noise_multiplier,
            report,
        } => {
            let precision = precision.map(|p| match p {
                PrecisionArg::F16 => candle_core::DType::F16,
                PrecisionArg::Bf16 => candle_core::DType::BF16,
                PrecisionArg::F32 => candle_core::DType::F32,
                PrecisionArg::F64 => candle_core::DType::F64,
            });
            check_flags(None, noise_multiplier)?;
            let (audit, precision) = check_trace(&trace, precision, noise_multiplier)?;
            let audits = vec![audit];
            let precision = format!("{precision:?}").to_lowercase();
            report.emit(&audits, &precision, "trace file")
        }
        Command::ExportTrace {
            model,
            batch,
            out,
            clipper,
            max_grad_norm,
            dtype,
            reduction,
        } => {
            check_flags(max_grad_norm, None)?;
            let clip = builtin(&clipper)?;
            let m = Gpt2::load(&model)?;
            let b = Batch::load(&batch)?;
            b.validate(&m.config, &batch.display().to_string())?;
            let extracted =
                CandleGpt2::from_reference(&m, dtype.into(), &candle_core::Device::Cpu)?
                    .extract(&b, reduction.into())?;
            let report = clip.norms(&extracted.trace)?;
            let c = max_grad_norm.unwrap_or_else(|| median(&report.norms));
            let coefs = clip_coefficients(&report.norms, c);
            write_claimed_trace(
                &out,
                &extracted.trace,
                &clip.name(),
                &report.norms,
                &coefs,
                c,
            )
            .map_err(|e| e.context(format!("--out {}", out.display())))?;
            println!(
                "wrote {} ({} sites, {} examples, claims of {}, C = {c})",
                out.display(),
                extracted.trace.sites.len(),
                b.len(),
                clip.name()
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn mutants(list: bool, dtype: DtypeArg, json: Option<PathBuf>) -> Result<ExitCode, Error> {
    if list {
        for m in Mutant::ALL {
            println!("mutant:{:<18} {}", m.name(), m.reproduces());
        }
        return Ok(ExitCode::SUCCESS);
    }
    let dtype = match dtype {
        DtypeArg::F32 => candle_core::DType::F32,
        DtypeArg::F64 => candle_core::DType::F64,
    };
    let opts = AuditOptions {
        max_grad_norm: None,
        noise_multiplier: 1.0,
        dtype,
        device: candle_core::Device::Cpu,
        reduction: Reduction::Mean,
    };
    let progress = Progress::new();
    let m = kill_matrix(&builtin_suite(), &opts, &mut |d, t, l| {
        progress.update(d, t, l)
    })?;
    print!("{}", kill_matrix_table(&m));
    if let Some(path) = json {
        write_file(
            &path,
            &serde_json::to_string_pretty(&kill_matrix_json(&m)).expect("json"),
            "--json",
        )?;
    }
    println!(
        "{}",
        if m.ok() {
            "every mutant caught with the right verdict; no false alarm"
        } else {
            "DETECTION CHECK FAILED"
        }
    );
    Ok(if m.ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
