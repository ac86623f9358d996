//! Per-example forward and explicit backward of HF GPT-2 in f64. Nothing here is clever: every
//! intermediate is kept, every parameter gradient is materialized, so that the result can be
//! checked line by line against the definition and against finite differences.

use crate::batch::Batch;
use crate::model::{Block, Conv1d, Gpt2, LayerNorm, Params};
use crate::trace::{SiteKind, SiteRecord};
use ndarray::{s, Array1, Array2, ArrayView1, ArrayView2, Axis};

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

/// Forward intermediates of one LayerNorm application.
struct LnCache {
    xhat: Array2<f64>,
    rstd: Array1<f64>,
}

struct LayerCache {
    ln1: LnCache,
    a1: Array2<f64>,
    qkv: Array2<f64>,
    probs: Vec<Array2<f64>>,
    y: Array2<f64>,
    ln2: LnCache,
    a2: Array2<f64>,
    f_pre: Array2<f64>,
    f: Array2<f64>,
}

struct Forward {
    layers: Vec<LayerCache>,
    lnf: LnCache,
    af: Array2<f64>,
    logits: Array2<f64>,
}

pub struct ExampleGradient {
    pub loss: f64,
    /// Materialized gradient; for a tied model `wte` is the input path and `lm_head` the head path.
    pub grad: Params,
    /// The per-site factors of this example, in site order, when asked for.
    pub sites: Option<Vec<SiteRecord>>,
}

fn layernorm(x: ArrayView2<f64>, ln: &LayerNorm, eps: f64) -> (LnCache, Array2<f64>) {
    let d = x.ncols() as f64;
    let mean = x.sum_axis(Axis(1)) / d;
    let centered = &x - &mean.view().insert_axis(Axis(1));
    let var = centered.mapv(|v| v * v).sum_axis(Axis(1)) / d;
    let rstd = var.mapv(|v| 1.0 / (v + eps).sqrt());
    let xhat = &centered * &rstd.view().insert_axis(Axis(1));
    let out = &xhat * &ln.weight + &ln.bias;
    (LnCache { xhat, rstd }, out)
}

/// Returns dx and accumulates the weight and bias gradients.
fn layernorm_backward(
    dy: ArrayView2<f64>,
    c: &LnCache,
    ln: &LayerNorm,
    g: &mut LayerNorm,
) -> Array2<f64> {
    g.weight += &(&dy * &c.xhat).sum_axis(Axis(0));
    g.bias += &dy.sum_axis(Axis(0));
    let d = dy.ncols() as f64;
    let dxhat = &dy * &ln.weight;
    let mean_dxhat = dxhat.sum_axis(Axis(1)) / d;
    let mean_dxhat_xhat = (&dxhat * &c.xhat).sum_axis(Axis(1)) / d;
    let inner = &dxhat
        - &mean_dxhat.insert_axis(Axis(1))
        - &(&c.xhat * &mean_dxhat_xhat.insert_axis(Axis(1)));
    inner * c.rstd.view().insert_axis(Axis(1))
}

const GELU_C: f64 = 0.797_884_560_802_865_4; // sqrt(2/pi)

fn gelu_new(x: f64) -> f64 {
    0.5 * x * (1.0 + (GELU_C * (x + 0.044715 * x * x * x)).tanh())
}

fn gelu_new_grad(x: f64) -> f64 {
    let th = (GELU_C * (x + 0.044715 * x * x * x)).tanh();
    0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * GELU_C * (1.0 + 3.0 * 0.044715 * x * x)
}

fn conv1d(x: ArrayView2<f64>, c: &Conv1d) -> Array2<f64> {
    x.dot(&c.weight) + &c.bias
}

/// Accumulates a Conv1D's gradients and returns the gradient of its input.
fn conv1d_backward(
    x: ArrayView2<f64>,
    dy: ArrayView2<f64>,
    c: &Conv1d,
    g: &mut Conv1d,
) -> Array2<f64> {
    g.weight += &x.t().dot(&dy);
    g.bias += &dy.sum_axis(Axis(0));
    dy.dot(&c.weight.t())
}

fn attn_scale(model: &Gpt2, layer: usize) -> f64 {
    let cfg = &model.config;
    let mut scale = 1.0;
    if cfg.scale_attn_weights {
        scale /= (cfg.head_dim() as f64).sqrt();
    }
    if cfg.scale_attn_by_inverse_layer_idx {
        scale /= (layer + 1) as f64;
    }
    scale
}

fn forward(model: &Gpt2, ids: &[usize]) -> Forward {
    let cfg = &model.config;
    let p = &model.params;
    let (t_len, d, hd) = (ids.len(), cfg.n_embd, cfg.head_dim());
    let mut h = Array2::<f64>::zeros((t_len, d));
    for (t, &x) in ids.iter().enumerate() {
        h.row_mut(t).assign(&(&p.wte.row(x) + &p.wpe.row(t)));
    }
    let mut layers = Vec::with_capacity(cfg.n_layer);
    for (l, b) in p.blocks.iter().enumerate() {
        let (ln1, a1) = layernorm(h.view(), &b.ln_1, cfg.layer_norm_epsilon);
        let qkv = conv1d(a1.view(), &b.c_attn);
        let scale = attn_scale(model, l);
        let mut y = Array2::<f64>::zeros((t_len, d));
        let mut probs = Vec::with_capacity(cfg.n_head);
        for head in 0..cfg.n_head {
            let q = qkv.slice(s![.., head * hd..(head + 1) * hd]);
            let k = qkv.slice(s![.., d + head * hd..d + (head + 1) * hd]);
            let v = qkv.slice(s![.., 2 * d + head * hd..2 * d + (head + 1) * hd]);
            let mut pr = q.dot(&k.t()) * scale;
            for t in 0..t_len {
                let mut row = pr.row_mut(t);
                let m = row
                    .slice(s![..=t])
                    .fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                let mut z = 0.0;
                for s_ in 0..t_len {
                    row[s_] = if s_ <= t { (row[s_] - m).exp() } else { 0.0 };
                    z += row[s_];
                }
                row /= z;
            }
            y.slice_mut(s![.., head * hd..(head + 1) * hd])
                .assign(&pr.dot(&v));
            probs.push(pr);
        }
        h = h + conv1d(y.view(), &b.attn_proj);
        let (ln2, a2) = layernorm(h.view(), &b.ln_2, cfg.layer_norm_epsilon);
        let f_pre = conv1d(a2.view(), &b.c_fc);
        let f = f_pre.mapv(gelu_new);
        h = h + conv1d(f.view(), &b.mlp_proj);
        layers.push(LayerCache {
            ln1,
            a1,
            qkv,
            probs,
            y,
            ln2,
            a2,
            f_pre,
            f,
        });
    }
    let (lnf, af) = layernorm(h.view(), &p.ln_f, cfg.layer_norm_epsilon);
    let logits = af.dot(&model.head().t());
    Forward {
        layers,
        lnf,
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

/// The example's loss only (used by the finite-difference checks).
pub fn example_loss(
    model: &Gpt2,
    ids: &[usize],
    targets: &[(usize, usize)],
    reduction: Reduction,
) -> f64 {
    let fw = forward(model, ids);
    let w = loss_weight(targets, reduction);
    targets
        .iter()
        .map(|&(t, y)| log_sum_exp(fw.logits.row(t)) - fw.logits[(t, y)])
        .sum::<f64>()
        * w
}

pub fn example_gradient(
    model: &Gpt2,
    batch: &Batch,
    example: usize,
    reduction: Reduction,
    record_sites: bool,
) -> ExampleGradient {
    let ids = batch.ids(example);
    let targets = batch.targets(example);
    let cfg = &model.config;
    let p = &model.params;
    let (t_len, d, hd) = (ids.len(), cfg.n_embd, cfg.head_dim());
    let fw = forward(model, &ids);
    let w = loss_weight(&targets, reduction);

    let mut loss = 0.0;
    let mut dlogits = Array2::<f64>::zeros(fw.logits.raw_dim());
    for &(t, y) in &targets {
        let row = fw.logits.row(t);
        let lse = log_sum_exp(row);
        loss += lse - row[y];
        let mut drow = dlogits.row_mut(t);
        drow.assign(&row.mapv(|v| (v - lse).exp() * w));
        drow[y] -= w;
    }
    loss *= w;

    // Every gradient starts at zero; tied models keep the head path in `lm_head`.
    let mut g = Params::zeros(cfg, true);
    let mut sites: Vec<SiteRecord> = Vec::new();
    let pn = |local: &str| model.param_name(local);

    let head_grad = dlogits.t().dot(&fw.af);
    g.lm_head = Some(head_grad);
    let d_af = dlogits.dot(model.head());
    let mut dh = layernorm_backward(d_af.view(), &fw.lnf, &p.ln_f, &mut g.ln_f);
    let mut block_sites: Vec<Vec<SiteRecord>> = Vec::new();

    for l in (0..cfg.n_layer).rev() {
        let (b, c): (&Block, &LayerCache) = (&p.blocks[l], &fw.layers[l]);
        let gb = &mut g.blocks[l];
        let mut rec: Vec<SiteRecord> = Vec::new();
        // MLP: h_out = h_mid + c_proj(gelu(c_fc(ln_2(h_mid)))).
        let dp = dh.clone();
        let df = conv1d_backward(c.f.view(), dp.view(), &b.mlp_proj, &mut gb.mlp_proj);
        let mut df_pre = df;
        df_pre.zip_mut_with(&c.f_pre, |g_, &x| *g_ *= gelu_new_grad(x));
        let da2 = conv1d_backward(c.a2.view(), df_pre.view(), &b.c_fc, &mut gb.c_fc);
        let dh_mid = &dh + &layernorm_backward(da2.view(), &c.ln2, &b.ln_2, &mut gb.ln_2);
        // Attention: h_mid = h_in + c_proj(attn(c_attn(ln_1(h_in)))).
        let dy = conv1d_backward(c.y.view(), dh_mid.view(), &b.attn_proj, &mut gb.attn_proj);
        let scale = attn_scale(model, l);
        let mut dqkv = Array2::<f64>::zeros((t_len, 3 * d));
        for head in 0..cfg.n_head {
            let (qs, ks, vs) = (head * hd, d + head * hd, 2 * d + head * hd);
            let q = c.qkv.slice(s![.., qs..qs + hd]);
            let k = c.qkv.slice(s![.., ks..ks + hd]);
            let v = c.qkv.slice(s![.., vs..vs + hd]);
            let pr = &c.probs[head];
            let dyh = dy.slice(s![.., qs..qs + hd]);
            let dpr = dyh.dot(&v.t());
            let dv = pr.t().dot(&dyh);
            let rowdot = (pr * &dpr).sum_axis(Axis(1));
            let ds = pr * &(&dpr - &rowdot.insert_axis(Axis(1)));
            dqkv.slice_mut(s![.., qs..qs + hd])
                .assign(&(ds.dot(&k) * scale));
            dqkv.slice_mut(s![.., ks..ks + hd])
                .assign(&(ds.t().dot(&q) * scale));
            dqkv.slice_mut(s![.., vs..vs + hd]).assign(&dv);
        }
        let da1 = conv1d_backward(c.a1.view(), dqkv.view(), &b.c_attn, &mut gb.c_attn);
        dh = &dh_mid + &layernorm_backward(da1.view(), &c.ln1, &b.ln_1, &mut gb.ln_1);

        if record_sites {
            let h = |n: &str| pn(&format!("h.{l}.{n}"));
            rec.push(SiteRecord::dense(
                h("ln_1.weight"),
                SiteKind::LayerNorm,
                c.ln1.xhat.clone(),
                da1.clone(),
            ));
            rec.push(SiteRecord::bias(h("ln_1.bias"), da1));
            rec.push(SiteRecord::dense(
                h("attn.c_attn.weight"),
                SiteKind::Conv1d,
                c.a1.clone(),
                dqkv.clone(),
            ));
            rec.push(SiteRecord::bias(h("attn.c_attn.bias"), dqkv));
            rec.push(SiteRecord::dense(
                h("attn.c_proj.weight"),
                SiteKind::Conv1d,
                c.y.clone(),
                dh_mid.clone(),
            ));
            rec.push(SiteRecord::bias(h("attn.c_proj.bias"), dh_mid));
            rec.push(SiteRecord::dense(
                h("ln_2.weight"),
                SiteKind::LayerNorm,
                c.ln2.xhat.clone(),
                da2.clone(),
            ));
            rec.push(SiteRecord::bias(h("ln_2.bias"), da2));
            rec.push(SiteRecord::dense(
                h("mlp.c_fc.weight"),
                SiteKind::Conv1d,
                c.a2.clone(),
                df_pre.clone(),
            ));
            rec.push(SiteRecord::bias(h("mlp.c_fc.bias"), df_pre));
            rec.push(SiteRecord::dense(
                h("mlp.c_proj.weight"),
                SiteKind::Conv1d,
                c.f.clone(),
                dp.clone(),
            ));
            rec.push(SiteRecord::bias(h("mlp.c_proj.bias"), dp));
            block_sites.push(rec);
        }
    }
    for (t, &x) in ids.iter().enumerate() {
        let mut r = g.wte.row_mut(x);
        r += &dh.row(t);
        let mut r = g.wpe.row_mut(t);
        r += &dh.row(t);
    }

    if record_sites {
        let positions: Vec<usize> = (0..t_len).collect();
        sites.push(SiteRecord::embedding(
            pn("wte.weight"),
            pn("wte.weight"),
            cfg.vocab_size,
            ids.clone(),
            dh.clone(),
        ));
        sites.push(SiteRecord::embedding(
            pn("wpe.weight"),
            pn("wpe.weight"),
            cfg.n_positions,
            positions,
            dh.clone(),
        ));
        for rec in block_sites.into_iter().rev() {
            sites.extend(rec);
        }
        sites.push(SiteRecord::dense(
            pn("ln_f.weight"),
            SiteKind::LayerNorm,
            fw.lnf.xhat.clone(),
            d_af.clone(),
        ));
        sites.push(SiteRecord::bias(pn("ln_f.bias"), d_af));
        let mut head = SiteRecord::dense(
            crate::model::LM_HEAD.into(),
            SiteKind::Linear,
            fw.af.clone(),
            dlogits,
        );
        head.param = model.head_param_name();
        sites.push(head);
    }
    ExampleGradient {
        loss,
        grad: g,
        sites: record_sites.then_some(sites),
    }
}
