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

use ghost_oracle::audit::{builtin_suite, cases_to_audit, check_trace, kill_matrix};
use ghost_oracle::mutants::Mutant;
use ghost_oracle::options::{Field, OptionError};
use ghost_oracle::report::{
    audit_json, audit_tables, kill_matrix_explanation, kill_matrix_json, kill_matrix_table,
    kill_matrix_verdict_line, Explanation, Reader,
};
use ghost_oracle::{registry, AccountingRequest, AuditOptions, CheckOptions};
use ghost_oracle::{ClipNorm, ClipperAudit, Error, NoiseMultiplier, Precision, Verdict};
use ghost_oracle_reference::{MemoryBudget, Reduction, TiedParameter};
use pyo3::exceptions::{PyFileNotFoundError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyList};
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
// Arguments, checked before any work is done by the library's options layer; its errors name
// the Python argument.

/// The Python argument a library option comes from.
fn argument(field: Field) -> &'static str {
    match field {
        Field::MaxGradNorm => "max_grad_norm",
        Field::NoiseMultiplier => "noise_multiplier",
        Field::SamplingRate => "sampling_rate",
        Field::Steps => "steps",
        Field::Epochs => "epochs",
        Field::DatasetSize => "dataset_size",
        Field::Delta => "delta",
        Field::MaxEpsilon => "max_epsilon",
    }
}

impl From<OptionError> for Failure {
    fn from(e: OptionError) -> Self {
        input(e.message(argument(e.field)))
    }
}

/// A precision by its name, for the `precision` arguments.
fn parse_precision(what: &str, p: &str) -> Result<Precision, Failure> {
    Precision::parse(p).ok_or_else(|| {
        input(format!(
            "{what} must be one of {}, got {p:?}",
            Precision::names()
        ))
    })
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
// Results as Python data, from the library's own serde documents.

/// A JSON value as Python data (dicts, lists, floats, ints, strings, None).
fn to_py<'py>(py: Python<'py>, v: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    use serde_json::Value;
    Ok(match v {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => i.into_pyobject(py)?.into_any(),
            (None, Some(f)) => f.into_pyobject(py)?.into_any(),
            (None, None) => py.None().into_bound(py),
        },
        Value::String(s) => s.into_pyobject(py)?.into_any(),
        Value::Array(xs) => PyList::new(
            py,
            xs.iter()
                .map(|x| to_py(py, x))
                .collect::<PyResult<Vec<_>>>()?,
        )?
        .into_any(),
        Value::Object(m) => {
            let d = PyDict::new(py);
            for (k, x) in m {
                d.set_item(k, to_py(py, x)?)?;
            }
            d.into_any()
        }
    })
}

/// A clipper's audit as Python data: its serde document, with the privacy report's sentences.
fn clipper_dict<'py>(py: Python<'py>, a: &ClipperAudit) -> PyResult<Bound<'py, PyAny>> {
    let mut doc = serde_json::to_value(a)
        .map_err(|e| PyRuntimeError::new_err(format!("cannot serialize an audit: {e}")))?;
    doc["privacy"]["sentence"] = a.privacy.sentence().into();
    doc["privacy"]["setting"] = a.privacy.setting().into();
    to_py(py, &doc)
}

fn pretty(v: &serde_json::Value) -> String {
    // Our own documents always serialize: every map key is a string.
    serde_json::to_string_pretty(v).unwrap_or_default()
}

/// The report as Python data: its JSON document, the CLI's table and the deciding case in words
/// (with a trace file's shared parameters, `tied`), and every clipper's audit.
fn report_dict<'py>(
    py: Python<'py>,
    kind: &str,
    audits: &[ClipperAudit],
    dtype: &str,
    device: &str,
    tied: Option<&[TiedParameter]>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("kind", kind)?;
    d.set_item("precision", dtype)?;
    d.set_item("device", device)?;
    d.set_item("json", pretty(&audit_json(audits, dtype, device)))?;
    d.set_item("table", audit_tables(audits, dtype, device))?;
    let explanation = Explanation {
        audits,
        precision: dtype,
        tied,
        reader: Reader::Python,
    };
    d.set_item("explanation", explanation.text())?;
    let clippers = audits
        .iter()
        .map(|a| clipper_dict(py, a))
        .collect::<PyResult<Vec<_>>>()?;
    d.set_item("clippers", clippers)?;
    Ok(d)
}

// ---------------------------------------------------------------------------------------------
// The functions.

/// The accounting arguments every function takes (`sampling_rate`, `steps`, `epochs`,
/// `dataset_size`, `delta`, each None for its default), from its `**accounting` keywords; any
/// other keyword is a `TypeError` naming it, as for a function that spells them out.
fn accounting_request(
    function: &str,
    accounting: Option<&Bound<'_, PyDict>>,
) -> PyResult<AccountingRequest> {
    let mut request = AccountingRequest::default();
    let Some(keywords) = accounting else {
        return Ok(request);
    };
    for (key, value) in keywords.iter() {
        let key: String = key.extract()?;
        let named = |e: PyErr| PyTypeError::new_err(format!("argument '{key}': {e}"));
        match key.as_str() {
            "sampling_rate" => request.sampling_rate = value.extract().map_err(named)?,
            "steps" => request.steps = value.extract().map_err(named)?,
            "epochs" => request.epochs = value.extract().map_err(named)?,
            "dataset_size" => request.dataset_size = value.extract().map_err(named)?,
            "delta" => request.delta = value.extract().map_err(named)?,
            other => {
                return Err(PyTypeError::new_err(format!(
                    "{function}() got an unexpected keyword argument '{other}'"
                )))
            }
        }
    }
    Ok(request)
}

/// The options `audit` and `mutants` share: the clippers' precision and the accounted run, the
/// rest at the library's defaults.
fn audit_options(
    precision: Precision,
    accounting: AccountingRequest,
) -> Result<AuditOptions, Failure> {
    Ok(AuditOptions {
        precision,
        accounting: accounting.resolve()?,
        ..AuditOptions::default()
    })
}

/// check(trace, *, noise_multiplier=None, precision=None, sampling_rate=None, steps=None,
/// epochs=None, dataset_size=None, delta=None, max_memory=None) -> dict
///
/// Judges the per-example norms claimed in a trace file (`ghost-oracle check TRACE`).
/// `max_memory`: a size such as "8G" (`--max-memory`); default the machine's available memory.
#[pyfunction]
#[pyo3(signature = (trace, *, noise_multiplier=None, precision=None, max_memory=None, **accounting))]
fn check<'py>(
    py: Python<'py>,
    trace: PathBuf,
    noise_multiplier: Option<f64>,
    precision: Option<&str>,
    max_memory: Option<&str>,
    accounting: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let accounting = accounting_request("check", accounting)?;
    let precision = precision
        .map(|p| parse_precision("precision", p))
        .transpose()?;
    let max_memory = max_memory
        .map(|m| MemoryBudget::parse(m, "max_memory"))
        .transpose()
        .map_err(|e| PyValueError::new_err(e.message().to_string()))?;
    let path = trace.clone();
    let checked = guarded(py, move || {
        let opts = CheckOptions {
            max_memory,
            precision,
            noise_multiplier: noise_multiplier.map(NoiseMultiplier::new).transpose()?,
            accounting: accounting.resolve()?,
        };
        check_trace(&path, &opts)
            .map_err(Failure::from)
            .map_err(on_paths(&[&path]))
    })?;
    let precision = checked.audit.precision.name();
    let d = report_dict(
        py,
        "check",
        std::slice::from_ref(&checked.audit),
        precision,
        "trace file",
        Some(&checked.tied),
    )?;
    d.set_item("trace", trace)?;
    let tied = checked
        .tied
        .iter()
        .map(|t| {
            let sites: Vec<(&str, &str)> = t
                .sites
                .iter()
                .map(|(name, kind)| (name.as_str(), kind.name()))
                .collect();
            let entry = PyDict::new(py);
            entry.set_item("param", &t.param)?;
            entry.set_item("sites", sites)?;
            Ok(entry)
        })
        .collect::<PyResult<Vec<_>>>()?;
    d.set_item("tied", tied)?;
    d.set_item("batch_divisor", checked.batch_divisor)?;
    Ok(d)
}

/// audit(*, model=None, batch=None, clippers=None, max_grad_norm=None, noise_multiplier=1.0,
/// precision="f32", reduction="mean", sampling_rate=None, steps=None, epochs=None,
/// dataset_size=None, delta=None) -> dict
///
/// Audits clippers on the built-in suite, or on a checkpoint directory and a batch file
/// (`ghost-oracle audit`).
#[pyfunction]
#[pyo3(signature = (*, model=None, batch=None, clippers=None, max_grad_norm=None, noise_multiplier=1.0, precision="f32", reduction="mean", **accounting))]
#[allow(clippy::too_many_arguments)]
fn audit<'py>(
    py: Python<'py>,
    model: Option<PathBuf>,
    batch: Option<PathBuf>,
    clippers: Option<Vec<String>>,
    max_grad_norm: Option<f64>,
    noise_multiplier: f64,
    precision: &str,
    reduction: &str,
    accounting: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let accounting = accounting_request("audit", accounting)?;
    let precision = parse_precision("precision", precision)?;
    let reduction = parse_reduction(reduction)?;
    let audits = guarded(py, move || {
        let opts = AuditOptions {
            max_grad_norm: max_grad_norm.map(ClipNorm::new).transpose()?,
            noise_multiplier: NoiseMultiplier::new(noise_multiplier)?,
            device: candle_core::Device::Cpu,
            reduction,
            ..audit_options(precision, accounting)?
        };
        let boxes =
            registry::clippers(&clippers.unwrap_or_default()).map_err(|e| e.context("clippers"))?;
        // A missing file is `FileNotFoundError` only where both were given: a lone `model` or
        // `batch` is refused for the missing partner, whatever the path.
        let given: Vec<&Path> = match (&model, &batch) {
            (Some(m), Some(b)) => vec![m.as_path(), b.as_path()],
            _ => vec![],
        };
        let cases = cases_to_audit(model.as_deref(), batch.as_deref())
            .map_err(Failure::from)
            .map_err(on_paths(&given))?;
        Ok(ghost_oracle::audit::run(
            cases,
            &boxes,
            &opts,
            &mut |_, _, _| {},
        )?)
    })?;
    report_dict(py, "audit", &audits, precision.name(), "cpu", None)
}

/// mutants(*, precision="f32", sampling_rate=None, steps=None, epochs=None, dataset_size=None,
/// delta=None) -> dict
///
/// The kill matrix: every seeded bug of a real DP library, and the correct clippers, on the
/// built-in suite (`ghost-oracle mutants`).
#[pyfunction]
#[pyo3(signature = (*, precision="f32", **accounting))]
fn mutants<'py>(
    py: Python<'py>,
    precision: &str,
    accounting: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let accounting = accounting_request("mutants", accounting)?;
    let precision = parse_precision("precision", precision)?;
    let matrix = guarded(py, move || {
        let opts = audit_options(precision, accounting)?;
        Ok(kill_matrix(&builtin_suite(), &opts, &mut |_, _, _| {})?)
    })?;
    let d = report_dict(py, "mutants", &matrix.audits, precision.name(), "cpu", None)?;
    d.set_item("explanation", kill_matrix_explanation(&matrix))?;
    let doc = kill_matrix_json(&matrix);
    d.set_item("json", pretty(&doc))?;
    d.set_item(
        "table",
        format!(
            "{}{}\n",
            kill_matrix_table(&matrix),
            kill_matrix_verdict_line(&matrix)
        ),
    )?;
    d.set_item("ok", matrix.ok())?;
    d.set_item("cases", matrix.cases.clone())?;
    // The rows of the JSON document itself, so that Python reads the kill matrix under the
    // names the judge writes.
    d.set_item("rows", to_py(py, &doc["rows"])?)?;
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
    m.add("BUILTIN_CLIPPERS", registry::builtin_names())?;
    let verdicts: Vec<&str> = Verdict::ALL.iter().map(|v| v.name()).collect();
    m.add("VERDICTS", verdicts)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
