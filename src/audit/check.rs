//! Auditing a clipper outside Rust from its trace file: the truth from the trace itself (the
//! reference's brute-force materialization in f64), the claimed norms from the file.

use super::ClipperAudit;
use crate::error::{Error, Result};
use crate::judge::{Arithmetic, Claim, ClippingRule, Judge};
use crate::options::{Accounting, ClipNorm, NoiseMultiplier};
use crate::trace::Precision;
use ghost_oracle_reference as reference;
use ghost_oracle_reference::{Clipping, TiedParameter};
use std::path::Path;

/// How a trace is judged.
#[derive(Clone, Debug)]
pub struct CheckOptions {
    /// The precision the tolerance assumes; `None`: the coarser of the stored factors' and the
    /// trace's `compute_dtype`.
    pub precision: Option<Precision>,
    /// σ; `None`: the trace's, else 1.
    pub noise_multiplier: Option<NoiseMultiplier>,
    /// The run the ε is stated for.
    pub accounting: Accounting,
    /// What reading and judging the trace may hold; `None`: the machine's available memory.
    pub max_memory: Option<reference::MemoryBudget>,
}

impl Default for CheckOptions {
    fn default() -> Self {
        CheckOptions {
            precision: None,
            noise_multiplier: None,
            accounting: Accounting::typical(),
            max_memory: None,
        }
    }
}

/// A trace file's audit, with what its header says that the audit's figures do not.
#[derive(Clone, Debug)]
pub struct CheckedTrace {
    /// The trace's claims judged, as one clipper's audit.
    pub audit: ClipperAudit,
    /// The parameters its sites share (a tied embedding and LM head), with their sites.
    pub tied: Vec<TiedParameter>,
    /// The divisor its step states (`batch_divisor`), when it states one.
    pub batch_divisor: Option<f64>,
}

/// Audits the norms (and the step) claimed in a trace file.
pub fn check_trace(path: &Path, opts: &CheckOptions) -> Result<CheckedTrace> {
    check_trace_with_progress(path, opts, &|_, _, _| {})
}

/// [`check_trace`], telling `progress(done, total, what)` as the judge takes each parameter's
/// truth.
pub fn check_trace_with_progress(
    path: &Path,
    opts: &CheckOptions,
    progress: &dyn Fn(usize, usize, &str),
) -> Result<CheckedTrace> {
    let budget = opts
        .max_memory
        .unwrap_or_else(reference::MemoryBudget::machine);
    let (trace, meta) = reference::read_stored_trace_within(path, budget)?;
    let tied = trace.tied_parameters();
    // Without a step, the tolerance's costliest statistics wait until a verdict needs them
    // (the same verdicts; docs/tolerances.md); a step reads every example's bound as a figure.
    let judge = if meta.step.is_none() {
        Judge::from_trace_deferring(trace, progress)
    } else {
        Judge::from_trace_with_progress(trace, progress)
    };
    let mut judge = judge.map_err(|e| e.context(path.display()))?;
    // The model's own rounding in the factors, when the exporter measured it, widens every
    // example's bound (docs/tolerances.md, "The model's own rounding").
    if let Some(rounding) = meta.model_rounding.clone() {
        judge.tolerance = judge
            .tolerance
            .with_model_rounding(rounding, &path.display().to_string())?;
    }
    let invalid = |key: &str, e: crate::options::OptionError| {
        Error::input(e.message(&format!("{}: `__metadata__.{key}`", path.display())))
    };
    let c = ClipNorm::new(meta.max_grad_norm).map_err(|e| invalid("max_grad_norm", e))?;
    // The rule the step states (flat without one); automatic clipping's C/(n + γ) needs γ > 0,
    // or a zero norm's coefficient is infinite.
    let clipping = meta
        .step
        .as_ref()
        .map_or(ClippingRule::default(), |s| ClippingRule {
            clipping: s.clipping,
            stabilizer: s.clip_stabilizer,
        });
    if clipping.clipping == Clipping::Automatic && clipping.stabilizer <= 0.0 {
        return Err(Error::input(format!(
            "{}: `__metadata__.clipping` is \"automatic\" with `clip_stabilizer` {}: automatic clipping C/(n + γ) needs γ > 0",
            path.display(),
            clipping.stabilizer
        )));
    }
    // A trace without coefficients is clipped by that rule from its claimed norms.
    let coefficients = match &meta.claimed_coefficients {
        Some(cs) => cs.clone(),
        None => meta
            .claimed_norms
            .iter()
            .map(|&n| clipping.coefficient(n, c.get()))
            .collect(),
    };
    let claim = Claim {
        norms: meta.claimed_norms.clone(),
        coefficients,
        clipped_sum: None,
        clipping,
    };
    // Each site judged at the coarser of how it is stored and how it was computed: factors of an
    // f32 model stored as f64 are still only f32-accurate, and under autocast only the matmuls
    // ran in bf16.
    let sites = match opts.precision {
        Some(p) => vec![p; meta.site_dtypes.len()],
        None => meta.site_precisions(),
    };
    let arithmetic = Arithmetic::per_site(&sites);
    let precision = sites.iter().copied().max().unwrap_or(meta.dtype);
    let sigma = match (opts.noise_multiplier, meta.noise_multiplier) {
        (Some(s), _) => s,
        (None, Some(s)) => NoiseMultiplier::new(s).map_err(|e| invalid("noise_multiplier", e))?,
        (None, None) => NoiseMultiplier::ONE,
    };
    let case = path
        .file_name()
        .map_or("trace".into(), |n| n.to_string_lossy().into_owned());
    let mut metrics = judge.evaluate_at(case.as_str(), &claim, c, sigma, &arithmetic)?;
    if let Some(step) = &meta.step {
        judge.judge_step(&mut metrics, step, c, sigma, &arithmetic)?;
    }
    let audit = ClipperAudit::new(
        meta.clipper.clone().unwrap_or_else(|| "claimed".into()),
        vec![metrics],
        Vec::new(),
        precision,
        &opts.accounting,
        sigma,
    )?;
    Ok(CheckedTrace {
        audit,
        tied,
        batch_divisor: meta.step.as_ref().and_then(|s| s.batch_divisor),
    })
}
