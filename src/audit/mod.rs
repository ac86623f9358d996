//! The audit harness: cases (built-in or a checkpoint), the reference's truth for each, every
//! clipper run on the same trace, and the judge's verdict on each.

mod check;

pub use check::check_trace;

use crate::clippers::{Clipped, Clipper};
use crate::error::{Error, Result};
use crate::judge::{Accounting, CaseMetrics, Claim, Judge, Precision, PrivacyReport, Verdict};
use crate::trace::Trace;
use candle_core::{DType, Device};
use ghost_oracle_reference::{
    self as reference, Batch, Gpt2, Gpt2Config, Llama, LlamaConfig, LlamaFlavor, Model, Reduction,
    SplitMix64, IGNORE,
};
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
        let m = Model::load(model)?;
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
    /// Llama or Qwen2 with this many key/value heads (grouped-query attention when fewer than
    /// the query heads).
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
];

/// C as multiples of the median true norm: most examples clipped, about half, almost none.
pub const SUITE_C_MULTIPLIERS: [f64; 3] = [0.5, 1.0, 2.0];

/// The built-in suite: seeded GPT-2, Llama and Qwen2 models and batches, no files. Sequence length 1 is
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
                batch: Batch::new(ids, Some(labels)),
                c_multipliers: SUITE_C_MULTIPLIERS.to_vec(),
            }
        })
        .collect()
}

#[derive(Clone, Debug)]
pub struct AuditOptions {
    pub max_grad_norm: Option<f64>,
    pub noise_multiplier: f64,
    pub dtype: DType,
    pub device: Device,
    pub reduction: Reduction,
}

/// One clipper's results over every case.
#[derive(Clone, Debug, Serialize)]
pub struct ClipperAudit {
    pub name: String,
    pub verdict: Verdict,
    pub worst_case: usize,
    pub cases: Vec<CaseMetrics>,
    pub warnings: Vec<String>,
    /// Stated and actual ε of the run, when accounted ([`account`]).
    pub privacy: Option<PrivacyReport>,
}

/// States each clipper's ε: stated at σ, actual at σ over its worst overshoot in any case.
pub fn account(
    audits: &mut [ClipperAudit],
    setting: &Accounting,
    noise_multiplier: f64,
) -> Result<()> {
    for a in audits {
        let worst = a
            .cases
            .iter()
            .map(|c| c.worst_contribution)
            .try_fold(1.0_f64, |acc, s| s.map(|s| acc.max(s)));
        a.privacy = Some(PrivacyReport::new(setting, noise_multiplier, worst)?);
    }
    Ok(())
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

/// The precision a candle dtype computes in.
pub fn precision_of(dtype: DType) -> Precision {
    match dtype {
        DType::F64 => Precision::F64,
        DType::F16 => Precision::F16,
        DType::BF16 => Precision::BF16,
        _ => Precision::F32,
    }
}

/// A clipper's output as the judge reads it: f64 values, no tensors. Each clipped-sum tensor
/// is dropped as soon as it is converted, so a large model's sum is never held twice.
pub fn claim_of(clipped: Clipped) -> Result<Claim> {
    let Clipped {
        report,
        coefficients,
        clipped_sum,
    } = clipped;
    let clipped_sum = clipped_sum
        .into_iter()
        .map(|(p, t)| Ok((p, t.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?)))
        .collect::<Result<Vec<_>>>()?;
    Ok(Claim {
        norms: report.norms,
        coefficients,
        clipped_sum: Some(clipped_sum),
    })
}

/// The judge of a case and its trace in the clippers' dtype and device.
pub struct PreparedCase {
    pub judge: Judge,
    pub trace: Trace,
    /// (label, C) pairs to evaluate.
    pub clip_norms: Vec<(String, f64)>,
}

/// The reference on a case, its judge and the clippers' trace. A case passed by value is
/// dropped here, its f64 weights with it, before any clipper runs.
pub fn prepare(case: impl Borrow<Case>, opts: &AuditOptions) -> Result<PreparedCase> {
    let case = case.borrow();
    let ropts = reference::Options {
        reduction: opts.reduction,
        record_trace: true,
        keep_gradients: false,
    };
    let r = reference::compute(&case.model, &case.batch, &ropts, &mut |_, _| {})
        .map_err(|e| Error::from(e).context(&case.name))?;
    let trace = Trace::from_reference(
        r.trace.as_ref().expect("trace recorded"),
        opts.dtype,
        &opts.device,
    )?;
    let judge = Judge::from_reference(r).map_err(|e| e.context(&case.name))?;
    let clip_norms = match opts.max_grad_norm {
        Some(c) => vec![(case.name.clone(), c)],
        None => {
            let med = median(&judge.truth.norms);
            if case.c_multipliers.len() == 1 {
                vec![(case.name.clone(), med * case.c_multipliers[0])]
            } else {
                case.c_multipliers
                    .iter()
                    .map(|m| (format!("{}@C={m}xmedian", case.name), med * m))
                    .collect()
            }
        }
    };
    Ok(PreparedCase {
        judge,
        trace,
        clip_norms,
    })
}

/// Runs every clipper on every case. `progress(done, total, label)` after each step. Cases
/// given by value are dropped one by one as soon as their reference has run.
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
    let cases = cases.into_iter();
    let precision = precision_of(opts.dtype);
    let mut out: Vec<ClipperAudit> = clippers
        .iter()
        .map(|c| ClipperAudit {
            name: c.name(),
            verdict: Verdict::Pass,
            worst_case: 0,
            cases: Vec::new(),
            warnings: Vec::new(),
            privacy: None,
        })
        .collect();
    let total = cases.len() * clippers.len();
    let mut done = 0;
    for case in cases {
        let name = case.borrow().name.clone();
        let prepared = prepare(case, opts)?;
        for (audit, clipper) in out.iter_mut().zip(clippers) {
            for (label, c) in &prepared.clip_norms {
                let clipped = clipper.clip(&prepared.trace, *c).map_err(|e| {
                    e.context(format!("clipper {} on case {label}", clipper.name()))
                })?;
                for w in &clipped.report.warnings {
                    if !audit.warnings.contains(w) {
                        audit.warnings.push(w.clone());
                    }
                }
                audit.cases.push(prepared.judge.evaluate(
                    label,
                    &claim_of(clipped)?,
                    *c,
                    opts.noise_multiplier,
                    precision,
                )?);
            }
            done += 1;
            progress(done, total, &name);
        }
    }
    for a in &mut out {
        a.worst_case = worst_case(&a.cases);
        a.verdict = a
            .cases
            .get(a.worst_case)
            .map_or(Verdict::Pass, |c| c.verdict);
    }
    Ok(out)
}

/// The case that decides a clipper's verdict: the most severe verdict, then the largest error.
pub fn worst_case(cases: &[CaseMetrics]) -> usize {
    let key = |c: &CaseMetrics| match c.verdict {
        Verdict::InvalidNorm => (c.verdict, c.invalid_examples.len() as f64),
        Verdict::PrivacyViolation => (c.verdict, c.max_sensitivity_ratio),
        Verdict::Pass | Verdict::UtilityDistortion => (c.verdict, c.max_err_units),
    };
    (0..cases.len())
        .max_by(|&a, &b| {
            let (ka, kb) = (key(&cases[a]), key(&cases[b]));
            ka.0.cmp(&kb.0).then(ka.1.total_cmp(&kb.1))
        })
        .unwrap_or(0)
}
