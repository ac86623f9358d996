//! `export-trace`: a trace of a checkpoint (GPT-2, Llama or Qwen2) from the candle model, with a
//! clipper's norms as the claim.

use super::{clip_norm, out, PrecisionArg, ReductionArg};
use ghost_oracle::audit::median;
use ghost_oracle::clippers::clip_coefficients;
use ghost_oracle::model::CandleModel;
use ghost_oracle::trace::{candle_dtype, write_claimed_trace};
use ghost_oracle::{registry, ClipNorm, Error, Precision};
use ghost_oracle_reference::{Batch, Model};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory (config.json + model.safetensors) of a GPT-2, Llama or Qwen2
    /// model, e.g. oracles/golden/cases/tied_l2_h4_t33.
    #[arg(long)]
    model: PathBuf,
    /// Batch file: safetensors with `input_ids` (i64, B×T) and optional `labels`.
    #[arg(long)]
    batch: PathBuf,
    /// Trace file to write.
    #[arg(long)]
    out: PathBuf,
    /// Clipper whose norms become the trace's claim (a built-in one or mutant:NAME).
    #[arg(long, default_value = "ghost-tied")]
    clipper: String,
    /// Clipping norm C stored in the trace. Default: the median of the clipper's norms.
    #[arg(long, allow_negative_numbers = true)]
    max_grad_norm: Option<f64>,
    /// Precision the candle model and the clipper compute in; the factors are stored in it.
    #[arg(long, value_enum, default_value = "f32")]
    dtype: PrecisionArg,
    /// How each example's loss is reduced over its tokens: mean (HF's loss) or sum.
    #[arg(long, value_enum, default_value = "mean")]
    reduction: ReductionArg,
}

pub fn run(a: Args) -> Result<ExitCode, Error> {
    let max_grad_norm = clip_norm(a.max_grad_norm)?;
    // Before the model runs: an --out that cannot be written fails fast.
    ghost_oracle::atomic::check_target(&a.out, "--out")?;
    let clip = registry::clipper(&a.clipper).map_err(|e| e.context("--clipper"))?;
    let m: Model = ghost_oracle_reference::load(&a.model)?;
    let b = Batch::load(&a.batch)?;
    b.validate(&m, &a.batch.display().to_string())?;
    let extracted = CandleModel::from_reference(
        &m,
        candle_dtype(Precision::from(a.dtype)),
        &candle_core::Device::Cpu,
    )?
    .extract(&b, a.reduction.into())?;
    let report = clip.norms(&extracted.trace)?;
    let c = match max_grad_norm {
        Some(c) => c,
        None => ClipNorm::new(median(&report.norms)).map_err(|_| {
            Error::input(format!(
                "the median of {}'s norms is not a positive clipping norm; give --max-grad-norm",
                clip.name()
            ))
        })?,
    };
    let coefs = clip_coefficients(&report.norms, c);
    write_claimed_trace(
        &a.out,
        &extracted.trace,
        &clip.name(),
        &report.norms,
        &coefs,
        c.get(),
    )
    .map_err(|e| e.context("--out"))?;
    out(&format!(
        "wrote {} ({} sites, {} examples, claims of {}, C = {c})\n",
        a.out.display(),
        extracted.trace.sites.len(),
        b.len(),
        clip.name(),
        c = c.get()
    ))?;
    Ok(ExitCode::SUCCESS)
}
