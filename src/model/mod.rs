//! Decoder-only language models on candle: a second, independent implementation of every family
//! the reference knows (autograd instead of the reference's hand-written backward) that produces
//! a batch trace in any dtype, on any device. Backprops are read from "taps": a zero `Var` added
//! to each site's output, whose gradient is the gradient of that output.
//!
//! One skeleton ([`decode`]) runs every family: the token embedding (and any further embedding
//! sites that share its backprops, such as GPT-2's positions), the blocks, the final norm, the LM
//! head (the token embedding itself when tied), the per-example causal-LM loss, one backward of
//! the summed loss, and the assembly of the [`Trace`] and of the batch gradient. A family
//! (`gpt2.rs`, `llama.rs`) supplies its blocks, its final norm and its extra embeddings.

mod gpt2;
mod llama;

pub use gpt2::CandleGpt2;
pub use llama::CandleLlama;

use crate::error::{Error, Result};
use crate::trace::{Site, SiteKind, SiteSpec, Trace};
use candle_core::{DType, Device, Tensor, Var, D};
use ghost_oracle_reference::{Batch, DecoderModel, Dims, Model, Reduction, IGNORE, LM_HEAD};

/// The trace of a batch and the batch gradient Σ_i ∇L_i of every parameter.
pub struct Extracted {
    /// The per-site factors, in the model's dtype and device.
    pub trace: Trace,
    /// (checkpoint name, gradient) in the reference's parameter order (a tied head once).
    pub batch_gradient: Vec<(String, Tensor)>,
    /// Each example's loss under the reduction, in batch order.
    pub losses: Vec<f64>,
}

/// A candle model of any family the reference knows. Every `match` on it is exhaustive, so a new
/// family is a compile error wherever it is not handled.
pub enum CandleModel {
    /// GPT-2 (`gpt2`).
    Gpt2(CandleGpt2),
    /// Every Llama-shaped family of the reference (`llama`, `qwen2`, `qwen3`, `gemma`, `gemma2`,
    /// `gemma3_text`, `vaultgemma`).
    Llama(CandleLlama),
}

impl CandleModel {
    /// The reference's weights rounded to `dtype` on `device`.
    pub fn from_reference(model: &Model, dtype: DType, device: &Device) -> Result<Self> {
        Ok(match model {
            Model::Gpt2(m) => CandleModel::Gpt2(CandleGpt2::from_reference(m, dtype, device)?),
            Model::Llama(m) => CandleModel::Llama(CandleLlama::from_reference(m, dtype, device)?),
        })
    }

    /// Runs the batch forward and backward (of the summed per-example losses) and returns the
    /// trace in this model's dtype and device.
    pub fn extract(&self, batch: &Batch, reduction: Reduction) -> Result<Extracted> {
        match self {
            CandleModel::Gpt2(m) => m.extract(batch, reduction),
            CandleModel::Llama(m) => m.extract(batch, reduction),
        }
    }

    /// The dtype the model computes in.
    pub fn dtype(&self) -> DType {
        match self {
            CandleModel::Gpt2(m) => m.core.dtype,
            CandleModel::Llama(m) => m.core.dtype,
        }
    }
}

impl From<CandleGpt2> for CandleModel {
    fn from(m: CandleGpt2) -> Self {
        CandleModel::Gpt2(m)
    }
}

impl From<CandleLlama> for CandleModel {
    fn from(m: CandleLlama) -> Self {
        CandleModel::Llama(m)
    }
}

/// What every family holds: its weights as candle `Var`s by checkpoint name, in the reference's
/// parameter order, and the names the skeleton needs.
pub(crate) struct Core {
    dims: Dims,
    weights: Vec<(String, Var)>,
    /// Checkpoint name of the token embedding (V×d).
    embedding: String,
    /// Checkpoint name of the tensor the LM head reads: the embedding when tied.
    head_param: String,
    dtype: DType,
    device: Device,
}

impl Core {
    fn of<M: DecoderModel>(model: &M, dtype: DType, device: &Device) -> Result<Self> {
        let mut weights = Vec::new();
        let mut failed = None;
        model.visit_weights(&mut |name, t| {
            if failed.is_some() {
                return;
            }
            let v: Vec<f64> = t.iter().copied().collect();
            let made = Tensor::from_vec(v, t.shape(), &Device::Cpu)
                .and_then(|x| x.to_dtype(dtype))
                .and_then(|x| x.to_device(device))
                .and_then(|x| Var::from_tensor(&x))
                .map_err(|e| Error::from(e).context(format!("weight `{name}`")));
            match made {
                Ok(var) => weights.push((name, var)),
                Err(e) => failed = Some(e),
            }
        });
        if let Some(e) = failed {
            return Err(e);
        }
        Ok(Core {
            dims: model.dims(),
            weights,
            embedding: model.param_name(model.embedding_local_name()),
            head_param: model.head_param_name(),
            dtype,
            device: device.clone(),
        })
    }

    /// The weight with this checkpoint name.
    fn w(&self, name: &str) -> Result<&Tensor> {
        self.weights
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_tensor())
            .ok_or_else(|| Error::internal(format!("weight `{name}` not found")))
    }
}

/// The sites of a forward pass, in forward order: a zero `Var` added to each site's output.
#[derive(Default)]
pub(crate) struct Taps {
    sites: Vec<Tap>,
}

struct Tap {
    spec: SiteSpec,
    activations: Tensor,
    /// The bias site that shares the weight's backprops, when the module has one.
    bias: Option<String>,
    var: Var,
}

impl Taps {
    /// Adds a zero tap to `out` and records the weight site `weight` (its own parameter) of
    /// `kind` with `activations` (detached here), and the bias site `bias` when given.
    fn tap(
        &mut self,
        out: Tensor,
        weight: String,
        kind: SiteKind,
        activations: &Tensor,
        bias: Option<String>,
    ) -> Result<Tensor> {
        let spec = SiteSpec {
            param: weight.clone(),
            name: weight,
            kind,
            vocab: None,
        };
        self.tap_spec(out, spec, activations, bias)
    }

    fn tap_spec(
        &mut self,
        out: Tensor,
        spec: SiteSpec,
        activations: &Tensor,
        bias: Option<String>,
    ) -> Result<Tensor> {
        let var = Var::zeros(out.shape(), out.dtype(), out.device())?;
        let tapped = (out + var.as_tensor())?;
        self.sites.push(Tap {
            spec,
            activations: activations.detach(),
            bias,
            var,
        });
        Ok(tapped)
    }
}

/// An embedding site besides the token embedding whose output is added to it (so its backprops
/// are the token embedding's): GPT-2's learned positions.
pub(crate) struct ExtraEmbedding {
    name: String,
    vocab: usize,
    /// B×T ids (u32).
    ids: Tensor,
}

/// The batch shape and the causal mask, shared by every block.
pub(crate) struct BatchShape {
    b: usize,
    t: usize,
    /// T×T: 0 on and below the diagonal, -1e30 above, in the model's dtype.
    mask: Tensor,
}

/// What the skeleton needs from a family.
pub(crate) trait Architecture {
    /// What the blocks precompute once per batch (rotary tables, ...).
    type Context;

    fn core(&self) -> &Core;
    fn context(&self, shape: &BatchShape) -> Result<Self::Context>;
    /// The input of the first block from the token embeddings (B×T×d), and the embedding sites
    /// that add to them.
    fn embed(&self, tokens: Tensor, shape: &BatchShape) -> Result<(Tensor, Vec<ExtraEmbedding>)>;
    fn block(
        &self,
        layer: usize,
        x: Tensor,
        shape: &BatchShape,
        ctx: &Self::Context,
        taps: &mut Taps,
    ) -> Result<Tensor>;
    /// The final normalization (the head's input), tapped.
    fn final_norm(&self, x: &Tensor, taps: &mut Taps) -> Result<Tensor>;
    /// The token whose embedding row gets no gradient (HF's `padding_idx`), if any.
    fn pad_token(&self) -> Option<usize> {
        None
    }
    /// `cap` of the final-logit soft-capping `cap · tanh(z / cap)`, if any.
    fn final_logit_softcap(&self) -> Option<f64> {
        None
    }
}

/// `softmax` over the last dimension from primitive ops (with a backward).
fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&m)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?)
}

/// How a block's attention scores become probabilities.
pub(crate) struct Attention<'a> {
    pub scale: f64,
    /// `cap · tanh(s / cap)` on the scaled scores, before the mask (Gemma 2, VaultGemma).
    pub softcap: Option<f64>,
    /// T×T additive mask: the causal one, or a sliding window's.
    pub mask: &'a Tensor,
    /// A half-precision model computes the softmax in f32 (as HF's Llama does).
    pub softmax_f32: bool,
}

/// Causal softmax attention. q, k, v: B×H×T×hd (keys and values already one per query head).
/// Returns B×T×(H·hd).
fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, how: &Attention<'_>) -> Result<Tensor> {
    let (b, h, t, hd) = q.dims4()?;
    let mut scores = (q.matmul(&k.transpose(2, 3)?.contiguous()?)? * how.scale)?;
    if let Some(cap) = how.softcap {
        scores = ((scores / cap)?.tanh()? * cap)?;
    }
    let scores = scores.broadcast_add(how.mask)?;
    let probs = match (how.softmax_f32, is_half(scores.dtype())) {
        (true, true) => {
            softmax_last_dim(&scores.to_dtype(DType::F32)?)?.to_dtype(scores.dtype())?
        }
        _ => softmax_last_dim(&scores)?,
    };
    Ok(probs
        .matmul(v)?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((b, t, h * hd))?)
}

/// The T×T additive mask of a sliding window of `window` positions: query t sees keys
/// t − window < s ≤ t (HF's `kv_idx > q_idx - sliding_window`).
fn window_mask(window: usize, shape: &BatchShape, core: &Core) -> Result<Tensor> {
    let t = shape.t;
    let mask: Vec<f64> = (0..t * t)
        .map(|k| {
            let (q, s) = (k / t, k % t);
            if s > q || s + window <= q {
                -1e30
            } else {
                0.0
            }
        })
        .collect();
    Ok(Tensor::from_vec(mask, (t, t), &core.device)?.to_dtype(core.dtype)?)
}

fn is_half(dtype: DType) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
}

/// Runs a family's forward over the batch, the per-example loss and one backward of the summed
/// losses; returns the trace (sites in the reference's order), the batch gradient and the
/// per-example losses.
fn decode<F: Architecture>(family: &F, batch: &Batch, reduction: Reduction) -> Result<Extracted> {
    let core = family.core();
    batch.validate(&core.dims, "batch")?;
    let (ids, shape) = batch_tensors(core, batch)?;
    let ctx = family.context(&shape)?;
    let mut taps = Taps::default();

    let (tapped, emb_tap) = tapped_lookup(family, &ids, batch, &shape)?;
    let (mut x, extra) = family.embed(tapped, &shape)?;
    for l in 0..core.dims.layers {
        x = family.block(l, x, &shape, &ctx, &mut taps)?;
    }
    let logits = lm_head(family, &x, &mut taps)?;
    let losses = causal_lm_losses(&logits, batch, reduction, core.dtype)?;
    let grads = losses.sum_all()?.backward()?;

    let bp = |v: &Var| -> Result<Tensor> {
        Ok(match grads.get(v.as_tensor()) {
            Some(g) => g.clone(),
            None => v.as_tensor().zeros_like()?,
        })
    };
    let sites = collect_sites(core, ids, bp(&emb_tap)?, extra, taps, &bp)?;
    let batch_gradient = core
        .weights
        .iter()
        .map(|(n, v)| Ok((n.clone(), bp(v)?)))
        .collect::<Result<Vec<_>>>()?;
    Ok(Extracted {
        trace: Trace { sites },
        batch_gradient,
        losses: crate::trace::to_f64_vec(&losses)?,
    })
}

/// The batch's ids as a B×T tensor, and its shape with the causal mask.
fn batch_tensors(core: &Core, batch: &Batch) -> Result<(Tensor, BatchShape)> {
    let (b, t) = (batch.len(), batch.seq_len());
    let dev = &core.device;
    let ids_u32 = batch
        .input_ids()
        .iter()
        .map(|&x| {
            u32::try_from(x)
                .map_err(|_| Error::input(format!("batch: input id {x} is outside 0..2³²")))
        })
        .collect::<Result<Vec<u32>>>()?;
    let ids = Tensor::from_vec(ids_u32, (b, t), dev)?;
    let mask: Vec<f64> = (0..t * t)
        .map(|k| if k % t > k / t { -1e30 } else { 0.0 })
        .collect();
    let shape = BatchShape {
        b,
        t,
        mask: Tensor::from_vec(mask, (t, t), dev)?.to_dtype(core.dtype)?,
    };
    Ok((ids, shape))
}

/// The token lookup with its tap: the tapped B×T×d embeddings and the tap, whose gradient is
/// the embedding site's backprops.
fn tapped_lookup<F: Architecture>(
    family: &F,
    ids: &Tensor,
    batch: &Batch,
    shape: &BatchShape,
) -> Result<(Tensor, Var)> {
    let core = family.core();
    let dev = &core.device;
    let tokens = core
        .w(&core.embedding)?
        .index_select(&ids.flatten_all()?, 0)?
        .reshape((shape.b, shape.t, core.dims.hidden_size))?;
    // The tap sits on the lookup's own output, so that its backprops are what the table's
    // input path accumulates (before Gemma's scale, and zero at a padding token, whose row HF's
    // `padding_idx` leaves without gradient: there the lookup enters detached).
    let emb_tap = Var::zeros(tokens.shape(), core.dtype, dev)?;
    let mut tapped = (&tokens + emb_tap.as_tensor())?;
    if let Some(pad) = family.pad_token() {
        let keep: Vec<f64> = batch
            .input_ids()
            .iter()
            .map(|&x| if x == pad as i64 { 0.0 } else { 1.0 })
            .collect();
        let keep = Tensor::from_vec(keep, (shape.b, shape.t, 1), dev)?.to_dtype(core.dtype)?;
        let dropped = (1.0 - &keep)?;
        tapped = (tapped.broadcast_mul(&keep)? + tokens.detach().broadcast_mul(&dropped)?)?;
    }
    Ok((tapped, emb_tap))
}

/// The final norm and the tapped LM head (softcapped where the family caps its logits).
fn lm_head<F: Architecture>(family: &F, x: &Tensor, taps: &mut Taps) -> Result<Tensor> {
    let core = family.core();
    let af = family.final_norm(x, taps)?;
    let logits = af.broadcast_matmul(&core.w(&core.head_param)?.t()?)?;
    let head = SiteSpec {
        name: LM_HEAD.to_string(),
        param: core.head_param.clone(),
        kind: SiteKind::Linear,
        vocab: None,
    };
    let mut logits = taps.tap_spec(logits, head, &af, None)?;
    if let Some(cap) = family.final_logit_softcap() {
        logits = ((logits / cap)?.tanh()? * cap)?;
    }
    Ok(logits)
}

/// Every site of the pass, from the backward's gradients: the embedding (and the family's extra
/// lookups, which share its backprops), then each tap with its bias.
fn collect_sites(
    core: &Core,
    ids: Tensor,
    emb_bp: Tensor,
    extra: Vec<ExtraEmbedding>,
    taps: Taps,
    bp: &dyn Fn(&Var) -> Result<Tensor>,
) -> Result<Vec<Site>> {
    let mut sites = vec![Site {
        spec: SiteSpec {
            name: core.embedding.clone(),
            param: core.embedding.clone(),
            kind: SiteKind::Embedding,
            vocab: Some(core.dims.vocab_size),
        },
        activations: None,
        ids: Some(ids),
        backprops: emb_bp.clone(),
    }];
    for e in extra {
        sites.push(Site {
            spec: SiteSpec {
                param: e.name.clone(),
                name: e.name,
                kind: SiteKind::Embedding,
                vocab: Some(e.vocab),
            },
            activations: None,
            ids: Some(e.ids),
            backprops: emb_bp.clone(),
        });
    }
    for tap in taps.sites {
        let backprops = bp(&tap.var)?;
        sites.push(Site {
            spec: tap.spec,
            activations: Some(tap.activations),
            ids: None,
            backprops: backprops.clone(),
        });
        if let Some(bias) = tap.bias {
            sites.push(Site {
                spec: SiteSpec {
                    name: bias.clone(),
                    param: bias,
                    kind: SiteKind::Bias,
                    vocab: None,
                },
                activations: None,
                ids: None,
                backprops,
            });
        }
    }
    Ok(sites)
}

/// Per-example causal-LM loss (B): logits at t predict the label at t + 1; each example's kept
/// targets weigh 1/N_i (mean) or 1 (sum), ignored labels 0.
fn causal_lm_losses(
    logits: &Tensor,
    batch: &Batch,
    reduction: Reduction,
    dtype: DType,
) -> Result<Tensor> {
    let (b, t) = (batch.len(), batch.seq_len());
    let dev = logits.device();
    let mut weights = vec![0.0; b * t];
    let mut targets = vec![0u32; b * t];
    for i in 0..b {
        let tg = batch.targets(i);
        let w = match reduction {
            Reduction::Mean => 1.0 / tg.len() as f64,
            Reduction::Sum => 1.0,
        };
        for (pos, y) in tg {
            weights[i * t + pos] = w;
            targets[i * t + pos] = u32::try_from(y)
                .map_err(|_| Error::input(format!("batch: label {y} is outside 0..2³²")))?;
        }
    }
    debug_assert!(batch.labels().iter().all(|&y| y == IGNORE || y >= 0));
    let weights = Tensor::from_vec(weights, (b, t), dev)?.to_dtype(dtype)?;
    let targets = Tensor::from_vec(targets, (b, t, 1), dev)?;
    let m = logits.max_keepdim(D::Minus1)?.detach();
    let lse = (logits
        .broadcast_sub(&m)?
        .exp()?
        .sum_keepdim(D::Minus1)?
        .log()?
        + &m)?
        .squeeze(2)?;
    let picked = logits.gather(&targets, 2)?.squeeze(2)?;
    let per_token = ((lse - picked)? * &weights)?;
    Ok(per_token.sum(1)?)
}
