//! GPT-2 (HF `GPT2LMHeadModel`) as an instance of the decoder skeleton: parameters in f64 by the
//! names Hugging Face gives them, learned positions, LayerNorm, fused-QKV Conv1D attention and a
//! `gelu_new` MLP.

use crate::checkpoint::{
    read_checkpoint, write_checkpoint, Blocks, CheckpointLayout, FromCheckpoint,
};
use crate::decoder::{
    prefixed_blocks, BlockParams, DecoderModel, Dims, HasDims, ParamSet, LM_HEAD,
};
use crate::error::{bail, Result};
use crate::gpt2_config::Gpt2Config;
use crate::layers::{gelu_new, gelu_new_grad, Attention, Conv1d, LayerNorm, NormCache, Sites};
use crate::rng::SplitMix64;
use crate::site::SiteKind;
use crate::tensors::TensorSource;
use crate::trace::SiteRecord;
use ndarray::{s, Array2, ArrayView2, ArrayViewD, ArrayViewMutD};
use std::path::Path;

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
    pub wte: Array2<f64>,
    pub wpe: Array2<f64>,
    pub blocks: Vec<Block>,
    pub ln_f: LayerNorm,
    /// V×d (nn.Linear layout). `None` for a tied model's weights.
    pub lm_head: Option<Array2<f64>>,
}

/// A model: config, weights and the naming convention of the checkpoint it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Gpt2 {
    /// The model's hyperparameters.
    pub config: Gpt2Config,
    /// The weights.
    pub params: Gpt2Params,
    /// `"transformer."` for `GPT2LMHeadModel` checkpoints, `""` for original hub files.
    pub prefix: String,
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

const WTE: &str = "wte.weight";

impl Gpt2Params {
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

    pub fn tensors_mut(&mut self) -> Vec<(String, ArrayViewMutD<'_, f64>)> {
        ParamSet::tensors_mut(self)
    }
}

impl Block {
    fn zeros(cfg: &Gpt2Config) -> Self {
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

impl ParamSet for Gpt2Params {
    type Block = Block;
    const STEM_TENSORS: usize = 2;

    fn block_prefix(layer: usize) -> String {
        format!("h.{layer}.")
    }

    fn blocks(&self) -> &[Block] {
        &self.blocks
    }

    fn blocks_mut(&mut self) -> &mut [Block] {
        &mut self.blocks
    }

    fn tensors(&self) -> Vec<(String, ArrayViewD<'_, f64>)> {
        let mut out = vec![
            (WTE.to_string(), self.wte.view().into_dyn()),
            ("wpe.weight".to_string(), self.wpe.view().into_dyn()),
        ];
        out.extend(prefixed_blocks::<Self, _>(
            self.blocks.iter().map(|b| b.tensors()),
        ));
        out.push(("ln_f.weight".into(), self.ln_f.weight.view().into_dyn()));
        out.push(("ln_f.bias".into(), self.ln_f.bias.view().into_dyn()));
        if let Some(h) = &self.lm_head {
            out.push((LM_HEAD.into(), h.view().into_dyn()));
        }
        out
    }

    fn tensors_mut(&mut self) -> Vec<(String, ArrayViewMutD<'_, f64>)> {
        let mut out = vec![
            (WTE.to_string(), self.wte.view_mut().into_dyn()),
            ("wpe.weight".to_string(), self.wpe.view_mut().into_dyn()),
        ];
        out.extend(prefixed_blocks::<Self, _>(
            self.blocks.iter_mut().map(|b| b.tensors_mut()),
        ));
        out.push(("ln_f.weight".into(), self.ln_f.weight.view_mut().into_dyn()));
        out.push(("ln_f.bias".into(), self.ln_f.bias.view_mut().into_dyn()));
        if let Some(h) = &mut self.lm_head {
            out.push((LM_HEAD.into(), h.view_mut().into_dyn()));
        }
        out
    }

    fn token_embedding(&self) -> &Array2<f64> {
        &self.wte
    }

    fn token_embedding_mut(&mut self) -> &mut Array2<f64> {
        &mut self.wte
    }

    fn lm_head(&self) -> Option<&Array2<f64>> {
        self.lm_head.as_ref()
    }

    fn lm_head_mut(&mut self) -> &mut Option<Array2<f64>> {
        &mut self.lm_head
    }
}

impl Gpt2 {
    /// A seeded model with no files. Matrices are N(0, init_std²); LayerNorm weights 1 + N(0, 0.1²)
    /// and biases N(0, 0.1²) so that every parameter, LayerNorm included, has a generic gradient.
    pub fn random(config: Gpt2Config, seed: u64, init_std: f64) -> Self {
        let mut rng = SplitMix64::new(seed);
        let mut params = Gpt2Params::zeros(&config, !config.tie_word_embeddings);
        for (name, mut t) in params.tensors_mut() {
            let is_ln = name.contains("ln_");
            let is_ln_weight = is_ln && name.ends_with("weight");
            for v in t.iter_mut() {
                *v = if is_ln_weight {
                    1.0 + 0.1 * rng.normal()
                } else if is_ln {
                    0.1 * rng.normal()
                } else {
                    init_std * rng.normal()
                };
            }
        }
        Gpt2 {
            config,
            params,
            prefix: "transformer.".into(),
        }
    }

    /// Checkpoint name of a parameter given its transformer-relative name.
    pub fn param_name(&self, local: &str) -> String {
        if local == LM_HEAD {
            LM_HEAD.to_string()
        } else {
            format!("{}{local}", self.prefix)
        }
    }

    /// Checkpoint name of the tensor that the LM head reads: `wte` when tied.
    pub fn head_param_name(&self) -> String {
        DecoderModel::head_param_name(self)
    }

    /// The head matrix (V×d), whichever tensor holds it.
    pub fn head(&self) -> &Array2<f64> {
        DecoderModel::head(self)
    }

    /// Builds a model from a parsed config and the contents of `model.safetensors`.
    pub fn from_parts(config: Gpt2Config, bytes: &[u8], label: &str) -> Result<Self> {
        Self::build(config, bytes, label)
    }

    /// GPT-2 keeps its blocks resident whatever `Blocks` asks: its largest sizes fit in f64.
    fn from_source(config: Gpt2Config, st: &dyn TensorSource, label: &str) -> Result<Self> {
        let prefix = if st.has("transformer.wte.weight") {
            "transformer."
        } else if st.has("wte.weight") {
            ""
        } else {
            bail!("{label}: neither `transformer.wte.weight` nor `wte.weight` is present; is this a GPT-2 checkpoint?");
        };
        let untied = !config.tie_word_embeddings;
        let name = |local: &str| {
            if local == LM_HEAD {
                local.to_string()
            } else {
                format!("{prefix}{local}")
            }
        };
        let layout: Vec<(String, Vec<usize>)> = Gpt2Params::layout(&config, untied)
            .into_iter()
            .map(|(local, shape)| (name(&local), shape))
            .collect();
        let spec = CheckpointLayout {
            layout: &layout,
            layers: config.n_layer,
            block: Vec::new(),
            block_name: &|_, n| n.to_string(),
        };
        let (params, _) = read_checkpoint(
            st,
            label,
            &spec,
            Blocks::Resident,
            |_| Gpt2Params::zeros(&config, untied),
            |n| n.ends_with(".attn.bias") || n.ends_with(".attn.masked_bias"),
            config.tie_word_embeddings.then(|| name(WTE)),
            "GPT-2",
        )?;
        Ok(Gpt2 {
            config,
            params,
            prefix: prefix.into(),
        })
    }

    /// Writes `config.json` and `model.safetensors` (f64 or f32) the way `save_pretrained` lays
    /// them out, so that tests and examples can produce real checkpoints.
    pub fn save(&self, dir: &Path, f32_weights: bool) -> Result<()> {
        write_checkpoint(self, &self.config.to_json(), dir, f32_weights)
    }

    fn attention(&self, layer: usize) -> Attention {
        let cfg = &self.config;
        let mut scale = 1.0;
        if cfg.scale_attn_weights {
            scale /= (cfg.head_dim() as f64).sqrt();
        }
        if cfg.scale_attn_by_inverse_layer_idx {
            scale /= (layer + 1) as f64;
        }
        Attention {
            heads: cfg.n_head,
            kv_heads: cfg.n_head,
            head_dim: cfg.head_dim(),
            scale,
            softcap: None,
            window: None,
        }
    }
}

impl HasDims for Gpt2Config {
    fn dims(&self) -> Dims {
        Dims {
            vocab_size: self.vocab_size,
            max_positions: self.n_positions,
            positions_key: "n_positions",
            hidden_size: self.n_embd,
            layers: self.n_layer,
            tie_word_embeddings: self.tie_word_embeddings,
        }
    }
}

impl HasDims for Gpt2 {
    fn dims(&self) -> Dims {
        self.config.dims()
    }
}

impl FromCheckpoint for Gpt2 {
    type Config = Gpt2Config;

    fn parse_config(text: &str) -> Result<Gpt2Config> {
        Gpt2Config::from_json_str(text)
    }

    fn build_from(
        config: Gpt2Config,
        src: &dyn TensorSource,
        label: &str,
        _blocks: Blocks,
    ) -> Result<Gpt2> {
        Gpt2::from_source(config, src, label)
    }
}

/// What a GPT-2 block keeps from its forward pass.
pub struct Gpt2BlockCache {
    ln1: NormCache,
    a1: Array2<f64>,
    qkv: Array2<f64>,
    probs: Vec<Array2<f64>>,
    y: Array2<f64>,
    ln2: NormCache,
    a2: Array2<f64>,
    f_pre: Array2<f64>,
    f: Array2<f64>,
}

impl DecoderModel for Gpt2 {
    type Params = Gpt2Params;
    type BlockCache = Gpt2BlockCache;

    fn params(&self) -> &Gpt2Params {
        &self.params
    }

    fn params_mut(&mut self) -> &mut Gpt2Params {
        &mut self.params
    }

    fn zero_gradient(&self) -> Gpt2Params {
        Gpt2Params::zeros(&self.config, false)
    }

    fn zero_stem_gradient(&self) -> Gpt2Params {
        let d = self.config.n_embd;
        Gpt2Params {
            wte: Array2::zeros((0, d)),
            wpe: Array2::zeros((self.config.n_positions, d)),
            blocks: Vec::new(),
            ln_f: LayerNorm::zeros(d),
            lm_head: None,
        }
    }

    fn zero_block(&self) -> Block {
        Block::zeros(&self.config)
    }

    fn param_name(&self, local: &str) -> String {
        Gpt2::param_name(self, local)
    }

    fn layout(&self) -> Vec<(String, Vec<usize>)> {
        Gpt2Params::layout(&self.config, !self.config.tie_word_embeddings)
            .into_iter()
            .map(|(local, shape)| (self.param_name(&local), shape))
            .collect()
    }

    fn embedding_local_name(&self) -> &'static str {
        WTE
    }

    /// Token plus learned position embedding.
    fn embed(&self, ids: &[usize]) -> Array2<f64> {
        let p = &self.params;
        let mut h = Array2::<f64>::zeros((ids.len(), self.config.n_embd));
        for (t, &x) in ids.iter().enumerate() {
            h.row_mut(t).assign(&(&p.wte.row(x) + &p.wpe.row(t)));
        }
        h
    }

    /// The position table (the skeleton handles `wte`).
    fn embed_backward(
        &self,
        ids: &[usize],
        dh: ArrayView2<f64>,
        g: &mut Gpt2Params,
        sites: Option<&mut Vec<SiteRecord>>,
    ) {
        for t in 0..ids.len() {
            let mut r = g.wpe.row_mut(t);
            r += &dh.row(t);
        }
        let wpe = self.param_name("wpe.weight");
        let positions: Vec<usize> = (0..ids.len()).collect();
        Sites(sites).push(|| {
            SiteRecord::embedding(
                wpe.clone(),
                wpe,
                self.config.n_positions,
                positions,
                dh.to_owned(),
            )
        });
    }

    fn block_cache_entries(&self, seq_len: usize) -> usize {
        let c = &self.config;
        // ln1's and ln2's x̂ and rstd, a1, qkv (3d), y, a2, f_pre and f; the probabilities.
        seq_len * (8 * c.n_embd + 2 * c.n_inner + 2) + c.n_head * seq_len * seq_len
    }

    fn block_forward(
        &self,
        layer: usize,
        b: &Block,
        h: Array2<f64>,
    ) -> (Gpt2BlockCache, Array2<f64>) {
        let eps = self.config.layer_norm_epsilon;
        let d = self.config.n_embd;
        let (ln1, a1) = b.ln_1.forward(h.view(), eps);
        let qkv = b.c_attn.forward(a1.view());
        let (probs, y) = self.attention(layer).forward(
            qkv.slice(s![.., ..d]),
            qkv.slice(s![.., d..2 * d]),
            qkv.slice(s![.., 2 * d..]),
        );
        let h = h + b.attn_proj.forward(y.view());
        let (ln2, a2) = b.ln_2.forward(h.view(), eps);
        let f_pre = b.c_fc.forward(a2.view());
        let f = f_pre.mapv(gelu_new);
        let h = h + b.mlp_proj.forward(f.view());
        let cache = Gpt2BlockCache {
            ln1,
            a1,
            qkv,
            probs,
            y,
            ln2,
            a2,
            f_pre,
            f,
        };
        (cache, h)
    }

    fn block_backward(
        &self,
        layer: usize,
        b: &Block,
        c: &Gpt2BlockCache,
        dh: Array2<f64>,
        gb: &mut Block,
        sites: Option<&mut Vec<SiteRecord>>,
    ) -> Array2<f64> {
        let d = self.config.n_embd;
        // MLP: h_out = h_mid + c_proj(gelu(c_fc(ln_2(h_mid)))).
        let df = b.mlp_proj.backward(c.f.view(), dh.view(), &mut gb.mlp_proj);
        let mut df_pre = df;
        df_pre.zip_mut_with(&c.f_pre, |g_, &x| *g_ *= gelu_new_grad(x));
        let da2 = b.c_fc.backward(c.a2.view(), df_pre.view(), &mut gb.c_fc);
        let dh_mid = &dh + &b.ln_2.backward(da2.view(), &c.ln2, &mut gb.ln_2);
        // Attention: h_mid = h_in + c_proj(attn(c_attn(ln_1(h_in)))).
        let dy = b
            .attn_proj
            .backward(c.y.view(), dh_mid.view(), &mut gb.attn_proj);
        let (dq, dk, dv) = self.attention(layer).backward(
            (
                c.qkv.slice(s![.., ..d]),
                c.qkv.slice(s![.., d..2 * d]),
                c.qkv.slice(s![.., 2 * d..]),
            ),
            &c.probs,
            dy.view(),
        );
        let mut dqkv = Array2::<f64>::zeros(c.qkv.raw_dim());
        dqkv.slice_mut(s![.., ..d]).assign(&dq);
        dqkv.slice_mut(s![.., d..2 * d]).assign(&dk);
        dqkv.slice_mut(s![.., 2 * d..]).assign(&dv);
        let da1 = b.c_attn.backward(c.a1.view(), dqkv.view(), &mut gb.c_attn);
        let dh_in = &dh_mid + &b.ln_1.backward(da1.view(), &c.ln1, &mut gb.ln_1);

        let mut sites = Sites(sites);
        if sites.on() {
            let h = |n: &str| self.block_param_name(layer, n);
            sites.norm(&h("ln_1"), true, &c.ln1, da1.view());
            let conv = |sites: &mut Sites, n: &str, a: &Array2<f64>, bp: &Array2<f64>| {
                sites.weight(
                    h(&format!("{n}.weight")),
                    Some(h(&format!("{n}.bias"))),
                    SiteKind::Conv1d,
                    a.view(),
                    bp.view(),
                )
            };
            conv(&mut sites, "attn.c_attn", &c.a1, &dqkv);
            conv(&mut sites, "attn.c_proj", &c.y, &dh_mid);
            sites.norm(&h("ln_2"), true, &c.ln2, da2.view());
            conv(&mut sites, "mlp.c_fc", &c.a2, &df_pre);
            conv(&mut sites, "mlp.c_proj", &c.f, &dh);
        }
        dh_in
    }

    fn final_norm(&self, h: ArrayView2<f64>) -> (NormCache, Array2<f64>) {
        self.params.ln_f.forward(h, self.config.layer_norm_epsilon)
    }

    fn final_norm_backward(
        &self,
        dy: ArrayView2<f64>,
        cache: &NormCache,
        g: &mut Gpt2Params,
        sites: Option<&mut Vec<SiteRecord>>,
    ) -> Array2<f64> {
        Sites(sites).norm(&self.param_name("ln_f"), true, cache, dy);
        self.params.ln_f.backward(dy, cache, &mut g.ln_f)
    }
}
