//! `ghost_oracle._native`: ghost-oracle's trace check, audit and kill matrix for Python.
//!
//! Every function calls the `ghost-oracle` library (never the command-line binary) with the GIL
//! released, and returns plain Python data (dicts, lists, floats) that the pure-Python
//! `ghost_oracle` package turns into a `Report`. Failures become Python exceptions:
//!
//! - bad input (a malformed trace, a flag out of range, an unknown clipper): `ValueError` with
//!   the library's message, the one the CLI prints after `error:`;
//! - a file or directory that does not exist: `FileNotFoundError` with that same message;
//! - anything the library cannot blame on its input, and any Rust panic: `RuntimeError`. A panic
//!   is caught at the boundary and never unwinds into the interpreter.

use ghost_oracle::accountant::AccountingError;
use ghost_oracle::{
    account, audit_json, audit_tables, builtin_suite, check_trace, clippers_by_name, kill_matrix,
    kill_matrix_json, kill_matrix_table, run_audit, Accounting, AuditOptions, Case, CaseMetrics,
    ClipperAudit, Error, ExampleMetrics, Mutant, Precision, PrivacyReport, BUILTIN_CLIPPERS,
};
use ghost_oracle_reference::Reduction;
use pyo3::exceptions::{PyFileNotFoundError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::io::Read;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

/// Why a call failed, before it becomes a Python exception.
#[derive(Debug)]
enum Failure {
    /// Bad input: `ValueError`, or `FileNotFoundError` when a named path does not exist.
    Input { msg: String, missing: bool },
    /// Not the input's fault: `RuntimeError`.
    Internal(String),
    /// A Rust panic, caught at the boundary: `RuntimeError`.
    Panic(String),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        match e {
            Error::Input(msg) => Failure::Input {
                msg,
                missing: false,
            },
            Error::Internal(msg) => Failure::Internal(msg),
            Error::OutputClosed => Failure::Internal(e.to_string()),
        }
    }
}

impl From<ghost_oracle_reference::Error> for Failure {
    fn from(e: ghost_oracle_reference::Error) -> Self {
        Failure::from(Error::from(e))
    }
}

fn input(msg: impl Into<String>) -> Failure {
    Failure::Input {
        msg: msg.into(),
        missing: false,
    }
}

impl From<Failure> for PyErr {
    fn from(f: Failure) -> Self {
        match f {
            Failure::Input { msg, missing: true } => PyFileNotFoundError::new_err(msg),
            Failure::Input { msg, .. } => PyValueError::new_err(msg),
            Failure::Internal(msg) => PyRuntimeError::new_err(msg),
            Failure::Panic(msg) => PyRuntimeError::new_err(format!(
                "ghost-oracle panicked (a bug in ghost-oracle, please report it with the input): {msg}"
            )),
        }
    }
}

/// An input error about a path that does not exist becomes `FileNotFoundError`, with the same
/// message.
fn on_paths<'a>(paths: &'a [&'a Path]) -> impl Fn(Failure) -> Failure + 'a {
    move |f| match f {
        Failure::Input { msg, .. } if paths.iter().any(|p| !p.exists()) => {
            Failure::Input { msg, missing: true }
        }
        other => other,
    }
}

/// Runs `f` without the GIL and with panics caught: a panic becomes `Failure::Panic`.
fn guarded<T, F>(py: Python<'_>, f: F) -> Result<T, Failure>
where
    F: FnOnce() -> Result<T, Failure> + Send,
    T: Send,
{
    py.detach(|| match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            Err(Failure::Panic(msg))
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Arguments, checked before any work is done (the CLI's checks, naming the Python argument).

fn check_max_grad_norm(c: Option<f64>) -> Result<(), Failure> {
    match c {
        Some(c) if !(c.is_finite() && c > 0.0) => Err(input(format!(
            "max_grad_norm must be a positive number, got {c}"
        ))),
        _ => Ok(()),
    }
}

fn check_noise_multiplier(s: Option<f64>) -> Result<(), Failure> {
    match s {
        Some(s) if !(s.is_finite() && s >= 0.0) => Err(input(format!(
            "noise_multiplier must be a non-negative number, got {s}"
        ))),
        _ => Ok(()),
    }
}

/// The run the ε speaks of: the arguments given, the typical fine-tuning run where none is.
fn accounting(
    sampling_rate: Option<f64>,
    steps: Option<i64>,
    delta: Option<f64>,
) -> Result<Accounting, Failure> {
    let typical = Accounting::typical();
    let steps = match steps {
        Some(s) if s < 1 => {
            return Err(input(format!(
                "steps must be a positive number of DP-SGD steps, got {s}"
            )))
        }
        Some(s) => Some(s as u64),
        None => None,
    };
    let given = sampling_rate.is_some() || steps.is_some() || delta.is_some();
    let setting = Accounting {
        sampling_rate: sampling_rate.unwrap_or(typical.sampling_rate),
        steps: steps.unwrap_or(typical.steps),
        delta: delta.unwrap_or(typical.delta),
        default_setting: !given,
    };
    setting.validate().map_err(|e| {
        let name = match e {
            AccountingError::SamplingRate(_) => "sampling_rate",
            AccountingError::Delta(_) => "delta",
            AccountingError::NoSteps => "steps",
            _ => "accounting",
        };
        input(format!("{name}: {e}"))
    })?;
    Ok(setting)
}

fn parse_precision(p: Option<&str>) -> Result<Option<Precision>, Failure> {
    Ok(match p {
        None => None,
        Some("f64") => Some(Precision::F64),
        Some("f32") => Some(Precision::F32),
        Some("f16") => Some(Precision::F16),
        Some("bf16") => Some(Precision::BF16),
        Some(other) => {
            return Err(input(format!(
                "precision must be one of f64, f32, f16, bf16, got {other:?}"
            )))
        }
    })
}

fn parse_dtype(d: &str) -> Result<candle_core::DType, Failure> {
    match d {
        "f32" => Ok(candle_core::DType::F32),
        "f64" => Ok(candle_core::DType::F64),
        other => Err(input(format!(
            "dtype must be \"f32\" or \"f64\" (the precision the clippers compute in), got {other:?}"
        ))),
    }
}

fn parse_reduction(r: &str) -> Result<Reduction, Failure> {
    match r {
        "mean" => Ok(Reduction::Mean),
        "sum" => Ok(Reduction::Sum),
        other => Err(input(format!(
            "reduction must be \"mean\" or \"sum\" (how each example's loss is reduced over its tokens), got {other:?}"
        ))),
    }
}

// ---------------------------------------------------------------------------------------------
// The trace header's tied parameters (the sites that share a `param`).

/// Each parameter written by more than one site, with those sites' (name, kind), in the order
/// of the header. Read after the trace passed the library's checks; any surprise gives none.
fn tied_parameters(path: &Path) -> Vec<(String, Vec<(String, String)>)> {
    let read = || -> Option<serde_json::Value> {
        let mut f = std::fs::File::open(path).ok()?;
        let size = f.metadata().ok()?.len();
        let mut n = [0u8; 8];
        f.read_exact(&mut n).ok()?;
        let n = u64::from_le_bytes(n);
        if n > size.saturating_sub(8) || n > (1 << 30) {
            return None;
        }
        let mut header = vec![0u8; n as usize];
        f.read_exact(&mut header).ok()?;
        let header: serde_json::Value = serde_json::from_slice(&header).ok()?;
        let sites = header.get("__metadata__")?.get("sites")?.as_str()?;
        serde_json::from_str(sites).ok()
    };
    let mut params: Vec<(String, Vec<(String, String)>)> = Vec::new();
    let Some(serde_json::Value::Array(sites)) = read() else {
        return params;
    };
    for s in &sites {
        let field = |k: &str| s.get(k).and_then(|v| v.as_str()).map(str::to_string);
        let (Some(name), Some(param), Some(kind)) = (field("name"), field("param"), field("kind"))
        else {
            continue;
        };
        match params.iter_mut().find(|(p, _)| *p == param) {
            Some((_, v)) => v.push((name, kind)),
            None => params.push((param, vec![(name, kind)])),
        }
    }
    params.retain(|(_, v)| v.len() > 1);
    params
}

// ---------------------------------------------------------------------------------------------
// Results as Python data.

fn nan_if_none(v: Option<f64>) -> f64 {
    v.unwrap_or(f64::NAN)
}

fn column<'py>(
    py: Python<'py>,
    examples: &[ExampleMetrics],
    f: impl Fn(&ExampleMetrics) -> f64,
) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, examples.iter().map(f))
}

fn case_dict<'py>(py: Python<'py>, c: &CaseMetrics) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("case", &c.case)?;
    d.set_item("max_grad_norm", c.max_grad_norm)?;
    d.set_item("noise_multiplier", c.noise_multiplier)?;
    d.set_item("verdict", c.verdict.name())?;
    d.set_item("worst_example", c.worst_example)?;
    d.set_item("max_norm_rel_err", c.max_norm_rel_err)?;
    d.set_item("max_err_units", c.max_err_units)?;
    d.set_item("max_coef_abs_diff", c.max_coef_abs_diff)?;
    d.set_item("decision_flips", c.decision_flips)?;
    d.set_item("max_sensitivity_ratio", c.max_sensitivity_ratio)?;
    d.set_item("effective_noise_multiplier", c.effective_noise_multiplier)?;
    d.set_item("effective_noise_ratio", c.effective_noise_ratio)?;
    d.set_item("reference_noise_ratio", c.reference_noise_ratio)?;
    d.set_item("clipped_sum_cosine", c.clipped_sum_cosine)?;
    d.set_item("clipped_sum_rel_err", c.clipped_sum_rel_err)?;
    d.set_item("clipped_sum_bound", c.clipped_sum_bound)?;
    d.set_item("max_cross_share", c.max_cross_share)?;
    d.set_item("invalid_examples", c.invalid_examples.clone())?;
    d.set_item("worst_contribution", c.worst_contribution)?;
    let e = &c.examples;
    d.set_item("true_norm", column(py, e, |x| x.true_norm)?)?;
    d.set_item("norm", column(py, e, |x| x.norm)?)?;
    d.set_item("norm_rel_err", column(py, e, |x| x.norm_rel_err)?)?;
    d.set_item("bound", column(py, e, |x| x.bound)?)?;
    d.set_item("err_units", column(py, e, |x| x.err_units)?)?;
    d.set_item("coefficient", column(py, e, |x| x.coefficient)?)?;
    d.set_item("true_coefficient", column(py, e, |x| x.true_coefficient)?)?;
    d.set_item("sensitivity", column(py, e, |x| x.sensitivity)?)?;
    d.set_item(
        "cross_share",
        column(py, e, |x| nan_if_none(x.cross_share))?,
    )?;
    d.set_item("flipped", PyList::new(py, e.iter().map(|x| x.flipped))?)?;
    d.set_item("invalid", PyList::new(py, e.iter().map(|x| x.invalid))?)?;
    Ok(d)
}

fn privacy_dict<'py>(py: Python<'py>, p: &PrivacyReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("sampling_rate", p.sampling_rate)?;
    d.set_item("steps", p.steps)?;
    d.set_item("delta", p.delta)?;
    d.set_item("default_setting", p.default_setting)?;
    d.set_item("noise_multiplier", p.noise_multiplier)?;
    d.set_item("stated_epsilon", p.stated_epsilon)?;
    d.set_item("worst_contribution", p.worst_contribution)?;
    d.set_item("effective_noise_multiplier", p.effective_noise_multiplier)?;
    d.set_item("actual_epsilon", p.actual())?;
    d.set_item("sigma_needed", p.sigma_needed)?;
    d.set_item("order", p.order)?;
    d.set_item("order_at_grid_edge", p.order_at_grid_edge)?;
    d.set_item("sentence", p.sentence())?;
    d.set_item("setting", p.setting())?;
    Ok(d)
}

fn clipper_dict<'py>(py: Python<'py>, a: &ClipperAudit) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("name", &a.name)?;
    d.set_item("verdict", a.verdict.name())?;
    d.set_item("worst_case", a.worst_case)?;
    d.set_item("warnings", a.warnings.clone())?;
    let cases = a
        .cases
        .iter()
        .map(|c| case_dict(py, c))
        .collect::<PyResult<Vec<_>>>()?;
    d.set_item("cases", cases)?;
    match &a.privacy {
        Some(p) => d.set_item("privacy", privacy_dict(py, p)?)?,
        None => d.set_item("privacy", py.None())?,
    }
    Ok(d)
}

fn pretty(v: &serde_json::Value) -> String {
    // Our own documents always serialize: every map key is a string.
    serde_json::to_string_pretty(v).unwrap_or_default()
}

fn report_dict<'py>(
    py: Python<'py>,
    kind: &str,
    audits: &[ClipperAudit],
    dtype: &str,
    device: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("kind", kind)?;
    d.set_item("dtype", dtype)?;
    d.set_item("device", device)?;
    d.set_item("json", pretty(&audit_json(audits, dtype, device)))?;
    d.set_item("table", audit_tables(audits, dtype, device))?;
    let clippers = audits
        .iter()
        .map(|a| clipper_dict(py, a))
        .collect::<PyResult<Vec<_>>>()?;
    d.set_item("clippers", clippers)?;
    Ok(d)
}

// ---------------------------------------------------------------------------------------------
// The functions.

/// check(trace, *, noise_multiplier=None, precision=None, sampling_rate=None, steps=None,
/// delta=None) -> dict
///
/// Judges the per-example norms claimed in a trace file (`ghost-oracle check TRACE`).
#[pyfunction]
#[pyo3(signature = (trace, *, noise_multiplier=None, precision=None, sampling_rate=None, steps=None, delta=None))]
fn check<'py>(
    py: Python<'py>,
    trace: PathBuf,
    noise_multiplier: Option<f64>,
    precision: Option<&str>,
    sampling_rate: Option<f64>,
    steps: Option<i64>,
    delta: Option<f64>,
) -> PyResult<Bound<'py, PyDict>> {
    let precision = parse_precision(precision)?;
    let path = trace.clone();
    let (audits, precision, tied) = guarded(py, move || {
        check_noise_multiplier(noise_multiplier)?;
        let setting = accounting(sampling_rate, steps, delta)?;
        let (audit, precision) = check_trace(&path, precision, noise_multiplier)
            .map_err(Failure::from)
            .map_err(on_paths(&[&path]))?;
        let sigma = audit.cases.first().map_or(1.0, |c| c.noise_multiplier);
        let mut audits = vec![audit];
        account(&mut audits, &setting, sigma)?;
        Ok((audits, precision, tied_parameters(&path)))
    })?;
    let d = report_dict(py, "check", &audits, precision.name(), "trace file")?;
    d.set_item("trace", trace)?;
    let tied = tied
        .into_iter()
        .map(|(param, sites)| {
            let t = PyDict::new(py);
            t.set_item("param", param)?;
            t.set_item("sites", sites)?;
            Ok(t)
        })
        .collect::<PyResult<Vec<_>>>()?;
    d.set_item("tied", tied)?;
    Ok(d)
}

/// audit(*, model=None, batch=None, clippers=None, max_grad_norm=None, noise_multiplier=1.0,
/// dtype="f32", reduction="mean", sampling_rate=None, steps=None, delta=None) -> dict
///
/// Audits clippers on the built-in suite, or on a checkpoint directory and a batch file
/// (`ghost-oracle audit`).
#[pyfunction]
#[pyo3(signature = (*, model=None, batch=None, clippers=None, max_grad_norm=None, noise_multiplier=1.0, dtype="f32", reduction="mean", sampling_rate=None, steps=None, delta=None))]
#[allow(clippy::too_many_arguments)]
fn audit<'py>(
    py: Python<'py>,
    model: Option<PathBuf>,
    batch: Option<PathBuf>,
    clippers: Option<Vec<String>>,
    max_grad_norm: Option<f64>,
    noise_multiplier: f64,
    dtype: &str,
    reduction: &str,
    sampling_rate: Option<f64>,
    steps: Option<i64>,
    delta: Option<f64>,
) -> PyResult<Bound<'py, PyDict>> {
    let dtype_name = dtype.to_string();
    let dtype = parse_dtype(dtype)?;
    let reduction = parse_reduction(reduction)?;
    let audits = guarded(py, move || {
        check_max_grad_norm(max_grad_norm)?;
        check_noise_multiplier(Some(noise_multiplier))?;
        let setting = accounting(sampling_rate, steps, delta)?;
        let boxes = clippers_by_name(&clippers.unwrap_or_default(), &BUILTIN_CLIPPERS)?;
        let cases = match (&model, &batch) {
            (Some(m), Some(b)) => {
                vec![Case::load(m, b)
                    .map_err(Failure::from)
                    .map_err(on_paths(&[m.as_path(), b.as_path()]))?]
            }
            (None, None) => builtin_suite(),
            (Some(_), None) => {
                return Err(input(
                    "model needs batch: a batch file (safetensors with `input_ids`) to audit the checkpoint on",
                ))
            }
            (None, Some(_)) => {
                return Err(input(
                    "batch needs model: a checkpoint directory (config.json + model.safetensors)",
                ))
            }
        };
        let opts = AuditOptions {
            max_grad_norm,
            noise_multiplier,
            dtype,
            device: candle_core::Device::Cpu,
            reduction,
        };
        let mut audits = run_audit(cases, &boxes, &opts, &mut |_, _, _| {})?;
        account(&mut audits, &setting, noise_multiplier)?;
        Ok(audits)
    })?;
    report_dict(py, "audit", &audits, &dtype_name, "cpu")
}

/// mutants(*, dtype="f32", sampling_rate=None, steps=None, delta=None) -> dict
///
/// The kill matrix: every seeded bug of a real DP library, and the correct clippers, on the
/// built-in suite (`ghost-oracle mutants`).
#[pyfunction]
#[pyo3(signature = (*, dtype="f32", sampling_rate=None, steps=None, delta=None))]
fn mutants<'py>(
    py: Python<'py>,
    dtype: &str,
    sampling_rate: Option<f64>,
    steps: Option<i64>,
    delta: Option<f64>,
) -> PyResult<Bound<'py, PyDict>> {
    let dtype_name = dtype.to_string();
    let dtype = parse_dtype(dtype)?;
    let (matrix, audits) = guarded(py, move || {
        let setting = accounting(sampling_rate, steps, delta)?;
        let opts = AuditOptions {
            max_grad_norm: None,
            noise_multiplier: 1.0,
            dtype,
            device: candle_core::Device::Cpu,
            reduction: Reduction::Mean,
        };
        let cases = builtin_suite();
        let matrix = kill_matrix(&cases, &opts, &mut |_, _, _| {})?;
        // Every clipper's full audit, in row order, with its ε.
        let mut audits = matrix.audits.clone();
        account(&mut audits, &setting, 1.0)?;
        Ok((matrix, audits))
    })?;
    let d = report_dict(py, "mutants", &audits, &dtype_name, "cpu")?;
    let verdict_line = if matrix.ok() {
        "every mutant caught with the right verdict; no false alarm\n"
    } else {
        "DETECTION CHECK FAILED\n"
    };
    d.set_item("json", pretty(&kill_matrix_json(&matrix)))?;
    d.set_item(
        "table",
        format!("{}{verdict_line}", kill_matrix_table(&matrix)),
    )?;
    d.set_item("ok", matrix.ok())?;
    d.set_item("cases", matrix.cases.clone())?;
    let rows = matrix
        .rows
        .iter()
        .map(|r| {
            let row = PyDict::new(py);
            row.set_item("clipper", &r.clipper)?;
            row.set_item("mutant", r.mutant.is_some())?;
            row.set_item("reproduces", r.mutant.map(|m| m.reproduces()))?;
            row.set_item(
                "cells",
                r.cells.iter().map(|v| v.name()).collect::<Vec<_>>(),
            )?;
            row.set_item("problems", r.problems.clone())?;
            Ok(row)
        })
        .collect::<PyResult<Vec<_>>>()?;
    d.set_item("rows", rows)?;
    Ok(d)
}

/// The seeded bugs: (clipper name, the library behaviour it reproduces).
#[pyfunction]
fn mutant_list() -> Vec<(String, &'static str)> {
    Mutant::ALL
        .iter()
        .map(|m| (format!("mutant:{}", m.name()), m.reproduces()))
        .collect()
}

/// Panics inside the guard, so that tests can see a panic arrive as `RuntimeError`.
#[pyfunction]
fn _panic_for_tests(py: Python<'_>) -> PyResult<()> {
    guarded(py, || -> Result<(), Failure> {
        panic!("a deliberate panic")
    })?;
    Ok(())
}

/// ghost-oracle's trace check, audit and kill matrix (the compiled core of `ghost_oracle`).
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(check, m)?)?;
    m.add_function(wrap_pyfunction!(audit, m)?)?;
    m.add_function(wrap_pyfunction!(mutants, m)?)?;
    m.add_function(wrap_pyfunction!(mutant_list, m)?)?;
    m.add_function(wrap_pyfunction!(_panic_for_tests, m)?)?;
    m.add("BUILTIN_CLIPPERS", BUILTIN_CLIPPERS.to_vec())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
