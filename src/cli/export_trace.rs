//! `export-trace`: a trace of a checkpoint (GPT-2, Llama or Qwen2) from the candle model, with a
//! clipper's norms as the claim.

use super::{check_flags, out, DtypeArg, ReductionArg};
use ghost_oracle::{clip_coefficients, clipper_by_name, median, write_claimed_trace};
use ghost_oracle::{CandleModel, Error};
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
    dtype: DtypeArg,
    /// How each example's loss is reduced over its tokens: mean (HF's loss) or sum.
    #[arg(long, value_enum, default_value = "mean")]
    reduction: ReductionArg,
}

pub fn run(a: Args) -> Result<ExitCode, Error> {
    check_flags(a.max_grad_norm, None)?;
    let clip = clipper_by_name(&a.clipper)?;
    let m = Model::load(&a.model)?;
    let b = Batch::load(&a.batch)?;
    b.validate(&m, &a.batch.display().to_string())?;
    let extracted = CandleModel::from_reference(&m, a.dtype.dtype(), &candle_core::Device::Cpu)?
        .extract(&b, a.reduction.into())?;
    let report = clip.norms(&extracted.trace)?;
    let c = a.max_grad_norm.unwrap_or_else(|| median(&report.norms));
    let coefs = clip_coefficients(&report.norms, c);
    write_claimed_trace(
        &a.out,
        &extracted.trace,
        &clip.name(),
        &report.norms,
        &coefs,
        c,
    )
    .map_err(|e| e.context(format!("--out {}", a.out.display())))?;
    out(&format!(
        "wrote {} ({} sites, {} examples, claims of {}, C = {c})\n",
        a.out.display(),
        extracted.trace.sites.len(),
        b.len(),
        clip.name()
    ))?;
    Ok(ExitCode::SUCCESS)
}
