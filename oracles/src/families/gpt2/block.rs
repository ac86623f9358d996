//! GPT-2's forward and backward passes (pre-LayerNorm blocks, fused-QKV Conv1D attention, a
//! `gelu_new` MLP) and the sites they record: its instance of the decoder skeleton.

use super::params::{Block, Gpt2Params, WTE};
use super::Gpt2;
use crate::decoder::DecoderModel;
use crate::layers::{gelu_new, gelu_new_grad, Attention, LayerNorm, NormCache, Sites};
use crate::site::SiteKind;
use crate::trace::SiteRecord;
use ndarray::{s, Array2, ArrayView2};

impl Gpt2 {
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
