//! GPT-2's parameters: a block's tensors listed once, in [`BLOCK_PARTS`], and the model's in
//! checkpoint order.

use super::config::Gpt2Config;
use crate::decoder::{param_set, BlockParams, ParamSet, LM_HEAD};
use crate::layers::{Conv1d, LayerNorm};
use ndarray::{Array2, ArrayViewD, ArrayViewMutD};

#[derive(Clone, Debug, PartialEq)]
pub struct Block {
    pub ln_1: LayerNorm,
    pub c_attn: Conv1d,
    pub attn_proj: Conv1d,
    pub ln_2: LayerNorm,
    pub c_fc: Conv1d,
    pub mlp_proj: Conv1d,
}

/// One value per parameter tensor. The same type holds weights and gradients; in a gradient of a
/// tied model `wte` holds the input-embedding path and `lm_head` the head path, which is how the
/// reference reports the split.
#[derive(Clone, Debug, PartialEq)]
pub struct Gpt2Params {
    /// `wte.weight`, the V×d token embedding.
    pub wte: Array2<f64>,
    /// `wpe.weight`, the learned positions (n_positions×d).
    pub wpe: Array2<f64>,
    /// The blocks `h.{layer}`, first layer first.
    pub blocks: Vec<Block>,
    /// The final LayerNorm.
    pub ln_f: LayerNorm,
    /// V×d (nn.Linear layout). `None` for a tied model's weights.
    pub lm_head: Option<Array2<f64>>,
}

/// A block's tensors, by their names relative to `h.{layer}.`, in checkpoint order.
const BLOCK_PARTS: [&str; 12] = [
    "ln_1.weight",
    "ln_1.bias",
    "attn.c_attn.weight",
    "attn.c_attn.bias",
    "attn.c_proj.weight",
    "attn.c_proj.bias",
    "ln_2.weight",
    "ln_2.bias",
    "mlp.c_fc.weight",
    "mlp.c_fc.bias",
    "mlp.c_proj.weight",
    "mlp.c_proj.bias",
];

pub(super) const WTE: &str = "wte.weight";

impl Gpt2Params {
    /// Zero tensors of a config's shapes, with an untied head when `with_head`.
    pub fn zeros(cfg: &Gpt2Config, with_head: bool) -> Self {
        let d = cfg.n_embd;
        Gpt2Params {
            wte: Array2::zeros((cfg.vocab_size, d)),
            wpe: Array2::zeros((cfg.n_positions, d)),
            blocks: (0..cfg.n_layer).map(|_| Block::zeros(cfg)).collect(),
            ln_f: LayerNorm::zeros(d),
            lm_head: with_head.then(|| Array2::zeros((cfg.vocab_size, d))),
        }
    }

    /// (name, shape) of every tensor of a config, in `tensors()` order, without allocating.
    pub fn layout(cfg: &Gpt2Config, with_head: bool) -> Vec<(String, Vec<usize>)> {
        let (v, p, d, i) = (cfg.vocab_size, cfg.n_positions, cfg.n_embd, cfg.n_inner);
        let mut out = vec![
            (WTE.to_string(), vec![v, d]),
            ("wpe.weight".into(), vec![p, d]),
        ];
        for l in 0..cfg.n_layer {
            let shapes: [Vec<usize>; 12] = [
                vec![d],
                vec![d],
                vec![d, 3 * d],
                vec![3 * d],
                vec![d, d],
                vec![d],
                vec![d],
                vec![d],
                vec![d, i],
                vec![i],
                vec![i, d],
                vec![d],
            ];
            for (local, shape) in BLOCK_PARTS.iter().zip(shapes) {
                out.push((format!("h.{l}.{local}"), shape));
            }
        }
        out.push(("ln_f.weight".into(), vec![d]));
        out.push(("ln_f.bias".into(), vec![d]));
        if with_head {
            out.push((LM_HEAD.into(), vec![v, d]));
        }
        out
    }

    /// Every tensor with its name relative to the transformer (`lm_head.weight` last).
    pub fn tensors(&self) -> Vec<(String, ArrayViewD<'_, f64>)> {
        ParamSet::tensors(self)
    }

    /// Mutable views of [`Gpt2Params::tensors`], same names and order.
    pub fn tensors_mut(&mut self) -> Vec<(String, ArrayViewMutD<'_, f64>)> {
        ParamSet::tensors_mut(self)
    }
}

impl Block {
    pub(super) fn zeros(cfg: &Gpt2Config) -> Self {
        let (d, i) = (cfg.n_embd, cfg.n_inner);
        Block {
            ln_1: LayerNorm::zeros(d),
            c_attn: Conv1d::zeros(d, 3 * d),
            attn_proj: Conv1d::zeros(d, d),
            ln_2: LayerNorm::zeros(d),
            c_fc: Conv1d::zeros(d, i),
            mlp_proj: Conv1d::zeros(i, d),
        }
    }
}

/// A block's tensors in [`BLOCK_PARTS`] order; `$view` is `view` or `view_mut`.
macro_rules! block_tensors {
    ($b:expr, $view:ident) => {{
        let b = $b;
        let views = [
            b.ln_1.weight.$view().into_dyn(),
            b.ln_1.bias.$view().into_dyn(),
            b.c_attn.weight.$view().into_dyn(),
            b.c_attn.bias.$view().into_dyn(),
            b.attn_proj.weight.$view().into_dyn(),
            b.attn_proj.bias.$view().into_dyn(),
            b.ln_2.weight.$view().into_dyn(),
            b.ln_2.bias.$view().into_dyn(),
            b.c_fc.weight.$view().into_dyn(),
            b.c_fc.bias.$view().into_dyn(),
            b.mlp_proj.weight.$view().into_dyn(),
            b.mlp_proj.bias.$view().into_dyn(),
        ];
        BLOCK_PARTS
            .iter()
            .zip(views)
            .map(|(n, v)| (n.to_string(), v))
            .collect()
    }};
}

impl BlockParams for Block {
    fn tensors(&self) -> Vec<(String, ArrayViewD<'_, f64>)> {
        block_tensors!(self, view)
    }

    fn tensors_mut(&mut self) -> Vec<(String, ArrayViewMutD<'_, f64>)> {
        block_tensors!(self, view_mut)
    }
}

param_set!(Gpt2Params {
    block: Block,
    block_prefix: "h.",
    token_embedding: wte,
    stem: [(WTE, wte), ("wpe.weight", wpe)],
    blocks: blocks,
    tail: [("ln_f.weight", ln_f.weight), ("ln_f.bias", ln_f.bias)],
    lm_head: lm_head,
});
