//! A case made ready for the clippers: the reference's truth, the judge built on it, the trace in
//! the clippers' precision and the clipping norms to try.

use super::{AuditOptions, Case};
use crate::error::{Error, Result};
use crate::judge::{CaseLabel, Judge};
use crate::options::ClipNorm;
use crate::trace::{candle_dtype, Precision, Trace};
use ghost_oracle_reference as reference;
use std::borrow::Borrow;

/// The judge of a case and its trace in the clippers' dtype and device.
pub struct PreparedCase {
    /// The case's truth and tolerance.
    pub judge: Judge,
    /// The case's factors in the clippers' dtype, on their device.
    pub trace: Trace,
    /// The clipping norms to evaluate at, each with its label.
    pub clip_norms: Vec<(CaseLabel, ClipNorm)>,
}

/// The median (mean of the middle two for an even count): the default clipping norm.
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        0.5 * (s[n / 2 - 1] + s[n / 2])
    }
}

/// The reference on a case, its judge and the clippers' trace; `progress` hears of every pass of
/// the reference. A case passed by value is dropped here, its weights with it, before any
/// clipper runs.
pub fn prepare(
    case: impl Borrow<Case>,
    opts: &AuditOptions,
    progress: &mut dyn FnMut(reference::Progress),
) -> Result<PreparedCase> {
    let case = case.borrow();
    let ropts = reference::Options {
        reduction: opts.reduction,
        record_trace: true,
        ..reference::Options::default()
    };
    let r = reference::compute(&case.model, &case.batch, &ropts, progress)
        .map_err(|e| Error::from(e).context(&case.name))?;
    let (trace, judge) = trace_and_judge(r, &case.name, opts)?;
    let clip_norms = clip_norms(case, &judge, opts)?;
    Ok(PreparedCase {
        judge,
        trace,
        clip_norms,
    })
}

/// The clippers' trace and the judge of the reference's result on case `name`, at the audit's
/// precision.
fn trace_and_judge(
    r: reference::Reference,
    name: &str,
    opts: &AuditOptions,
) -> Result<(Trace, Judge)> {
    Ok(match opts.precision {
        // f32 and f64 clippers are judged against the model's own gradients; the bound covers
        // rounding the trace to f32.
        Precision::F64 | Precision::F32 => (
            Trace::from_reference(
                r.trace.as_ref().expect("trace recorded"),
                candle_dtype(opts.precision),
                &opts.device,
            )?,
            Judge::from_reference(r).map_err(|e| e.context(name))?,
        ),
        // Rounding the factors to bf16 moves a norm by up to a few tenths of a percent, as much
        // as the bugs a low-precision audit looks for. The clipper's gradients are the rounded
        // factors' (that is what it clips and sums), so the truth is taken from exactly those,
        // as `check` takes it from a trace file's.
        Precision::F16 | Precision::BF16 => {
            let rounded = r
                .trace
                .as_ref()
                .expect("trace recorded")
                .rounded(opts.precision);
            drop(r);
            let trace =
                Trace::from_reference(&rounded, candle_dtype(opts.precision), &opts.device)?;
            (
                trace,
                Judge::from_trace(rounded).map_err(|e| e.context(name))?,
            )
        }
    })
}

/// The clipping norms a case is judged at, each with its label: the audit's C, or the case's
/// multiples of the median true norm.
fn clip_norms(
    case: &Case,
    judge: &Judge,
    opts: &AuditOptions,
) -> Result<Vec<(CaseLabel, ClipNorm)>> {
    let Some(c) = opts.max_grad_norm else {
        let med = median(&judge.truth.norms);
        let several = case.c_multipliers.len() > 1;
        return case
            .c_multipliers
            .iter()
            .map(|&m| {
                let c = ClipNorm::new(med * m).map_err(|_| {
                    Error::input(format!(
                        "case {}: C = {m} × the median true norm {med:e} is not a positive \
                         clipping norm; give one",
                        case.name
                    ))
                })?;
                let label = CaseLabel {
                    base_case: case.name.clone(),
                    c_multiplier: several.then_some(m),
                };
                Ok((label, c))
            })
            .collect();
    };
    Ok(vec![(CaseLabel::from(case.name.as_str()), c)])
}
