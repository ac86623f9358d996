//! The batch-level reference: per-example norms, per-parameter norms and the split of every
//! shared parameter by use, from materialized f64 gradients.

use crate::batch::Batch;
use crate::error::Result;
use crate::gradient::{example_gradient, Reduction};
use crate::model::{Gpt2, LM_HEAD};
use crate::trace::{SiteRecord, Trace};
use serde_json::{json, Value};

#[derive(Clone, Debug)]
pub struct Options {
    pub reduction: Reduction,
    /// Record the per-site factors (the trace clippers consume).
    pub record_trace: bool,
    /// Keep every example's flattened gradient (B × parameters f64) for clipped-sum checks.
    pub keep_gradients: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            reduction: Reduction::Mean,
            record_trace: false,
            keep_gradients: false,
        }
    }
}

/// ‖g_in‖², ‖g_out‖² and ⟨g_in, g_out⟩ of a parameter used as input embedding and as LM head.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SharedSplit {
    pub input_sq: f64,
    pub output_sq: f64,
    pub cross: f64,
}

#[derive(Clone, Debug)]
pub struct ExampleReport {
    pub loss: f64,
    pub norm: f64,
    /// (checkpoint name, gradient norm) in checkpoint order; a tied parameter appears once.
    pub params: Vec<(String, f64)>,
    pub shared: Vec<(String, SharedSplit)>,
}

#[derive(Clone, Debug)]
pub struct Reference {
    pub reduction: Reduction,
    pub examples: Vec<ExampleReport>,
    pub trace: Option<Trace>,
    /// (name, shape) of each parameter, in the order of the flattened gradients.
    pub layout: Vec<(String, Vec<usize>)>,
    pub gradients: Option<Vec<Vec<f64>>>,
}

fn dot(a: impl Iterator<Item = f64>) -> f64 {
    a.sum()
}

/// Runs the reference on every example of a batch. `progress(done, total)` is called after each.
pub fn compute(
    model: &Gpt2,
    batch: &Batch,
    opts: &Options,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Reference> {
    batch.validate(&model.config, "batch")?;
    let tied = model.config.tie_word_embeddings;
    let mut examples = Vec::with_capacity(batch.len());
    let mut records: Vec<Vec<SiteRecord>> = Vec::new();
    let mut gradients = Vec::new();
    let mut layout = Vec::new();
    for i in 0..batch.len() {
        let eg = example_gradient(model, batch, i, opts.reduction, opts.record_trace);
        let mut grad = eg.grad;
        let head = grad
            .lm_head
            .take()
            .expect("head gradient is always produced");
        let mut shared = Vec::new();
        if tied {
            let input_sq = dot(grad.wte.iter().map(|v| v * v));
            let output_sq = dot(head.iter().map(|v| v * v));
            let cross = dot(grad.wte.iter().zip(head.iter()).map(|(a, b)| a * b));
            shared.push((
                model.param_name("wte.weight"),
                SharedSplit {
                    input_sq,
                    output_sq,
                    cross,
                },
            ));
            grad.wte += &head;
        } else {
            grad.lm_head = Some(head);
        }
        let mut params = Vec::new();
        let mut total = 0.0;
        let mut flat = Vec::new();
        for (local, t) in grad.tensors() {
            let sq = dot(t.iter().map(|v| v * v));
            total += sq;
            let name = if local == LM_HEAD {
                local
            } else {
                model.param_name(&local)
            };
            if i == 0 {
                layout.push((name.clone(), t.shape().to_vec()));
            }
            if opts.keep_gradients {
                flat.extend(t.iter().copied());
            }
            params.push((name, sq.sqrt()));
        }
        if opts.keep_gradients {
            gradients.push(flat);
        }
        if let Some(s) = eg.sites {
            records.push(s);
        }
        examples.push(ExampleReport {
            loss: eg.loss,
            norm: total.sqrt(),
            params,
            shared,
        });
        progress(i + 1, batch.len());
    }
    Ok(Reference {
        reduction: opts.reduction,
        examples,
        trace: opts.record_trace.then(|| Trace::from_examples(&records)),
        layout,
        gradients: opts.keep_gradients.then_some(gradients),
    })
}

impl Reference {
    /// The JSON document `ghost-oracle reference --json` writes.
    pub fn to_json(&self) -> Value {
        let examples: Vec<Value> = self
            .examples
            .iter()
            .map(|e| {
                let params: serde_json::Map<String, Value> =
                    e.params.iter().map(|(n, v)| (n.clone(), json!(v))).collect();
                let shared: serde_json::Map<String, Value> = e
                    .shared
                    .iter()
                    .map(|(n, s)| (n.clone(), json!({"input_sq": s.input_sq, "output_sq": s.output_sq, "cross": s.cross})))
                    .collect();
                json!({"loss": e.loss, "norm": e.norm, "params": params, "shared": shared})
            })
            .collect();
        json!({"reduction": self.reduction.name(), "examples": examples})
    }

    /// ⟨g_i, g_j⟩ for every pair of examples (needs `keep_gradients`).
    pub fn gradient_gram(&self) -> Option<Vec<Vec<f64>>> {
        let g = self.gradients.as_ref()?;
        Some(
            g.iter()
                .map(|a| {
                    g.iter()
                        .map(|b| a.iter().zip(b).map(|(x, y)| x * y).sum())
                        .collect()
                })
                .collect(),
        )
    }
}
