//! The one shape of a decoder-only language model: a token embedding, a stack of blocks, a final
//! normalization and an LM head that may be the embedding itself. The skeleton (`gradient.rs`:
//! loss, head, tied split, site order, materialized per-example gradients; `reference.rs`: the
//! batch report) is written once against [`DecoderModel`]; a family (GPT-2, Llama) supplies its
//! embedding, its block and its final norm, each with an explicit backward pass.

use crate::layers::NormCache;
use crate::stored::StoredBlocks;
use crate::trace::SiteRecord;
use ndarray::{Array2, ArrayView2, ArrayViewD, ArrayViewMutD};

/// The name of an untied LM head in every family's checkpoints (`nn.Linear`, V×d).
pub const LM_HEAD: &str = "lm_head.weight";

/// Sizes the batch is checked against and that size the report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    /// V, the number of token ids.
    pub vocab_size: usize,
    /// Longest sequence the model accepts.
    pub max_positions: usize,
    /// The config key that sets `max_positions`, for messages.
    pub positions_key: &'static str,
    /// d, the width of the residual stream.
    pub hidden_size: usize,
    /// Number of blocks.
    pub layers: usize,
    /// Whether the LM head is the token embedding.
    pub tie_word_embeddings: bool,
}

/// Anything that knows a model's [`Dims`]: configs and models.
pub trait HasDims {
    /// The sizes of this config or model.
    fn dims(&self) -> Dims;
}

impl HasDims for Dims {
    fn dims(&self) -> Dims {
        *self
    }
}

/// One block's parameter tensors (weights or gradient), the unit the reference widens to f64 and
/// reduces to norms one at a time.
pub trait BlockParams: Clone + Send + Sync {
    /// Every tensor with its name relative to the block (`self_attn.q_proj.weight`), in
    /// checkpoint order.
    fn tensors(&self) -> Vec<(String, ArrayViewD<'_, f64>)>;
    /// Mutable views of [`BlockParams::tensors`], same names and order.
    fn tensors_mut(&mut self) -> Vec<(String, ArrayViewMutD<'_, f64>)>;
}

/// A family's parameter tensors. The same type holds weights and gradients; in a gradient the
/// token embedding holds the input-embedding path and `lm_head` the head path, even when the
/// model is tied, which is how the reference reports the split.
pub trait ParamSet: Clone {
    /// One block's tensors.
    type Block: BlockParams;
    /// How many tensors come before the first block in [`ParamSet::tensors`] (the token
    /// embedding, and GPT-2's position table).
    const STEM_TENSORS: usize;
    /// The family-local name of block `layer`'s tensors: `model.layers.{layer}.`, `h.{layer}.`.
    fn block_prefix(layer: usize) -> String;
    /// The blocks, first layer first.
    fn blocks(&self) -> &[Self::Block];
    /// Mutable access to the blocks.
    fn blocks_mut(&mut self) -> &mut [Self::Block];
    /// Every tensor with its family-local name (what `DecoderModel::param_name` turns into the
    /// checkpoint name), token embedding first and `lm_head.weight` last.
    fn tensors(&self) -> Vec<(String, ArrayViewD<'_, f64>)>;
    /// Mutable views of [`ParamSet::tensors`], same names and order.
    fn tensors_mut(&mut self) -> Vec<(String, ArrayViewMutD<'_, f64>)>;
    /// V×d token embedding.
    fn token_embedding(&self) -> &Array2<f64>;
    /// Mutable access to the V×d token embedding.
    fn token_embedding_mut(&mut self) -> &mut Array2<f64>;
    /// V×d untied head (`None` for a tied model's weights).
    fn lm_head(&self) -> Option<&Array2<f64>>;
    /// Mutable access to the untied head.
    fn lm_head_mut(&mut self) -> &mut Option<Array2<f64>>;
}

/// Every block's tensors, in order, with their family-local names (`P::block_prefix` + the
/// name within the block): how a [`ParamSet`] lists its blocks, for views and mutable views.
pub(crate) fn prefixed_blocks<P: ParamSet, V>(
    blocks: impl Iterator<Item = Vec<(String, V)>>,
) -> impl Iterator<Item = (String, V)> {
    blocks.enumerate().flat_map(|(l, tensors)| {
        let prefix = P::block_prefix(l);
        tensors
            .into_iter()
            .map(move |(n, t)| (format!("{prefix}{n}"), t))
    })
}

/// Implements [`ParamSet`] for a family's parameter struct from the names of its fields, so that
/// the listing of its tensors (views and mutable views alike) is written once for every family:
/// the stem (token embedding first), the blocks under `block_prefix{layer}.`, the tail, then the
/// untied head as [`LM_HEAD`].
macro_rules! param_set {
    (
        $params:ty {
            block: $block:ty,
            block_prefix: $prefix:literal,
            token_embedding: $embedding:ident,
            stem: [$(($stem_name:expr, $($stem:ident).+)),+ $(,)?],
            blocks: $blocks:ident,
            tail: [$(($tail_name:expr, $($tail:ident).+)),* $(,)?],
            lm_head: $head:ident $(,)?
        }
    ) => {
        impl $crate::decoder::ParamSet for $params {
            type Block = $block;
            const STEM_TENSORS: usize = [$($stem_name),+].len();

            fn block_prefix(layer: usize) -> String {
                format!("{}{layer}.", $prefix)
            }

            fn blocks(&self) -> &[$block] {
                &self.$blocks
            }

            fn blocks_mut(&mut self) -> &mut [$block] {
                &mut self.$blocks
            }

            fn tensors(&self) -> Vec<(String, ndarray::ArrayViewD<'_, f64>)> {
                $crate::decoder::param_set!(@list self, view, iter, tensors, as_ref,
                    [$(($stem_name, $($stem).+)),+], $blocks, [$(($tail_name, $($tail).+)),*], $head)
            }

            fn tensors_mut(&mut self) -> Vec<(String, ndarray::ArrayViewMutD<'_, f64>)> {
                $crate::decoder::param_set!(@list self, view_mut, iter_mut, tensors_mut, as_mut,
                    [$(($stem_name, $($stem).+)),+], $blocks, [$(($tail_name, $($tail).+)),*], $head)
            }

            fn token_embedding(&self) -> &ndarray::Array2<f64> {
                &self.$embedding
            }

            fn token_embedding_mut(&mut self) -> &mut ndarray::Array2<f64> {
                &mut self.$embedding
            }

            fn lm_head(&self) -> Option<&ndarray::Array2<f64>> {
                self.$head.as_ref()
            }

            fn lm_head_mut(&mut self) -> &mut Option<ndarray::Array2<f64>> {
                &mut self.$head
            }
        }
    };
    // Every tensor's (family-local name, view); `$view` is `view` or `view_mut`, and the rest
    // follow it.
    (@list $p:expr, $view:ident, $iter:ident, $each:ident, $option:ident,
        [$(($stem_name:expr, $($stem:ident).+)),+], $blocks:ident,
        [$(($tail_name:expr, $($tail:ident).+)),*], $head:ident) => {{
        let p = $p;
        let mut out = vec![$(($stem_name.to_string(), p.$($stem).+.$view().into_dyn())),+];
        out.extend($crate::decoder::prefixed_blocks::<Self, _>(
            p.$blocks.$iter().map(|b| $crate::decoder::BlockParams::$each(b)),
        ));
        $(out.push(($tail_name.to_string(), p.$($tail).+.$view().into_dyn()));)*
        if let Some(h) = p.$head.$option() {
            out.push(($crate::decoder::LM_HEAD.to_string(), h.$view().into_dyn()));
        }
        out
    }};
}
pub(crate) use param_set;

/// One family of decoder-only models. The skeleton calls, per example:
/// `embed` → `block_forward` for every layer → `final_norm` → head, then the backward passes in
/// reverse. Each backward accumulates into a zero gradient and records its sites (in forward
/// order, with checkpoint names) when `sites` is on.
pub trait DecoderModel: HasDims {
    /// The family's weights (and, in the same type, its gradients).
    type Params: ParamSet;
    /// What one block keeps from its forward pass for its backward pass.
    type BlockCache;

    /// The model's weights.
    fn params(&self) -> &Self::Params;
    /// Mutable access to the model's weights.
    fn params_mut(&mut self) -> &mut Self::Params;
    /// A zero gradient; `lm_head` is `None` (the skeleton fills it with the head path).
    fn zero_gradient(&self) -> Self::Params;
    /// A zero gradient of the tensors outside the blocks, with an empty (0×d) token embedding
    /// and no head: what the streamed reference keeps, the table's rows being few and the
    /// blocks reduced one at a time.
    fn zero_stem_gradient(&self) -> Self::Params;
    /// A zero gradient (or weight buffer) of one block.
    fn zero_block(&self) -> <Self::Params as ParamSet>::Block;
    /// The blocks' weights when they are kept in the checkpoint's dtype rather than in
    /// `params()` (whose blocks are then empty).
    fn stored_blocks(&self) -> Option<&StoredBlocks> {
        None
    }

    /// Block `layer`'s weights in f64: borrowed when resident, widened into `scratch` (reused
    /// from block to block) when stored.
    fn block_weights<'a>(
        &'a self,
        layer: usize,
        scratch: &'a mut Option<<Self::Params as ParamSet>::Block>,
    ) -> &'a <Self::Params as ParamSet>::Block {
        match self.stored_blocks() {
            None => &self.params().blocks()[layer],
            Some(stored) => {
                let buffer = scratch.get_or_insert_with(|| self.zero_block());
                stored.widen_into(layer, buffer.tensors_mut());
                buffer
            }
        }
    }

    /// Every weight in f64 by checkpoint name, in [`ParamSet::tensors`] order, stored blocks
    /// widened one at a time (so a caller that copies them never holds two f64 models).
    fn visit_weights(&self, visit: &mut dyn FnMut(String, ArrayViewD<'_, f64>)) {
        let params = self.params();
        let mut stem = params.tensors();
        // `tensors()` lists resident blocks too: every block is read through `block_weights`.
        let resident: usize = params.blocks().iter().map(|b| b.tensors().len()).sum();
        let first_block = <Self::Params as ParamSet>::STEM_TENSORS;
        let tail = stem.split_off(first_block + resident);
        stem.truncate(first_block);
        for (local, t) in stem {
            visit(self.param_name(&local), t);
        }
        let mut scratch = None;
        for l in 0..self.dims().layers {
            for (local, t) in self.block_weights(l, &mut scratch).tensors() {
                visit(self.block_param_name(l, &local), t);
            }
        }
        for (local, t) in tail {
            visit(self.param_name(&local), t);
        }
    }

    /// Checkpoint name of block `layer`'s tensor `local` (named relative to the block).
    fn block_param_name(&self, layer: usize, local: &str) -> String {
        self.param_name(&format!("{}{local}", Self::Params::block_prefix(layer)))
    }
    /// Checkpoint name of a tensor given its `ParamSet` name.
    fn param_name(&self, local: &str) -> String;
    /// (checkpoint name, shape) of every parameter in [`ParamSet::tensors`] order (the head
    /// only when untied), from the config: nothing is allocated.
    fn layout(&self) -> Vec<(String, Vec<usize>)>;
    /// `ParamSet` name of the token embedding.
    fn embedding_local_name(&self) -> &'static str;

    /// The input of the first block (T×d).
    fn embed(&self, ids: &[usize]) -> Array2<f64>;
    /// Accumulates the gradients of the embedding stage's tensors other than the token table
    /// (GPT-2's positions) and records their sites; the skeleton handles the token table, whose
    /// gradient is [`DecoderModel::embedding_backprops`] row by row.
    fn embed_backward(
        &self,
        _ids: &[usize],
        _dh: ArrayView2<f64>,
        _g: &mut Self::Params,
        _sites: Option<&mut Vec<SiteRecord>>,
    ) {
    }
    /// f64 entries one block's forward keeps for its backward at `seq_len` positions (an upper
    /// estimate from the config): what running one more example through the blocks together
    /// with others holds.
    fn block_cache_entries(&self, seq_len: usize) -> usize;
    /// Block `layer` with weights `w` (from [`DecoderModel::block_weights`]).
    fn block_forward(
        &self,
        layer: usize,
        w: &<Self::Params as ParamSet>::Block,
        h: Array2<f64>,
    ) -> (Self::BlockCache, Array2<f64>);
    /// The gradient of the block's input from the gradient of its output; the weights'
    /// gradients accumulate into `g`.
    fn block_backward(
        &self,
        layer: usize,
        w: &<Self::Params as ParamSet>::Block,
        cache: &Self::BlockCache,
        dh: Array2<f64>,
        g: &mut <Self::Params as ParamSet>::Block,
        sites: Option<&mut Vec<SiteRecord>>,
    ) -> Array2<f64>;
    /// The final norm over the last block's T×d output: its cache and the normalized rows.
    fn final_norm(&self, h: ArrayView2<f64>) -> (NormCache, Array2<f64>);
    /// Backward of [`DecoderModel::final_norm`]: accumulates its weight's gradient into `g` and
    /// returns the gradient with respect to its input.
    fn final_norm_backward(
        &self,
        dy: ArrayView2<f64>,
        cache: &NormCache,
        g: &mut Self::Params,
        sites: Option<&mut Vec<SiteRecord>>,
    ) -> Array2<f64>;

    /// The gradient of the token lookup's own output (T×d) from the gradient of the first
    /// block's input: what the table's input path accumulates, row x_t by row. GPT-2 adds its
    /// positions, so the two are equal; Gemma multiplies the lookup by √d, and HF's
    /// `nn.Embedding(padding_idx = pad_token_id)` gives its padding row no gradient.
    fn embedding_backprops(&self, _ids: &[usize], dh: ArrayView2<f64>) -> Array2<f64> {
        dh.to_owned()
    }

    /// `cap` of the final-logit soft-capping `cap · tanh(z / cap)` (Gemma 2), if any: the loss
    /// reads the capped logits, the head's site the gradient of the uncapped ones.
    fn final_logit_softcap(&self) -> Option<f64> {
        None
    }

    /// The head matrix (V×d), whichever tensor holds it.
    fn head(&self) -> &Array2<f64> {
        let p = self.params();
        p.lm_head().unwrap_or(p.token_embedding())
    }

    /// Checkpoint name of the tensor that the LM head reads: the embedding when tied.
    fn head_param_name(&self) -> String {
        if self.dims().tie_word_embeddings {
            self.param_name(self.embedding_local_name())
        } else {
            LM_HEAD.to_string()
        }
    }
}
