//! Per-example forward and explicit backward of a decoder-only model in f64, written once for
//! every family: embedding, blocks, final norm, LM head and causal-LM loss. Every intermediate
//! is kept and every parameter gradient materialized, so that the result can be checked line by
//! line against the definition and against finite differences.

use crate::batch::Batch;
use crate::decoder::{BlockParams, DecoderModel, ParamSet, LM_HEAD};
use crate::error::Result;
use crate::layers::NormCache;
use crate::matmul::{product, product_into, Accumulate};
use crate::site::SiteKind;
use crate::sweep;
use crate::trace::SiteRecord;
use crate::trace_file::MemoryBudget;
use ndarray::{s, Array1, Array2, ArrayView1, ArrayView2, ArrayViewD, ArrayViewMutD};
use std::collections::BTreeMap;
use std::ops::Range;

/// How an example's token losses combine into its loss.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    /// Mean over the example's kept targets (HF's default).
    Mean,
    /// Sum over the example's kept targets.
    Sum,
}

impl Reduction {
    /// `mean` or `sum`, as the command line and the report name it.
    pub fn name(self) -> &'static str {
        match self {
            Reduction::Mean => "mean",
            Reduction::Sum => "sum",
        }
    }
}

/// ‖g_in‖², ‖g_out‖² and ⟨g_in, g_out⟩ of a parameter used as input embedding and as LM head.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SharedSplit {
    /// ‖g_in‖², the input-embedding path.
    pub input_sq: f64,
    /// ‖g_out‖², the head path.
    pub output_sq: f64,
    /// ⟨g_in, g_out⟩.
    pub cross: f64,
}

/// Where the LM head's path goes in a tied model's gradient buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadPath {
    /// Into `lm_head`, apart from the embedding's input path (both paths can be checked on
    /// their own).
    Separate,
    /// Into the token embedding itself, with the split of the two paths returned: one
    /// vocabulary-sized buffer instead of two (1.1 GB at the Qwen2.5-0.5B shape). Untied models
    /// have their own head either way.
    Folded,
}

/// A family's block type.
pub type BlockOf<M> = <<M as DecoderModel>::Params as ParamSet>::Block;

/// The buffers the reference reuses from block to block and example to example: one block's
/// weights widened to f64 (for stored models) and one block's gradient (for the streamed path).
pub struct Workspace<B> {
    weights: Option<B>,
    gradient: Option<B>,
}

impl<B> Default for Workspace<B> {
    fn default() -> Self {
        Workspace {
            weights: None,
            gradient: None,
        }
    }
}

struct Forward<C> {
    blocks: Vec<C>,
    norm: NormCache,
    /// Final hidden states after the norm (the head's input).
    af: Array2<f64>,
    /// What the loss reads: the head's output, soft-capped where the family caps it.
    logits: Array2<f64>,
}

/// One example's materialized gradient. `P` is the family's parameter set.
pub struct ExampleGradient<P> {
    pub loss: f64,
    /// Materialized gradient; the token embedding holds the input path and `lm_head` the head
    /// path, also for a tied model.
    pub grad: P,
    /// The per-site factors of this example, in site order, when asked for.
    pub sites: Option<Vec<SiteRecord>>,
}

/// One example's squared gradient norms, taken block by block as the gradient is produced.
pub struct ExampleNorms {
    /// The example's loss under the reduction.
    pub loss: f64,
    /// (checkpoint name, squared norm) in checkpoint order; a tied table once, both uses summed.
    pub squares: Vec<(String, f64)>,
    /// The split of a tied table.
    pub split: Option<SharedSplit>,
    /// The example's sites (per-use inputs and output gradients), when they were asked for.
    pub sites: Option<Vec<SiteRecord>>,
}

fn forward<M: DecoderModel + ?Sized>(
    model: &M,
    ids: &[usize],
    weights: &mut Option<BlockOf<M>>,
    tick: &mut dyn FnMut(),
) -> Forward<M::BlockCache> {
    forward_group(model, &[ids.to_vec()], weights, tick)
        .pop()
        .expect("one example in, one forward pass out")
}

/// The forward passes of several examples, through each block together: a block's weights are
/// taken (widened, when stored) once for all of them, then each example's pass runs on its own,
/// exactly as it would alone. `tick` is called after every block.
fn forward_group<M: DecoderModel + ?Sized>(
    model: &M,
    ids: &[Vec<usize>],
    weights: &mut Option<BlockOf<M>>,
    tick: &mut dyn FnMut(),
) -> Vec<Forward<M::BlockCache>> {
    let layers = model.dims().layers;
    let mut hidden: Vec<Array2<f64>> = ids.iter().map(|ids| model.embed(ids)).collect();
    let mut caches: Vec<Vec<M::BlockCache>> =
        ids.iter().map(|_| Vec::with_capacity(layers)).collect();
    for l in 0..layers {
        let w = model.block_weights(l, weights);
        for (h, cache) in hidden.iter_mut().zip(&mut caches) {
            let (c, out) = model.block_forward(l, w, std::mem::take(h));
            cache.push(c);
            *h = out;
        }
        tick();
    }
    hidden
        .into_iter()
        .zip(caches)
        .map(|(h, blocks)| {
            let (norm, af) = model.final_norm(h.view());
            let mut logits = product(af.view(), model.head().t());
            if let Some(cap) = model.final_logit_softcap() {
                logits.mapv_inplace(|z| cap * (z / cap).tanh());
            }
            Forward {
                blocks,
                norm,
                af,
                logits,
            }
        })
        .collect()
}

/// One example of a group from its head to the end of the blocks' backward.
struct InFlight<P, C> {
    /// The caches of the blocks not yet run backward, the last on top.
    blocks: Vec<C>,
    loss: f64,
    af: Array2<f64>,
    dlogits: Array2<f64>,
    output_sq: f64,
    /// The gradient of the current block's output.
    dh: Array2<f64>,
    stem: P,
    sites: SiteParts,
    /// Each block's squared norms, last block first.
    block_squares: Vec<Vec<(String, f64)>>,
}

fn log_sum_exp(row: ArrayView1<f64>) -> f64 {
    let m = row.fold(f64::NEG_INFINITY, |a, &b| a.max(b));
    m + row.iter().map(|&v| (v - m).exp()).sum::<f64>().ln()
}

fn loss_weight(targets: &[(usize, usize)], reduction: Reduction) -> f64 {
    match reduction {
        Reduction::Mean => 1.0 / targets.len() as f64,
        Reduction::Sum => 1.0,
    }
}

/// The loss and the gradient of the head's (uncapped) output, formed in place of the logits:
/// softmax·w minus w at the target on rows with a target, zero elsewhere.
fn loss_and_dlogits<M: DecoderModel + ?Sized>(
    model: &M,
    logits: Array2<f64>,
    targets: &[(usize, usize)],
    reduction: Reduction,
) -> (f64, Array2<f64>) {
    let w = loss_weight(targets, reduction);
    let capped = match model.final_logit_softcap() {
        Some(_) => logits.clone(),
        None => Array2::zeros((0, 0)),
    };
    let mut loss = 0.0;
    let mut target_of = vec![None; logits.nrows()];
    for &(t, y) in targets {
        target_of[t] = Some(y);
    }
    let mut dlogits = logits;
    for (mut row, target) in dlogits.rows_mut().into_iter().zip(target_of) {
        match target {
            Some(y) => {
                let lse = log_sum_exp(row.view());
                loss += lse - row[y];
                row.mapv_inplace(|v| (v - lse).exp() * w);
                row[y] -= w;
            }
            None => row.fill(0.0),
        }
    }
    if let Some(cap) = model.final_logit_softcap() {
        // Back through cap·tanh(z/cap): 1 − tanh² = 1 − (capped / cap)², at the capped logits
        // the forward pass kept.
        dlogits.zip_mut_with(&capped, |d, &c| *d *= 1.0 - (c / cap).powi(2));
    }
    (loss * w, dlogits)
}

/// Example `example`'s loss only (used by the finite-difference checks). A batch that does not
/// fit the model is an error.
pub fn example_loss<M: DecoderModel + ?Sized>(
    model: &M,
    batch: &Batch,
    example: usize,
    reduction: Reduction,
) -> Result<f64> {
    batch.check_example(&model.dims(), example)?;
    let ids = batch.ids(example);
    let targets = batch.targets(example);
    let fw = forward(model, &ids, &mut None, &mut || {});
    let w = loss_weight(&targets, reduction);
    Ok(targets
        .iter()
        .map(|&(t, y)| log_sum_exp(fw.logits.row(t)) - fw.logits[(t, y)])
        .sum::<f64>()
        * w)
}

/// Example `example`'s loss, materialized gradient and (when `record_sites`) its sites: token
/// embedding(s) first, then every block in order, the final norm, and the head last (kind
/// `linear`, named `lm_head.weight`, writing the embedding when tied). A batch that does not fit
/// the model is an error.
pub fn example_gradient<M: DecoderModel + ?Sized>(
    model: &M,
    batch: &Batch,
    example: usize,
    reduction: Reduction,
    record_sites: bool,
) -> Result<ExampleGradient<M::Params>> {
    let mut grad = model.zero_gradient();
    let (loss, sites, _) = example_gradient_into(
        model,
        batch,
        example,
        reduction,
        record_sites,
        HeadPath::Separate,
        &mut grad,
    )?;
    Ok(ExampleGradient { loss, grad, sites })
}

/// The sites of one example in site order, from the pieces the backward pass recorded.
struct SiteParts {
    on: bool,
    embedding: Vec<SiteRecord>,
    /// In backward order (last block first).
    blocks: Vec<Vec<SiteRecord>>,
    final_norm: Vec<SiteRecord>,
}

impl SiteParts {
    fn new(on: bool) -> Self {
        SiteParts {
            on,
            embedding: Vec::new(),
            blocks: Vec::new(),
            final_norm: Vec::new(),
        }
    }

    fn finish<M: DecoderModel + ?Sized>(
        self,
        model: &M,
        af: Array2<f64>,
        dlogits: Array2<f64>,
    ) -> Option<Vec<SiteRecord>> {
        if !self.on {
            return None;
        }
        let mut sites = self.embedding;
        for rec in self.blocks.into_iter().rev() {
            sites.extend(rec);
        }
        sites.extend(self.final_norm);
        let mut head = SiteRecord::dense(LM_HEAD.into(), SiteKind::Linear, af, dlogits);
        head.param = model.head_param_name();
        sites.push(head);
        Some(sites)
    }
}

/// The token table's site: its rows of `de` (the gradient of the lookup's output) at the ids.
fn table_site<M: DecoderModel + ?Sized>(model: &M, ids: &[usize], de: Array2<f64>) -> SiteRecord {
    let name = model.param_name(model.embedding_local_name());
    SiteRecord::embedding(
        name.clone(),
        name,
        model.dims().vocab_size,
        ids.to_vec(),
        de,
    )
}

/// [`example_gradient`] into a gradient buffer that is reused from one example to the next
/// (`zero_gradient()` the first time): every tensor is reset here. The head path goes into
/// `lm_head` (allocated when absent), or, for a tied model with [`HeadPath::Folded`], into the
/// token embedding, whose split is then returned. Returns the loss, the sites and the split; a
/// batch that does not fit the model is an error.
pub fn example_gradient_into<M: DecoderModel + ?Sized>(
    model: &M,
    batch: &Batch,
    example: usize,
    reduction: Reduction,
    record_sites: bool,
    head_path: HeadPath,
    g: &mut M::Params,
) -> Result<(f64, Option<Vec<SiteRecord>>, Option<SharedSplit>)> {
    batch.check_example(&model.dims(), example)?;
    let folded = head_path == HeadPath::Folded && model.dims().tie_word_embeddings;
    let ids = batch.ids(example);
    let targets = batch.targets(example);
    let mut weights = None;
    let Forward {
        mut blocks,
        norm,
        af,
        logits,
    } = forward(model, &ids, &mut weights, &mut || {});
    let (loss, dlogits) = loss_and_dlogits(model, logits, &targets, reduction);

    for (name, t) in g.tensors_mut() {
        if name != LM_HEAD {
            clear(t);
        }
    }
    if folded {
        *g.lm_head_mut() = None;
        product_into(
            1.0,
            dlogits.t(),
            af.view(),
            Accumulate::Replace,
            g.token_embedding_mut().view_mut(),
        );
    } else {
        match g.lm_head_mut() {
            Some(head) if head.dim() == (dlogits.ncols(), af.ncols()) => product_into(
                1.0,
                dlogits.t(),
                af.view(),
                Accumulate::Replace,
                head.view_mut(),
            ),
            slot => *slot = Some(product(dlogits.t(), af.view())),
        }
    }
    let d_af = product(dlogits.view(), model.head().view());

    let mut sites = SiteParts::new(record_sites);
    let mut dh = model.final_norm_backward(
        d_af.view(),
        &norm,
        g,
        record_sites.then_some(&mut sites.final_norm),
    );
    // Each block's cache is dropped once its backward has run, so the recorded sites grow as
    // the caches shrink.
    while let Some(cache) = blocks.pop() {
        let l = blocks.len();
        let mut rec = Vec::new();
        let w = model.block_weights(l, &mut weights);
        dh = model.block_backward(
            l,
            w,
            &cache,
            dh,
            &mut g.blocks_mut()[l],
            record_sites.then_some(&mut rec),
        );
        sites.blocks.push(rec);
    }
    let de = model.embedding_backprops(&ids, dh.view());
    let split = folded.then(|| {
        let head = g.token_embedding();
        table_split(
            &table_rows(&ids, de.view()),
            square(head.view().into_dyn()),
            |x| head.row(x).to_owned(),
        )
    });
    {
        let table = g.token_embedding_mut();
        for (t, &x) in ids.iter().enumerate() {
            let mut r = table.row_mut(x);
            r += &de.row(t);
        }
    }
    if record_sites {
        sites.embedding.push(table_site(model, &ids, de));
    }
    model.embed_backward(
        &ids,
        dh.view(),
        g,
        record_sites.then_some(&mut sites.embedding),
    );
    Ok((loss, sites.finish(model, af, dlogits), split))
}

/// Rows of the head's gradient formed at a time: a 4096×d f64 buffer instead of V×d.
const HEAD_CHUNK: usize = 4096;

/// ‖dlogitsᵀ · af‖², the head path's squared norm, materialized a vocabulary chunk at a time.
fn head_square(dlogits: &Array2<f64>, af: &Array2<f64>) -> f64 {
    let v = dlogits.ncols();
    let mut buffer = Array2::<f64>::zeros((HEAD_CHUNK.min(v), af.ncols()));
    let mut total = 0.0;
    for start in (0..v).step_by(HEAD_CHUNK) {
        let end = (start + HEAD_CHUNK).min(v);
        let mut chunk = buffer.slice_mut(s![..end - start, ..]);
        product_into(
            1.0,
            dlogits.slice(s![.., start..end]).t(),
            af.view(),
            Accumulate::Replace,
            chunk.view_mut(),
        );
        total += square(chunk.view().into_dyn());
    }
    total
}

/// The squared Frobenius norm of a tensor.
pub(crate) fn square(t: ArrayViewD<f64>) -> f64 {
    match t.as_slice_memory_order() {
        Some(values) => sweep::sum_of_squares(values),
        None => t.iter().map(|v| v * v).sum(),
    }
}

/// Sets a gradient tensor to zero (on every core when it is one contiguous buffer).
fn clear(mut t: ArrayViewMutD<f64>) {
    match t.as_slice_memory_order_mut() {
        Some(values) => sweep::clear(values),
        None => t.fill(0.0),
    }
}

/// Examples run through each block together at most, when the caller does not say: four share
/// one widening of a stored block's weights (three quarters of it saved) for at most four
/// examples' activations held at once.
pub const MAX_TOGETHER: usize = 4;

/// How many examples [`group_norms`] should run together on `model` for `batch`: one for a
/// resident model (no widening to share); for a stored one, as many as a sixth of the machine's
/// memory holds of their activations (estimated from the config), at most [`MAX_TOGETHER`].
/// Only speed depends on it: every example's results are the same bits either way.
pub fn examples_together<M: DecoderModel + ?Sized>(model: &M, batch: &Batch) -> usize {
    if model.stored_blocks().is_none() {
        return 1;
    }
    let t = batch.seq_len();
    let dims = model.dims();
    // Every block's cache, and the logits and their gradient.
    let entries = dims.layers * model.block_cache_entries(t) + 2 * t * dims.vocab_size;
    let per_example = entries.saturating_mul(8).max(1);
    let budget = usize::try_from(MemoryBudget::machine().get() / 6).unwrap_or(usize::MAX);
    (budget / per_example).clamp(1, MAX_TOGETHER)
}

/// Examples `examples` of a batch: each one's loss, squared norms and split, streamed. The
/// group goes through the blocks together: each block's weights are widened (when stored) once
/// for all of them, then each example's pass runs on its own, exactly as it would alone. Each
/// block's gradient is formed into one reused buffer, reduced to squared norms and dropped; the
/// head's gradient is formed a vocabulary chunk at a time and the tied table's input path is
/// kept as the few rows the example's ids touch. Nothing model-sized is allocated; the group
/// holds its examples' activations. `tick` is called after every block's forward and backward
/// over the group and after the group's heads. A batch that does not fit the model is an error.
pub fn group_norms<M: DecoderModel + ?Sized>(
    model: &M,
    batch: &Batch,
    examples: Range<usize>,
    reduction: Reduction,
    record_sites: bool,
    workspace: &mut Workspace<BlockOf<M>>,
    tick: &mut dyn FnMut(),
) -> Result<Vec<ExampleNorms>> {
    for i in examples.clone() {
        batch.check_example(&model.dims(), i)?;
    }
    let tied = model.dims().tie_word_embeddings;
    let layers = model.dims().layers;
    let Workspace { weights, gradient } = workspace;
    let ids: Vec<Vec<usize>> = examples.clone().map(|i| batch.ids(i)).collect();

    let forwards = forward_group(model, &ids, weights, tick);
    let mut in_flight = Vec::with_capacity(ids.len());
    for (i, fw) in examples.clone().zip(forwards) {
        let Forward {
            blocks,
            norm,
            af,
            logits,
        } = fw;
        let (loss, dlogits) = loss_and_dlogits(model, logits, &batch.targets(i), reduction);
        let output_sq = head_square(&dlogits, &af);
        let d_af = product(dlogits.view(), model.head().view());
        let mut stem = model.zero_stem_gradient();
        let mut sites = SiteParts::new(record_sites);
        let dh = model.final_norm_backward(
            d_af.view(),
            &norm,
            &mut stem,
            record_sites.then_some(&mut sites.final_norm),
        );
        in_flight.push(InFlight {
            blocks,
            loss,
            af,
            dlogits,
            output_sq,
            dh,
            stem,
            sites,
            block_squares: Vec::with_capacity(layers),
        });
    }
    tick();

    let g = gradient.get_or_insert_with(|| model.zero_block());
    for l in (0..layers).rev() {
        let w = model.block_weights(l, weights);
        for e in &mut in_flight {
            for (_, t) in g.tensors_mut() {
                clear(t);
            }
            let c = e.blocks.pop().expect("one cache per block");
            let mut rec = Vec::new();
            e.dh = model.block_backward(
                l,
                w,
                &c,
                std::mem::take(&mut e.dh),
                g,
                record_sites.then_some(&mut rec),
            );
            drop(c);
            e.sites.blocks.push(rec);
            e.block_squares.push(
                g.tensors()
                    .into_iter()
                    .map(|(n, t)| (model.block_param_name(l, &n), square(t)))
                    .collect(),
            );
        }
        tick();
    }

    let mut out = Vec::with_capacity(ids.len());
    for (ids, e) in ids.iter().zip(in_flight) {
        let InFlight {
            blocks: _,
            loss,
            af,
            dlogits,
            output_sq,
            dh,
            mut stem,
            mut sites,
            block_squares,
        } = e;
        let de = model.embedding_backprops(ids, dh.view());
        let rows = table_rows(ids, de.view());
        // Row x of the head path dlogitsᵀ·af is Σ_t dlogits[t, x] af_t.
        let split = table_split(&rows, output_sq, |x| af.t().dot(&dlogits.column(x)));
        let input_sq = split.input_sq;
        let split = tied.then_some(split);
        if record_sites {
            sites.embedding.push(table_site(model, ids, de));
        }
        model.embed_backward(
            ids,
            dh.view(),
            &mut stem,
            record_sites.then_some(&mut sites.embedding),
        );

        // Checkpoint order: the stem's tensors before the blocks (the token table first), the
        // blocks, the rest of the stem, an untied head.
        let table_sq = match split {
            Some(s) => s.input_sq + s.output_sq + 2.0 * s.cross,
            None => input_sq,
        };
        let stem_squares: Vec<(String, f64)> = stem
            .tensors()
            .into_iter()
            .enumerate()
            .map(|(i, (local, t))| {
                let sq = if i == 0 { table_sq } else { square(t) };
                (model.param_name(&local), sq)
            })
            .collect();
        let (before, after) = stem_squares.split_at(<M::Params as ParamSet>::STEM_TENSORS);
        let mut squares = before.to_vec();
        squares.extend(block_squares.into_iter().rev().flatten());
        squares.extend_from_slice(after);
        if !tied {
            squares.push((LM_HEAD.to_string(), output_sq));
        }
        out.push(ExampleNorms {
            loss,
            squares,
            split,
            sites: sites.finish(model, af, dlogits),
        });
    }
    Ok(out)
}

/// The input path of a token table, Σ_t e_{x_t} ⊗ de_t (`de` the gradient of the lookup's
/// output, [`DecoderModel::embedding_backprops`]), as the rows it touches: only the example's
/// ids, so ‖g_in‖² and ⟨g_in, g_out⟩ are sums over those rows.
fn table_rows(ids: &[usize], de: ArrayView2<f64>) -> BTreeMap<usize, Array1<f64>> {
    let mut rows: BTreeMap<usize, Array1<f64>> = BTreeMap::new();
    for (t, &x) in ids.iter().enumerate() {
        *rows.entry(x).or_insert_with(|| Array1::zeros(de.ncols())) += &de.row(t);
    }
    rows
}

/// The split of a tied table from its input path's rows, the head path's squared norm and the
/// head path's row at an id: ⟨g_in, g_out⟩ only reads the head path at the example's ids.
fn table_split(
    rows: &BTreeMap<usize, Array1<f64>>,
    output_sq: f64,
    head_row: impl Fn(usize) -> Array1<f64>,
) -> SharedSplit {
    SharedSplit {
        input_sq: rows.values().map(|r| r.dot(r)).sum(),
        output_sq,
        cross: rows.iter().map(|(&x, r)| r.dot(&head_row(x))).sum(),
    }
}
