//! `mutants`: the seeded bugs of real DP libraries, and whether the judge catches each.

use super::{out, to_json, write_file, DeprecatedDtype, PrecisionArg, Progress};
use ghost_oracle::audit::{builtin_suite, kill_matrix};
use ghost_oracle::mutants::Mutant;
use ghost_oracle::report::{
    kill_matrix_html, kill_matrix_json, kill_matrix_table, kill_matrix_verdict_line,
};
use ghost_oracle::{AuditOptions, Error, Precision};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Only list the mutants and the library behaviour each reproduces.
    #[arg(long)]
    list: bool,
    /// Precision the clippers compute in.
    #[arg(long, value_enum, default_value = "f32")]
    precision: PrecisionArg,
    #[command(flatten)]
    dtype: DeprecatedDtype,
    /// Also write the kill matrix as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also write the kill matrix and every clipper's plots as a self-contained HTML file.
    #[arg(long)]
    html: Option<PathBuf>,
}

pub fn run(a: Args) -> Result<ExitCode, Error> {
    if a.list {
        let list: String = Mutant::ALL
            .iter()
            .map(|m| format!("mutant:{:<18} {}\n", m.name(), m.reproduces()))
            .collect();
        out(&list)?;
        return Ok(ExitCode::SUCCESS);
    }
    let precision = Precision::from(a.dtype.or(a.precision));
    let opts = AuditOptions {
        precision,
        ..AuditOptions::default()
    };
    let progress = Progress::new();
    let m = kill_matrix(&builtin_suite(), &opts, &mut |d, t, l| {
        progress.update(d, t, l)
    })?;
    if let Some(path) = &a.json {
        write_file(path, &to_json(&kill_matrix_json(&m)), "--json")?;
    }
    if let Some(path) = &a.html {
        write_file(path, &kill_matrix_html(&m, precision.name())?, "--html")?;
    }
    out(&kill_matrix_table(&m))?;
    out(&format!("{}\n", kill_matrix_verdict_line(&m)))?;
    Ok(if m.ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
