//! The batch-level reference: per-example norms, per-parameter norms and the split of every
//! shared parameter by use, from materialized f64 gradients.

use crate::batch::Batch;
use crate::decoder::{DecoderModel, Dims, HasDims, ParamSet};
use crate::error::Result;
use crate::gradient::{example_gradient_into, HeadPath, Reduction, SharedSplit};
use crate::model::Model;
use crate::trace::{SiteRecord, Trace, TraceBuilder};
use ndarray::ArrayViewD;
use serde_json::{json, Value};

#[derive(Clone, Debug)]
pub struct Options {
    pub reduction: Reduction,
    /// Record the per-site factors (the trace clippers consume).
    pub record_trace: bool,
    /// Keep every example's flattened gradient (B × parameters f64): for tests and callers that
    /// want the gradients themselves (the judge rebuilds what it needs from the trace).
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

/// One example's gradient by checkpoint name, a tied parameter once (both uses summed), with the
/// split of every shared parameter. The tensors borrow a buffer that the next example reuses.
pub struct ExampleView<'a> {
    pub loss: f64,
    /// (checkpoint name, per-example gradient) in the model's parameter order.
    pub tensors: Vec<(String, ArrayViewD<'a, f64>)>,
    pub shared: Vec<(String, SharedSplit)>,
    pub sites: Option<Vec<SiteRecord>>,
}

/// What `compute` needs of a model: every [`DecoderModel`] family and the [`Model`] enum.
pub trait ReferenceModel: HasDims {
    /// Runs the examples of a batch in order and hands each one's gradient to `visit(index,
    /// gradient)`. One gradient buffer serves the whole batch. A batch that does not fit the
    /// model is an error.
    fn for_each_example(
        &self,
        batch: &Batch,
        reduction: Reduction,
        record_sites: bool,
        visit: &mut dyn FnMut(usize, ExampleView<'_>),
    ) -> Result<()>;
}

fn dot(a: impl Iterator<Item = f64>) -> f64 {
    a.sum()
}

impl<M: DecoderModel> ReferenceModel for M {
    fn for_each_example(
        &self,
        batch: &Batch,
        reduction: Reduction,
        record_sites: bool,
        visit: &mut dyn FnMut(usize, ExampleView<'_>),
    ) -> Result<()> {
        let mut grad = self.zero_gradient();
        for i in 0..batch.len() {
            // A tied head's path is added into the embedding's buffer as it is formed, its split
            // taken from the few rows the input path touches: no second vocabulary-sized buffer.
            let (loss, sites, split) = example_gradient_into(
                self,
                batch,
                i,
                reduction,
                record_sites,
                HeadPath::Folded,
                &mut grad,
            )?;
            let shared = split
                .map(|s| vec![(self.param_name(self.embedding_local_name()), s)])
                .unwrap_or_default();
            visit(
                i,
                ExampleView {
                    loss,
                    tensors: named(self, &grad),
                    shared,
                    sites,
                },
            );
        }
        Ok(())
    }
}

fn named<'a, M: DecoderModel>(
    model: &M,
    grad: &'a M::Params,
) -> Vec<(String, ArrayViewD<'a, f64>)> {
    grad.tensors()
        .into_iter()
        .map(|(local, t)| (model.param_name(&local), t))
        .collect()
}

impl ReferenceModel for Model {
    fn for_each_example(
        &self,
        batch: &Batch,
        reduction: Reduction,
        record_sites: bool,
        visit: &mut dyn FnMut(usize, ExampleView<'_>),
    ) -> Result<()> {
        match self {
            Model::Gpt2(m) => m.for_each_example(batch, reduction, record_sites, visit),
            Model::Llama(m) => m.for_each_example(batch, reduction, record_sites, visit),
        }
    }
}

/// Runs the reference on every example of a batch. `progress(done, total)` is called after each.
pub fn compute<M: ReferenceModel + ?Sized>(
    model: &M,
    batch: &Batch,
    opts: &Options,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Reference> {
    let dims: Dims = model.dims();
    batch.validate(&dims, "batch")?;
    let mut examples = Vec::with_capacity(batch.len());
    let mut records = TraceBuilder::new(batch.len());
    let mut gradients = Vec::new();
    let mut layout = Vec::new();
    model.for_each_example(batch, opts.reduction, opts.record_trace, &mut |i, eg| {
        let mut params = Vec::with_capacity(eg.tensors.len());
        let mut total = 0.0;
        let mut flat = Vec::new();
        for (name, t) in eg.tensors {
            let sq = dot(t.iter().map(|v| v * v));
            total += sq;
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
            records.push(i, s);
        }
        examples.push(ExampleReport {
            loss: eg.loss,
            norm: total.sqrt(),
            params,
            shared: eg.shared,
        });
        progress(i + 1, batch.len());
    })?;
    Ok(Reference {
        reduction: opts.reduction,
        examples,
        trace: opts.record_trace.then(|| records.finish()),
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
}
