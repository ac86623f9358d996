//! The batch-level reference: per-example norms, per-parameter norms and the split of every
//! shared parameter by use, from materialized f64 gradients.

use crate::batch::Batch;
use crate::decoder::{DecoderModel, Dims, HasDims, ParamSet};
use crate::error::Result;
use crate::families::Model;
use crate::gradient::{
    example_gradient_into, examples_together, group_norms, square, HeadPath, Reduction,
    SharedSplit, Workspace,
};
use crate::trace::{SiteRecord, Trace, TraceBuilder};
use serde_json::{json, Value};

/// What a reference run computes besides the norms.
#[derive(Clone, Debug)]
pub struct Options {
    /// How each example's loss is reduced over its targets.
    pub reduction: Reduction,
    /// Record the per-site factors (the trace clippers consume).
    pub record_trace: bool,
    /// Keep every example's flattened gradient (B × parameters f64): for tests and callers that
    /// want the gradients themselves (the judge rebuilds what it needs from the trace).
    pub keep_gradients: bool,
    /// Examples run through each block together (sharing one widening of a stored block's
    /// weights); `None` picks by memory ([`examples_together`]). Results are the same bits
    /// either way.
    pub together: Option<usize>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            reduction: Reduction::Mean,
            record_trace: false,
            keep_gradients: false,
            together: None,
        }
    }
}

/// One example's results.
#[derive(Clone, Debug)]
pub struct ExampleReport {
    /// The example's loss under the reduction.
    pub loss: f64,
    /// Norm of the example's whole gradient.
    pub norm: f64,
    /// (checkpoint name, gradient norm) in checkpoint order; a tied parameter appears once.
    pub params: Vec<(String, f64)>,
    /// (checkpoint name, split by use) of every shared (tied) parameter.
    pub shared: Vec<(String, SharedSplit)>,
}

/// A batch's reference results.
#[derive(Clone, Debug)]
pub struct Reference {
    /// The reduction the losses and gradients were taken under.
    pub reduction: Reduction,
    /// One report per example, in batch order.
    pub examples: Vec<ExampleReport>,
    /// The per-site factors, when [`Options::record_trace`] asked for them.
    pub trace: Option<Trace>,
    /// (name, shape) of each parameter, in the order of the flattened gradients.
    pub layout: Vec<(String, Vec<usize>)>,
    /// Each example's flattened gradient, in `layout` order, when [`Options::keep_gradients`].
    pub gradients: Option<Vec<Vec<f64>>>,
}

/// Where a reference run is: examples finished, and within the current group of examples (run
/// through the blocks together) the passes done (every block forward, the heads, every block
/// backward: `2 · layers + 1`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// Examples finished.
    pub examples_done: usize,
    /// Examples in the batch.
    pub examples: usize,
    /// Passes done within the current example.
    pub pass: usize,
    /// Passes per example.
    pub passes: usize,
    /// Examples in the current group: each of its passes is that many examples' pass.
    pub group: usize,
}

impl Progress {
    /// The start of a run of `batch` through `model`: every example is a forward pass per block,
    /// the head, and a backward pass per block.
    pub fn start<M: HasDims + ?Sized>(model: &M, batch: &Batch) -> Self {
        Progress {
            examples_done: 0,
            examples: batch.len(),
            pass: 0,
            passes: 2 * model.dims().layers + 1,
            group: 1,
        }
    }

    /// Passes done over the whole batch, and their total: a measure in which every step is
    /// alike, so the mean so far predicts the rest.
    pub fn steps(&self) -> (usize, usize) {
        (
            self.examples_done * self.passes + self.pass * self.group,
            self.examples * self.passes,
        )
    }

    /// The pass just finished: `example 2/4, block 7/16 backward` (`examples 1–4/8, …` for a
    /// group), or `2/4 examples` at a group's end.
    pub fn describe(&self) -> String {
        let layers = (self.passes - 1) / 2;
        if self.pass == 0 {
            return format!("{}/{} examples", self.examples_done, self.examples);
        }
        let example = match self.group {
            0 | 1 => format!("example {}/{}", self.examples_done + 1, self.examples),
            g => format!(
                "examples {}–{}/{}",
                self.examples_done + 1,
                self.examples_done + g,
                self.examples
            ),
        };
        let k = self.pass;
        let pass = if k <= layers {
            format!("block {k}/{layers} forward")
        } else if k == layers + 1 && self.group > 1 {
            "heads".to_string()
        } else if k == layers + 1 {
            "head".to_string()
        } else {
            format!("block {}/{layers} backward", 2 * layers + 2 - k)
        };
        format!("{example}, {pass}")
    }
}

/// One example's squared norms by checkpoint name (a tied parameter once, both uses summed),
/// with the split of every shared parameter.
pub struct ExampleView {
    pub loss: f64,
    /// (checkpoint name, squared norm) in the model's parameter order.
    pub squares: Vec<(String, f64)>,
    pub shared: Vec<(String, SharedSplit)>,
    pub sites: Option<Vec<SiteRecord>>,
    /// The flattened gradient, in `squares` order, when asked for.
    pub gradient: Option<Vec<f64>>,
}

/// What `compute` needs of a model: every [`DecoderModel`] family and the [`Model`] enum.
pub trait ReferenceModel: HasDims {
    /// (checkpoint name, shape) of every parameter, in the order of the reference's norms.
    fn layout(&self) -> Vec<(String, Vec<usize>)>;

    /// Runs the examples of a batch in order and hands each one's norms to `visit(index,
    /// view)`; `progress` hears of every pass. Without [`Options::keep_gradients`] nothing
    /// model-sized is allocated (the norms are streamed block by block, a group of examples at a
    /// time); with it, one gradient buffer serves the whole batch, an example at a time. A batch
    /// that does not fit the model is an error.
    fn for_each_example(
        &self,
        batch: &Batch,
        opts: &Options,
        progress: &mut dyn FnMut(Progress),
        visit: &mut dyn FnMut(usize, ExampleView),
    ) -> Result<()>;
}

impl<M: DecoderModel> ReferenceModel for M {
    fn layout(&self) -> Vec<(String, Vec<usize>)> {
        DecoderModel::layout(self)
    }

    fn for_each_example(
        &self,
        batch: &Batch,
        opts: &Options,
        progress: &mut dyn FnMut(Progress),
        visit: &mut dyn FnMut(usize, ExampleView),
    ) -> Result<()> {
        let (reduction, record_sites) = (opts.reduction, opts.record_trace);
        let mut at = Progress::start(self, batch);
        let name = self.param_name(self.embedding_local_name());
        let shared_of =
            |split: Option<SharedSplit>| split.map(|s| vec![(name.clone(), s)]).unwrap_or_default();
        if opts.keep_gradients {
            let mut grad = self.zero_gradient();
            for i in 0..batch.len() {
                // A tied head's path is added into the embedding's buffer as it is formed, its
                // split taken from the few rows the input path touches.
                let (loss, sites, split) = example_gradient_into(
                    self,
                    batch,
                    i,
                    reduction,
                    record_sites,
                    HeadPath::Folded,
                    &mut grad,
                )?;
                let mut squares = Vec::new();
                let mut flat = Vec::new();
                for (local, t) in grad.tensors() {
                    squares.push((self.param_name(&local), square(t.view())));
                    flat.extend(t.iter().copied());
                }
                at.examples_done = i + 1;
                progress(at);
                visit(
                    i,
                    ExampleView {
                        loss,
                        squares,
                        shared: shared_of(split),
                        sites,
                        gradient: Some(flat),
                    },
                );
            }
            return Ok(());
        }
        let together = opts
            .together
            .unwrap_or_else(|| examples_together(self, batch))
            .max(1);
        let mut workspace = Workspace::default();
        for start in (0..batch.len()).step_by(together) {
            let group = start..(start + together).min(batch.len());
            at.pass = 0;
            at.group = group.len();
            let norms = group_norms(
                self,
                batch,
                group.clone(),
                reduction,
                record_sites,
                &mut workspace,
                &mut || {
                    at.pass += 1;
                    if at.pass < at.passes {
                        progress(at);
                    }
                },
            )?;
            at.examples_done = group.end;
            at.pass = 0;
            at.group = 1;
            progress(at);
            for (i, norms) in group.clone().zip(norms) {
                visit(
                    i,
                    ExampleView {
                        loss: norms.loss,
                        squares: norms.squares,
                        shared: shared_of(norms.split),
                        sites: norms.sites,
                        gradient: None,
                    },
                );
            }
        }
        Ok(())
    }
}

impl ReferenceModel for Model {
    fn layout(&self) -> Vec<(String, Vec<usize>)> {
        Model::layout(self)
    }

    fn for_each_example(
        &self,
        batch: &Batch,
        opts: &Options,
        progress: &mut dyn FnMut(Progress),
        visit: &mut dyn FnMut(usize, ExampleView),
    ) -> Result<()> {
        match self {
            Model::Gpt2(m) => m.for_each_example(batch, opts, progress, visit),
            Model::Llama(m) => m.for_each_example(batch, opts, progress, visit),
        }
    }
}

/// Runs the reference on every example of a batch; `progress` hears of every block pass.
pub fn compute<M: ReferenceModel + ?Sized>(
    model: &M,
    batch: &Batch,
    opts: &Options,
    progress: &mut dyn FnMut(Progress),
) -> Result<Reference> {
    let dims: Dims = model.dims();
    batch.validate(&dims, "batch")?;
    let mut examples = Vec::with_capacity(batch.len());
    let mut records = TraceBuilder::new(batch.len());
    let mut gradients = Vec::new();
    model.for_each_example(batch, opts, progress, &mut |i, eg| {
        let total: f64 = eg.squares.iter().map(|(_, sq)| sq).sum();
        if let Some(flat) = eg.gradient {
            gradients.push(flat);
        }
        if let Some(s) = eg.sites {
            records.push(i, s);
        }
        examples.push(ExampleReport {
            loss: eg.loss,
            norm: total.sqrt(),
            params: eg
                .squares
                .into_iter()
                .map(|(name, sq)| (name, sq.sqrt()))
                .collect(),
            shared: eg.shared,
        });
    })?;
    Ok(Reference {
        reduction: opts.reduction,
        examples,
        trace: opts.record_trace.then(|| records.finish()),
        layout: model.layout(),
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
