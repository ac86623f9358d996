//! The audit harness: cases (built-in or a checkpoint), the reference's truth for each, every
//! clipper run on the same trace, and the judge's verdict on each.

mod check;
mod kill_matrix;

pub use check::{check_trace, CheckOptions, CheckedTrace};
pub use kill_matrix::{kill_matrix, KillMatrix, Row};

use crate::clippers::{Clipped, Clipper, NoiseSpec};
use crate::error::{Error, Result};
use crate::judge::{
    Arithmetic, CaseLabel, CaseMetrics, Claim, ClippingRule, Judge, PrivacyReport, Verdict,
};
use crate::options::{Accounting, ClipNorm, NoiseMultiplier};
use crate::trace::{candle_dtype, Precision, Trace};
use candle_core::{DType, Device};
use ghost_oracle_reference::{
    self as reference, Batch, Gpt2, Gpt2Config, Llama, LlamaConfig, LlamaFlavor, Model, Reduction,
    SplitMix64, IGNORE,
};
use ghost_oracle_reference::{Clipping, Floats, StepClaim};
use ndarray::Array2;
use serde::Serialize;
use std::borrow::Borrow;

/// A model and a batch to audit on, with the clipping norms to try (as multiples of the median
/// true norm, unless the user fixes C).
#[derive(Clone, Debug)]
pub struct Case {
    pub name: String,
    pub model: Model,
    pub batch: Batch,
    pub c_multipliers: Vec<f64>,
}

impl Case {
    /// A checkpoint directory (config.json + model.safetensors, any family the reference
    /// reads) and a batch file, checked against each other, audited at one clipping norm.
    pub fn load(model: &std::path::Path, batch: &std::path::Path) -> Result<Self> {
        let m: Model = reference::load(model)?;
        let b = Batch::load(batch)?;
        b.validate(&m, &batch.display().to_string())?;
        Ok(Case {
            name: model
                .file_name()
                .map_or("checkpoint".into(), |n| n.to_string_lossy().into_owned()),
            model: m,
            batch: b,
            c_multipliers: vec![1.0],
        })
    }
}

/// The decoder-only family of a built-in case.
#[derive(Clone, Copy)]
enum Family {
    Gpt2,
    /// A Llama-shaped family (Llama, Qwen2, Qwen3, Gemma 3, ...) with this many key/value heads
    /// (grouped-query attention when fewer than the query heads).
    Llama(LlamaFlavor, usize),
}

struct CaseSpec {
    name: &'static str,
    family: Family,
    vocab: usize,
    d: usize,
    layers: usize,
    heads: usize,
    tied: bool,
    batch: usize,
    seq: usize,
    /// Ids drawn from 0..id_range (small: many repeated tokens).
    id_range: usize,
    ignore: f64,
    init_std: f64,
}

const SUITE: &[CaseSpec] = &[
    CaseSpec {
        family: Family::Gpt2,
        name: "tied-T2",
        vocab: 29,
        d: 16,
        layers: 1,
        heads: 2,
        tied: true,
        batch: 6,
        seq: 2,
        id_range: 29,
        ignore: 0.0,
        init_std: 0.5,
    },
    CaseSpec {
        family: Family::Gpt2,
        name: "tied-T16-repeats",
        vocab: 29,
        d: 16,
        layers: 2,
        heads: 4,
        tied: true,
        batch: 6,
        seq: 16,
        id_range: 5,
        ignore: 0.0,
        init_std: 0.5,
    },
    CaseSpec {
        family: Family::Gpt2,
        name: "tied-T24-ignored",
        vocab: 31,
        d: 16,
        layers: 2,
        heads: 2,
        tied: true,
        batch: 6,
        seq: 24,
        id_range: 12,
        ignore: 0.3,
        init_std: 0.5,
    },
    CaseSpec {
        family: Family::Gpt2,
        name: "tied-T64",
        vocab: 61,
        d: 24,
        layers: 2,
        heads: 3,
        tied: true,
        batch: 4,
        seq: 64,
        id_range: 61,
        ignore: 0.0,
        init_std: 0.4,
    },
    CaseSpec {
        family: Family::Gpt2,
        name: "tied-T32-vocab257",
        vocab: 257,
        d: 32,
        layers: 1,
        heads: 4,
        tied: true,
        batch: 4,
        seq: 32,
        id_range: 40,
        ignore: 0.0,
        init_std: 0.4,
    },
    CaseSpec {
        family: Family::Gpt2,
        name: "tied-T8-strong-cross",
        vocab: 17,
        d: 8,
        layers: 1,
        heads: 2,
        tied: true,
        batch: 8,
        seq: 8,
        id_range: 6,
        ignore: 0.0,
        init_std: 1.0,
    },
    CaseSpec {
        family: Family::Gpt2,
        name: "untied-T16",
        vocab: 29,
        d: 16,
        layers: 2,
        heads: 4,
        tied: false,
        batch: 6,
        seq: 16,
        id_range: 8,
        ignore: 0.0,
        init_std: 0.5,
    },
    CaseSpec {
        family: Family::Gpt2,
        name: "untied-T64",
        vocab: 61,
        d: 24,
        layers: 2,
        heads: 3,
        tied: false,
        batch: 4,
        seq: 64,
        id_range: 61,
        ignore: 0.1,
        init_std: 0.4,
    },
    CaseSpec {
        family: Family::Llama(LlamaFlavor::Llama, 2),
        name: "llama-tied-gqa-T24",
        vocab: 37,
        d: 16,
        layers: 2,
        heads: 4,
        tied: true,
        batch: 4,
        seq: 24,
        id_range: 12,
        ignore: 0.1,
        init_std: 0.5,
    },
    CaseSpec {
        family: Family::Llama(LlamaFlavor::Qwen2, 2),
        name: "qwen2-tied-biases-T16",
        vocab: 31,
        d: 16,
        layers: 1,
        heads: 4,
        tied: true,
        batch: 4,
        seq: 16,
        id_range: 10,
        ignore: 0.0,
        init_std: 0.6,
    },
    CaseSpec {
        family: Family::Llama(LlamaFlavor::Qwen3, 2),
        name: "qwen3-tied-qk-T16",
        vocab: 31,
        d: 16,
        layers: 1,
        heads: 4,
        tied: true,
        batch: 4,
        seq: 16,
        id_range: 10,
        ignore: 0.0,
        init_std: 0.6,
    },
    CaseSpec {
        family: Family::Llama(LlamaFlavor::Gemma3Text, 2),
        name: "gemma3-tied-swa-T24",
        vocab: 37,
        d: 16,
        layers: 2,
        heads: 4,
        tied: true,
        batch: 4,
        seq: 24,
        id_range: 12,
        ignore: 0.1,
        init_std: 0.2,
    },
];

/// C as multiples of the median true norm: most examples clipped, about half, almost none.
pub const SUITE_C_MULTIPLIERS: [f64; 3] = [0.5, 1.0, 2.0];

/// The built-in suite: seeded GPT-2, Llama, Qwen2, Qwen3 and Gemma 3 models and batches, no files. Sequence length 1 is
/// absent because a causal LM has no target there (the property tests cover T = 1 sites).
pub fn builtin_suite() -> Vec<Case> {
    SUITE
        .iter()
        .enumerate()
        .map(|(k, s)| {
            let seed = 1000 + k as u64;
            let model: Model = match s.family {
                Family::Gpt2 => {
                    let mut cfg = Gpt2Config::tiny(s.vocab, s.seq.max(8), s.d, s.layers, s.heads);
                    cfg.tie_word_embeddings = s.tied;
                    Gpt2::random(cfg, seed, s.init_std).into()
                }
                Family::Llama(flavor, kv_heads) => {
                    let mut cfg =
                        LlamaConfig::tiny(flavor, s.vocab, s.d, s.layers, s.heads, kv_heads);
                    cfg.tie_word_embeddings = s.tied;
                    if flavor.is_gemma() {
                        // A window shorter than the sequence and a final soft-cap, both active.
                        cfg.sliding_window = Some(s.seq / 3);
                        cfg.final_logit_softcapping = Some(10.0);
                    }
                    if flavor.head_norms() {
                        // `attention_bias` on, so that a wrong bias norm has a bias to get wrong.
                        cfg.attention_bias = true;
                    }
                    Llama::random(cfg, seed, s.init_std).into()
                }
            };
            let mut rng = SplitMix64::new(seed ^ 0xBA7C);
            let ids = Array2::from_shape_fn((s.batch, s.seq), |_| rng.below(s.id_range) as i64);
            let mut labels = ids.clone();
            for i in 0..s.batch {
                for t in 2..s.seq {
                    if rng.uniform() < s.ignore {
                        labels[(i, t)] = IGNORE;
                    }
                }
            }
            Case {
                name: s.name.to_string(),
                model,
                batch: Batch::new(ids, Some(labels)).expect("a built-in batch is valid"),
                c_multipliers: SUITE_C_MULTIPLIERS.to_vec(),
            }
        })
        .collect()
}

/// How an audit runs: the DP-SGD settings it judges at, and where the clippers compute.
#[derive(Clone, Debug)]
pub struct AuditOptions {
    /// C; `None`: the median true norm of each case, times each of its `c_multipliers`.
    pub max_grad_norm: Option<ClipNorm>,
    pub noise_multiplier: NoiseMultiplier,
    /// The precision the clippers compute in (the reference is always f64).
    pub precision: Precision,
    pub device: Device,
    pub reduction: Reduction,
    /// The run each clipper's ε is stated for.
    pub accounting: Accounting,
    /// Also take and judge each clipper's DP-SGD step (its clipped sum, seeded noise and the
    /// division by the batch size). It holds the update beside the clipped sum.
    pub judge_step: bool,
    /// The seed of the step's noise.
    pub noise_seed: u64,
}

impl Default for AuditOptions {
    /// The built-in audit's: C from the median, σ = 1, f32 on the CPU, HF's mean loss, the
    /// typical fine-tuning run.
    fn default() -> Self {
        AuditOptions {
            max_grad_norm: None,
            noise_multiplier: NoiseMultiplier::ONE,
            precision: Precision::F32,
            device: Device::Cpu,
            reduction: Reduction::Mean,
            accounting: Accounting::typical(),
            judge_step: true,
            noise_seed: 0x5EED,
        }
    }
}

/// One clipper's results over every case, with the ε its run really has.
#[derive(Clone, Debug, Serialize)]
pub struct ClipperAudit {
    pub name: String,
    pub verdict: Verdict,
    pub worst_case: usize,
    pub cases: Vec<CaseMetrics>,
    pub warnings: Vec<String>,
    /// The precision the tolerance assumed.
    pub precision: Precision,
    /// Stated and actual ε of the run.
    pub privacy: PrivacyReport,
}

impl ClipperAudit {
    /// The verdict, the deciding case and the ε, from the cases.
    fn new(
        name: String,
        cases: Vec<CaseMetrics>,
        warnings: Vec<String>,
        precision: Precision,
        accounting: &Accounting,
        noise_multiplier: NoiseMultiplier,
    ) -> Result<Self> {
        let worst = worst_case(&cases);
        let verdict = cases.get(worst).map_or(Verdict::Pass, |c| c.verdict);
        // The run's ε is set by the worst overshoot in any case.
        let contribution = cases
            .iter()
            .map(|c| c.worst_contribution)
            .try_fold(1.0_f64, |acc, s| s.map(|s| acc.max(s)));
        // Below a privacy violation, any overshoot of C is within the rounding bound.
        let rounding_at = match verdict {
            Verdict::Pass | Verdict::UtilityDistortion | Verdict::CannotJudge => Some(precision),
            Verdict::PrivacyViolation | Verdict::InvalidNorm => None,
        };
        let privacy = PrivacyReport::new(
            accounting,
            noise_multiplier.get(),
            contribution,
            rounding_at,
        )?;
        Ok(ClipperAudit {
            name,
            verdict,
            worst_case: worst,
            cases,
            warnings,
            precision,
            privacy,
        })
    }
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

/// Tensors per parameter as the judge reads them: row-major values on the host, f64 kept f64 and
/// every other dtype as f32 (exact for bf16 and f16), so a 1 B-parameter f32 sum stays 4.9 GB;
/// each tensor is dropped as soon as it is copied.
pub fn values_of(tensors: Vec<(String, candle_core::Tensor)>) -> Result<Vec<(String, Floats)>> {
    tensors
        .into_iter()
        .map(|(p, t)| {
            let t = t.flatten_all()?;
            let values = match t.dtype() {
                DType::F64 => Floats::from(t.to_vec1::<f64>()?),
                _ => Floats::from(t.to_dtype(DType::F32)?.to_vec1::<f32>()?),
            };
            Ok((p, values))
        })
        .collect()
}

/// A clipper's output as the judge reads it: f64 values, no tensors. Each clipped-sum tensor
/// is dropped as soon as it is converted, so a large model's sum is never held twice.
pub fn claim_of(clipped: Clipped) -> Result<Claim> {
    let Clipped {
        report,
        coefficients,
        clipped_sum,
    } = clipped;
    let clipped_sum = values_of(clipped_sum)?;
    Ok(Claim {
        norms: report.norms,
        coefficients,
        clipped_sum: Some(clipped_sum),
        clipping: ClippingRule::default(),
    })
}

/// The judge of a case and its trace in the clippers' dtype and device.
pub struct PreparedCase {
    pub judge: Judge,
    pub trace: Trace,
    /// The clipping norms to evaluate at, each with its label.
    pub clip_norms: Vec<(CaseLabel, ClipNorm)>,
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
        keep_gradients: false,
    };
    let r = reference::compute(&case.model, &case.batch, &ropts, progress)
        .map_err(|e| Error::from(e).context(&case.name))?;
    let (trace, judge) = match opts.precision {
        // f32 and f64 clippers are judged against the model's own gradients; the bound covers
        // rounding the trace to f32.
        Precision::F64 | Precision::F32 => (
            Trace::from_reference(
                r.trace.as_ref().expect("trace recorded"),
                candle_dtype(opts.precision),
                &opts.device,
            )?,
            Judge::from_reference(r).map_err(|e| e.context(&case.name))?,
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
                Judge::from_trace(rounded).map_err(|e| e.context(&case.name))?,
            )
        }
    };
    let clip_norms = match opts.max_grad_norm {
        Some(c) => vec![(CaseLabel::from(case.name.as_str()), c)],
        None => {
            let med = median(&judge.truth.norms);
            let several = case.c_multipliers.len() > 1;
            case.c_multipliers
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
                .collect::<Result<Vec<_>>>()?
        }
    };
    Ok(PreparedCase {
        judge,
        trace,
        clip_norms,
    })
}

/// The divisor the audit's step states: a Poisson-sampled batch's expected size, which DP-SGD
/// divides by whatever size was drawn. The audit's batches are taken as draws one below their
/// expectation, as half of all draws are below it, so that a step dividing by the size it drew
/// differs from one dividing by the stated size.
pub fn expected_batch_size(drawn: usize) -> f64 {
    drawn as f64 + 1.0
}

/// Runs every clipper on every case. `progress(done, total, label)` after each step: a pass of
/// the reference through one block of one example, or a clipper's run on a case, which counts
/// as much as one example of the reference (on a checkpoint the two take about as long, and
/// alike steps let the mean so far predict the rest). Cases given by value are dropped one by
/// one as soon as their reference has run.
pub fn run<C: Borrow<Case>, I>(
    cases: I,
    clippers: &[Box<dyn Clipper>],
    opts: &AuditOptions,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<Vec<ClipperAudit>>
where
    I: IntoIterator<Item = C>,
    I::IntoIter: ExactSizeIterator,
{
    // Collected (moved, not copied) so that the steps of every case are known before the first.
    let cases: Vec<C> = cases.into_iter().collect();
    // Per clipper: its cases' metrics and its warnings.
    let mut out: Vec<(Vec<CaseMetrics>, Vec<String>)> = vec![Default::default(); clippers.len()];
    let steps_of = |case: &Case| {
        let start = reference::Progress::start(&case.model, &case.batch);
        let norms = match opts.max_grad_norm {
            Some(_) => 1,
            None => case.c_multipliers.len(),
        };
        let reference_steps = start.steps().1;
        (reference_steps, start.passes * norms)
    };
    let total: usize = cases
        .iter()
        .map(|c| {
            let (r, per_clipper) = steps_of(c.borrow());
            r + per_clipper * clippers.len()
        })
        .sum();
    let mut done = 0;
    for case in cases {
        let name = case.borrow().name.clone();
        let (reference_steps, per_clipper) = steps_of(case.borrow());
        let prepared = prepare(case, opts, &mut |p| {
            // The last pass of the reference starts the judge's work on its factors.
            let label = if p.examples_done == p.examples {
                format!("{name}: reference done, the judge's truth and tolerances")
            } else {
                format!("{name}: reference, {}", p.describe())
            };
            progress(done + p.steps().0, total, &label)
        })?;
        done += reference_steps;
        for ((metrics, warnings), clipper) in out.iter_mut().zip(clippers) {
            for (label, c) in &prepared.clip_norms {
                let label_err = |e: Error| {
                    e.context(format!(
                        "clipper {} on case {}",
                        clipper.name(),
                        label.label()
                    ))
                };
                // The clipper's own DP-SGD step when it is judged: its clipped sum, seeded noise
                // N(0, σ²C²) and the division by the stated divisor, judged as a library's step is.
                progress(
                    done,
                    total,
                    &format!("{name}: clipper {} at C = {:.3e}", clipper.name(), c.get()),
                );
                let divisor = expected_batch_size(prepared.trace.batch_size());
                let (clipped, update) = if opts.judge_step {
                    let noise = NoiseSpec {
                        std: opts.noise_multiplier.get() * c.get(),
                        divisor,
                        seed: opts.noise_seed ^ (metrics.len() as u64).wrapping_mul(0x9E37),
                    };
                    let s = clipper
                        .step(&prepared.trace, *c, &noise)
                        .map_err(label_err)?;
                    (s.clipped, Some(s.update))
                } else {
                    (clipper.clip(&prepared.trace, *c).map_err(label_err)?, None)
                };
                for w in &clipped.report.warnings {
                    if !warnings.contains(w) {
                        warnings.push(w.clone());
                    }
                }
                let mut claim = claim_of(clipped)?;
                // With the step judged, its check compares the clipped sum at the clipper's
                // coefficients too, from the same rebuilt gradients: the claim is evaluated
                // without it, and the sum moves to the step (at 1 B parameters it is 4.9 GB).
                let sum = if update.is_some() {
                    claim.clipped_sum.take()
                } else {
                    None
                };
                let mut m = prepared.judge.evaluate(
                    label.clone(),
                    &claim,
                    *c,
                    opts.noise_multiplier,
                    opts.precision,
                )?;
                if let Some(update) = update {
                    let step = StepClaim {
                        clipped_sum: sum,
                        update: Some(values_of(update)?),
                        batch_divisor: Some(divisor),
                        clip_stabilizer: 0.0,
                        clipping: Clipping::Flat,
                    };
                    let arithmetic =
                        Arithmetic::of(opts.precision, prepared.judge.tolerance.own.len());
                    prepared.judge.judge_step_with_sum(
                        &mut m,
                        &step,
                        *c,
                        opts.noise_multiplier,
                        &arithmetic,
                    )?;
                }
                metrics.push(m);
            }
            done += per_clipper;
            progress(
                done,
                total,
                &format!("{name}: clipper {} judged", clipper.name()),
            );
        }
    }
    out.into_iter()
        .zip(clippers)
        .map(|((metrics, warnings), clipper)| {
            ClipperAudit::new(
                clipper.name(),
                metrics,
                warnings,
                opts.precision,
                &opts.accounting,
                opts.noise_multiplier,
            )
        })
        .collect()
}

/// The case that decides a clipper's verdict: the most severe verdict, then the largest error.
pub fn worst_case(cases: &[CaseMetrics]) -> usize {
    let key = |c: &CaseMetrics| match c.verdict {
        Verdict::InvalidNorm => (c.verdict, c.invalid_examples.len() as f64),
        Verdict::PrivacyViolation => (c.verdict, c.max_sensitivity_ratio),
        Verdict::CannotJudge => (c.verdict, c.max_bound),
        Verdict::Pass | Verdict::UtilityDistortion => (c.verdict, c.max_err_units),
    };
    (0..cases.len())
        .max_by(|&a, &b| {
            let (ka, kb) = (key(&cases[a]), key(&cases[b]));
            ka.0.cmp(&kb.0).then(ka.1.total_cmp(&kb.1))
        })
        .unwrap_or(0)
}
