//! `reference`: per-example gradient norms of a checkpoint from the f64 reference.

use super::{out, to_json, write_file, Progress, ReductionArg};
use ghost_oracle::report::reference_table;
use ghost_oracle::Error;
use ghost_oracle_reference::{self as reference, Batch, Model};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory with config.json and model.safetensors (as save_pretrained writes
    /// them), e.g. oracles/golden/cases/tied_l2_h4_t33.
    #[arg(long)]
    model: PathBuf,
    /// Safetensors file with `input_ids` (i64, B×T) and optional `labels` (-100 = ignored),
    /// e.g. oracles/golden/cases/tied_l2_h4_t33/batch.safetensors.
    #[arg(long)]
    batch: PathBuf,
    /// How each example's loss is reduced over its tokens: mean (HF's loss) or sum.
    #[arg(long, value_enum, default_value = "mean")]
    reduction: ReductionArg,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn run(a: Args) -> Result<ExitCode, Error> {
    let m: Model = reference::load(&a.model)?;
    let b = Batch::load(&a.batch)?;
    b.validate(&m, &a.batch.display().to_string())?;
    let progress = Progress::new();
    let opts = reference::Options {
        reduction: a.reduction.into(),
        ..Default::default()
    };
    let r = reference::compute(&m, &b, &opts, &mut |p| {
        let (done, total) = p.steps();
        progress.update(done, total, &p.describe())
    })?;
    if let Some(path) = &a.json {
        write_file(path, &to_json(&r.to_json()), "--json")?;
    }
    out(&reference_table(&r))?;
    Ok(ExitCode::SUCCESS)
}
