//! Per-example forward and explicit backward of a decoder-only model in f64, written once for
//! every family: embedding, blocks, final norm, LM head and causal-LM loss. Every intermediate
//! is kept and every parameter gradient materialized, so that the result can be checked line by
//! line against the definition and against finite differences.

use crate::batch::Batch;
use crate::decoder::{DecoderModel, ParamSet, LM_HEAD};
use crate::error::Result;
use crate::layers::NormCache;
use crate::site::SiteKind;
use crate::trace::SiteRecord;
use ndarray::linalg::general_mat_mul;
use ndarray::{Array1, Array2, ArrayView1, ArrayView2};
use std::collections::BTreeMap;

/// How an example's token losses combine into its loss.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    /// Mean over the example's kept targets (HF's default).
    Mean,
    Sum,
}

impl Reduction {
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
    pub input_sq: f64,
    pub output_sq: f64,
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

fn forward<M: DecoderModel + ?Sized>(model: &M, ids: &[usize]) -> Forward<M::BlockCache> {
    let mut h = model.embed(ids);
    let layers = model.dims().layers;
    let mut blocks = Vec::with_capacity(layers);
    for l in 0..layers {
        let (cache, out) = model.block_forward(l, h);
        blocks.push(cache);
        h = out;
    }
    let (norm, af) = model.final_norm(h.view());
    let mut logits = af.dot(&model.head().t());
    if let Some(cap) = model.final_logit_softcap() {
        logits.mapv_inplace(|z| cap * (z / cap).tanh());
    }
    Forward {
        blocks,
        norm,
        af,
        logits,
    }
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
    let fw = forward(model, &ids);
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

/// [`example_gradient`] into a gradient buffer that is reused from one example to the next
/// (`zero_gradient()` the first time): every tensor is reset here. The head path goes into
/// `lm_head` (allocated when absent), or, for a tied model with [`HeadPath::Folded`], into the
/// token embedding, whose split is then returned. A model the size of Qwen2.5-0.5B has a 4 GB
/// gradient; reusing the buffer saves mapping fresh memory for every example. Returns the loss,
/// the sites and the split; a batch that does not fit the model is an error.
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
    let Forward {
        mut blocks,
        norm,
        af,
        logits,
    } = forward(model, &ids);
    let w = loss_weight(&targets, reduction);
    let capped = match model.final_logit_softcap() {
        Some(_) => logits.clone(),
        None => Array2::zeros((0, 0)),
    };

    // The logits become their gradient in place: softmax·w minus w at the target on rows with
    // a target, zero elsewhere.
    let mut loss = 0.0;
    let mut target_of = vec![None; logits.nrows()];
    for &(t, y) in &targets {
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
    loss *= w;
    if let Some(cap) = model.final_logit_softcap() {
        // Back through cap·tanh(z/cap): 1 − tanh² = 1 − (capped / cap)², at the capped logits
        // the forward pass kept.
        dlogits.zip_mut_with(&capped, |d, &c| *d *= 1.0 - (c / cap).powi(2));
    }

    for (name, mut t) in g.tensors_mut() {
        if name != LM_HEAD {
            t.fill(0.0);
        }
    }
    if folded {
        *g.lm_head_mut() = None;
        general_mat_mul(1.0, &dlogits.t(), &af, 0.0, g.token_embedding_mut());
    } else {
        match g.lm_head_mut() {
            Some(head) if head.dim() == (dlogits.ncols(), af.ncols()) => {
                general_mat_mul(1.0, &dlogits.t(), &af, 0.0, head)
            }
            slot => *slot = Some(dlogits.t().dot(&af)),
        }
    }
    let d_af = dlogits.dot(model.head());

    let mut final_sites = Vec::new();
    let mut dh = model.final_norm_backward(
        d_af.view(),
        &norm,
        g,
        record_sites.then_some(&mut final_sites),
    );
    let mut block_sites: Vec<Vec<SiteRecord>> = Vec::new();
    // Each block's cache is dropped once its backward has run, so the recorded sites grow as
    // the caches shrink (at the Qwen2.5-0.5B shape either is ~0.6 GB an example).
    while let Some(cache) = blocks.pop() {
        let l = blocks.len();
        let mut rec = Vec::new();
        dh = model.block_backward(l, &cache, dh, g, record_sites.then_some(&mut rec));
        block_sites.push(rec);
    }
    let split = folded.then(|| {
        tied_split(
            &ids,
            model.embedding_backprops(&ids, dh.view()).view(),
            g.token_embedding(),
        )
    });
    let mut sites = Vec::new();
    model.embed_backward(&ids, dh.view(), g, record_sites.then_some(&mut sites));

    if record_sites {
        for rec in block_sites.into_iter().rev() {
            sites.extend(rec);
        }
        sites.extend(final_sites);
        let mut head = SiteRecord::dense(LM_HEAD.into(), SiteKind::Linear, af, dlogits);
        head.param = model.head_param_name();
        sites.push(head);
    }
    Ok((loss, record_sites.then_some(sites), split))
}

/// The split of a tied table whose buffer holds the head path: the input path Σ_t e_{x_t} ⊗ de_t
/// (`de` the gradient of the lookup's output, [`DecoderModel::embedding_backprops`]) touches only
/// the rows of the example's ids, so ‖g_in‖² and ⟨g_in, g_out⟩ are sums over those rows.
fn tied_split(ids: &[usize], de: ArrayView2<f64>, head: &Array2<f64>) -> SharedSplit {
    let mut rows: BTreeMap<usize, Array1<f64>> = BTreeMap::new();
    for (t, &x) in ids.iter().enumerate() {
        *rows.entry(x).or_insert_with(|| Array1::zeros(de.ncols())) += &de.row(t);
    }
    SharedSplit {
        input_sq: rows.values().map(|r| r.dot(r)).sum(),
        output_sq: head.iter().map(|v| v * v).sum(),
        cross: rows.iter().map(|(&x, r)| r.dot(&head.row(x))).sum(),
    }
}
