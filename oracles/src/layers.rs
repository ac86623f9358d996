//! The building blocks every decoder family is made of, each with its forward pass, its explicit
//! backward pass and the sites it records. Nothing here is clever: the backward of every block
//! is the textbook one, so that it can be read against its definition.

use crate::matmul::{product, product_into, Accumulate};
use crate::site::SiteKind;
use crate::trace::SiteRecord;
use ndarray::{s, Array1, Array2, ArrayView2, Axis};

/// `y = x̂ ⊙ w + b` with x̂ the standardized input.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerNorm {
    pub weight: Array1<f64>,
    pub bias: Array1<f64>,
}

/// RMSNorm: `y = (offset + w) ⊙ x / sqrt(mean(x²) + eps)`. Llama's `LlamaRMSNorm` has offset 0;
/// Gemma's stores its weight around zero and scales by `1 + w` (offset 1). The weight's gradient
/// is Σ_t dy_t ⊙ x̂_t either way.
#[derive(Clone, Debug, PartialEq)]
pub struct RmsNorm {
    pub weight: Array1<f64>,
}

/// HF `Conv1D`: `y = x W + b` with `W` stored in×out.
#[derive(Clone, Debug, PartialEq)]
pub struct Conv1d {
    pub weight: Array2<f64>,
    pub bias: Array1<f64>,
}

/// `nn.Linear`: `y = x Wᵀ + b` with `W` stored out×in; the bias is optional.
#[derive(Clone, Debug, PartialEq)]
pub struct Linear {
    pub weight: Array2<f64>,
    pub bias: Option<Array1<f64>>,
}

/// Forward intermediates of one normalization: the normalized input x̂ (what the weight's site
/// records as activations) and the reciprocal of the per-row scale.
pub struct NormCache {
    pub xhat: Array2<f64>,
    pub rstd: Array1<f64>,
}

/// `acc += a · b` without a temporary (every gradient of a matrix goes through here).
pub(crate) fn add_product(acc: &mut Array2<f64>, a: ArrayView2<f64>, b: ArrayView2<f64>) {
    product_into(1.0, a, b, Accumulate::Add, acc.view_mut());
}

impl LayerNorm {
    pub(crate) fn zeros(d: usize) -> Self {
        LayerNorm {
            weight: Array1::zeros(d),
            bias: Array1::zeros(d),
        }
    }

    pub(crate) fn forward(&self, x: ArrayView2<f64>, eps: f64) -> (NormCache, Array2<f64>) {
        let d = x.ncols() as f64;
        let mean = x.sum_axis(Axis(1)) / d;
        let centered = &x - &mean.view().insert_axis(Axis(1));
        let var = centered.mapv(|v| v * v).sum_axis(Axis(1)) / d;
        let rstd = var.mapv(|v| 1.0 / (v + eps).sqrt());
        let xhat = &centered * &rstd.view().insert_axis(Axis(1));
        let out = &xhat * &self.weight + &self.bias;
        (NormCache { xhat, rstd }, out)
    }

    /// Returns dx and accumulates the weight and bias gradients.
    pub(crate) fn backward(
        &self,
        dy: ArrayView2<f64>,
        c: &NormCache,
        g: &mut LayerNorm,
    ) -> Array2<f64> {
        g.weight += &(&dy * &c.xhat).sum_axis(Axis(0));
        g.bias += &dy.sum_axis(Axis(0));
        let d = dy.ncols() as f64;
        let dxhat = &dy * &self.weight;
        let mean_dxhat = dxhat.sum_axis(Axis(1)) / d;
        let mean_dxhat_xhat = (&dxhat * &c.xhat).sum_axis(Axis(1)) / d;
        let inner = &dxhat
            - &mean_dxhat.insert_axis(Axis(1))
            - &(&c.xhat * &mean_dxhat_xhat.insert_axis(Axis(1)));
        inner * c.rstd.view().insert_axis(Axis(1))
    }
}

impl RmsNorm {
    pub(crate) fn zeros(d: usize) -> Self {
        RmsNorm {
            weight: Array1::zeros(d),
        }
    }

    pub(crate) fn forward(
        &self,
        x: ArrayView2<f64>,
        eps: f64,
        offset: f64,
    ) -> (NormCache, Array2<f64>) {
        let d = x.ncols() as f64;
        let ms = x.mapv(|v| v * v).sum_axis(Axis(1)) / d;
        let rstd = ms.mapv(|v| 1.0 / (v + eps).sqrt());
        let xhat = &x * &rstd.view().insert_axis(Axis(1));
        let out = &xhat * &self.weight.mapv(|w| offset + w);
        (NormCache { xhat, rstd }, out)
    }

    /// Returns dx and accumulates the weight gradient Σ_t dy_t ⊙ x̂_t.
    ///
    /// With x̂ = x·r and r = (mean(x²) + eps)^(-1/2): dx = r·(dx̂ − x̂·mean(dx̂ ⊙ x̂)),
    /// dx̂ = dy ⊙ (offset + w).
    pub(crate) fn backward(
        &self,
        dy: ArrayView2<f64>,
        c: &NormCache,
        offset: f64,
        g: &mut RmsNorm,
    ) -> Array2<f64> {
        g.weight += &(&dy * &c.xhat).sum_axis(Axis(0));
        let d = dy.ncols() as f64;
        let dxhat = &dy * &self.weight.mapv(|w| offset + w);
        let mean_dxhat_xhat = (&dxhat * &c.xhat).sum_axis(Axis(1)) / d;
        let inner = &dxhat - &(&c.xhat * &mean_dxhat_xhat.insert_axis(Axis(1)));
        inner * c.rstd.view().insert_axis(Axis(1))
    }
}

impl Conv1d {
    pub(crate) fn zeros(input: usize, out: usize) -> Self {
        Conv1d {
            weight: Array2::zeros((input, out)),
            bias: Array1::zeros(out),
        }
    }

    pub(crate) fn forward(&self, x: ArrayView2<f64>) -> Array2<f64> {
        product(x, self.weight.view()) + &self.bias
    }

    /// Accumulates the gradients and returns the gradient of the input.
    pub(crate) fn backward(
        &self,
        x: ArrayView2<f64>,
        dy: ArrayView2<f64>,
        g: &mut Conv1d,
    ) -> Array2<f64> {
        add_product(&mut g.weight, x.t(), dy);
        g.bias += &dy.sum_axis(Axis(0));
        product(dy, self.weight.t())
    }
}

impl Linear {
    pub(crate) fn zeros(input: usize, out: usize, bias: bool) -> Self {
        Linear {
            weight: Array2::zeros((out, input)),
            bias: bias.then(|| Array1::zeros(out)),
        }
    }

    pub(crate) fn forward(&self, x: ArrayView2<f64>) -> Array2<f64> {
        let y = product(x, self.weight.t());
        match &self.bias {
            Some(b) => y + b,
            None => y,
        }
    }

    /// Accumulates the gradients and returns the gradient of the input.
    pub(crate) fn backward(
        &self,
        x: ArrayView2<f64>,
        dy: ArrayView2<f64>,
        g: &mut Linear,
    ) -> Array2<f64> {
        add_product(&mut g.weight, dy.t(), x);
        if let Some(gb) = &mut g.bias {
            *gb += &dy.sum_axis(Axis(0));
        }
        product(dy, self.weight.view())
    }
}

/// Causal softmax attention with grouped-query heads: query head h reads key/value head
/// h / (heads / kv_heads), as HF's `repeat_kv` does. Plain multi-head attention is kv_heads =
/// heads. Optionally the scaled scores are soft-capped (`cap · tanh(s / cap)`, Gemma 2) before
/// the mask, and a sliding window lets position t see only the `window` positions up to and
/// including t (HF's `kv_idx > q_idx - sliding_window`).
pub(crate) struct Attention {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f64,
    pub softcap: Option<f64>,
    pub window: Option<usize>,
}

impl Attention {
    fn kv_head(&self, head: usize) -> usize {
        head / (self.heads / self.kv_heads)
    }

    /// The first key position query `t` sees.
    fn first_key(&self, t: usize) -> usize {
        match self.window {
            Some(w) => (t + 1).saturating_sub(w),
            None => 0,
        }
    }

    /// q: T×(heads·hd), k and v: T×(kv_heads·hd). Returns every head's probabilities (T×T) and
    /// the output (T×(heads·hd)).
    pub(crate) fn forward(
        &self,
        q: ArrayView2<f64>,
        k: ArrayView2<f64>,
        v: ArrayView2<f64>,
    ) -> (Vec<Array2<f64>>, Array2<f64>) {
        let (t_len, hd) = (q.nrows(), self.head_dim);
        let mut y = Array2::<f64>::zeros((t_len, self.heads * hd));
        let mut probs = Vec::with_capacity(self.heads);
        for head in 0..self.heads {
            let (qs, ks) = (head * hd, self.kv_head(head) * hd);
            let qh = q.slice(s![.., qs..qs + hd]);
            let kh = k.slice(s![.., ks..ks + hd]);
            let vh = v.slice(s![.., ks..ks + hd]);
            let mut pr = qh.dot(&kh.t()) * self.scale;
            if let Some(cap) = self.softcap {
                pr.mapv_inplace(|x| cap * (x / cap).tanh());
            }
            for t in 0..t_len {
                let first = self.first_key(t);
                let mut row = pr.row_mut(t);
                let m = row
                    .slice(s![first..=t])
                    .fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                let mut z = 0.0;
                for s_ in 0..t_len {
                    row[s_] = if (first..=t).contains(&s_) {
                        (row[s_] - m).exp()
                    } else {
                        0.0
                    };
                    z += row[s_];
                }
                row /= z;
            }
            y.slice_mut(s![.., qs..qs + hd]).assign(&pr.dot(&vh));
            probs.push(pr);
        }
        (probs, y)
    }

    /// Gradients of q, k and v from the gradient of the output. A key/value head's gradient is
    /// the sum over the query heads that share it.
    pub(crate) fn backward(
        &self,
        (q, k, v): (ArrayView2<f64>, ArrayView2<f64>, ArrayView2<f64>),
        probs: &[Array2<f64>],
        dy: ArrayView2<f64>,
    ) -> (Array2<f64>, Array2<f64>, Array2<f64>) {
        let hd = self.head_dim;
        let mut dq = Array2::<f64>::zeros(q.raw_dim());
        let mut dk = Array2::<f64>::zeros(k.raw_dim());
        let mut dv = Array2::<f64>::zeros(v.raw_dim());
        for (head, pr) in probs.iter().enumerate() {
            let (qs, ks) = (head * hd, self.kv_head(head) * hd);
            let qh = q.slice(s![.., qs..qs + hd]);
            let kh = k.slice(s![.., ks..ks + hd]);
            let vh = v.slice(s![.., ks..ks + hd]);
            let dyh = dy.slice(s![.., qs..qs + hd]);
            let dpr = dyh.dot(&vh.t());
            let rowdot = (pr * &dpr).sum_axis(Axis(1));
            let mut ds = pr * &(&dpr - &rowdot.insert_axis(Axis(1)));
            if let Some(cap) = self.softcap {
                // d/dx cap·tanh(x/cap) = 1 − tanh²(x/cap), at the uncapped scaled scores.
                let raw = qh.dot(&kh.t()) * self.scale;
                ds.zip_mut_with(&raw, |d, &x| *d *= 1.0 - (x / cap).tanh().powi(2));
            }
            dq.slice_mut(s![.., qs..qs + hd])
                .assign(&(ds.dot(&kh) * self.scale));
            let mut dkh = dk.slice_mut(s![.., ks..ks + hd]);
            dkh += &(ds.t().dot(&qh) * self.scale);
            let mut dvh = dv.slice_mut(s![.., ks..ks + hd]);
            dvh += &pr.t().dot(&dyh);
        }
        (dq, dk, dv)
    }
}

/// Rotary position embedding in HF's rotate-half layout, positions 0..T-1: within each head,
/// dimension i and i + hd/2 rotate by the angle t·inv_freq[i]. A fixed rotation, so its
/// backward is its transpose.
pub(crate) struct Rope {
    cos: Array2<f64>,
    sin: Array2<f64>,
}

impl Rope {
    pub(crate) fn new(inv_freq: &[f64], t_len: usize) -> Self {
        let angle = Array2::from_shape_fn((t_len, inv_freq.len()), |(t, i)| t as f64 * inv_freq[i]);
        Rope {
            cos: angle.mapv(f64::cos),
            sin: angle.mapv(f64::sin),
        }
    }

    /// Rotates every head of `x` (T×(heads·hd)) in place; `transpose` applies the inverse.
    pub(crate) fn rotate(&self, x: &mut Array2<f64>, transpose: bool) {
        let half = self.cos.ncols();
        let heads = x.ncols() / (2 * half);
        let sign = if transpose { -1.0 } else { 1.0 };
        for (t, mut row) in x.rows_mut().into_iter().enumerate() {
            for h in 0..heads {
                let base = h * 2 * half;
                for i in 0..half {
                    let (c, sn) = (self.cos[(t, i)], sign * self.sin[(t, i)]);
                    let (x1, x2) = (row[base + i], row[base + half + i]);
                    row[base + i] = x1 * c - x2 * sn;
                    row[base + half + i] = x2 * c + x1 * sn;
                }
            }
        }
    }
}

const GELU_C: f64 = 0.797_884_560_802_865_4; // sqrt(2/pi)

/// GPT-2's `gelu_new` (tanh form), which is also Gemma's `gelu_pytorch_tanh`.
pub(crate) fn gelu_new(x: f64) -> f64 {
    0.5 * x * (1.0 + (GELU_C * (x + 0.044715 * x * x * x)).tanh())
}

pub(crate) fn gelu_new_grad(x: f64) -> f64 {
    let th = (GELU_C * (x + 0.044715 * x * x * x)).tanh();
    0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * GELU_C * (1.0 + 3.0 * 0.044715 * x * x)
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// `silu(x) = x·σ(x)`.
pub(crate) fn silu(x: f64) -> f64 {
    x * sigmoid(x)
}

pub(crate) fn silu_grad(x: f64) -> f64 {
    let s = sigmoid(x);
    s * (1.0 + x * (1.0 - s))
}

/// Where a block's backward pass puts the sites it records; `None` when no trace is asked for,
/// in which case nothing is copied.
pub(crate) struct Sites<'a>(pub Option<&'a mut Vec<SiteRecord>>);

impl Sites<'_> {
    pub(crate) fn on(&self) -> bool {
        self.0.is_some()
    }

    pub(crate) fn push(&mut self, make: impl FnOnce() -> SiteRecord) {
        if let Some(v) = &mut self.0 {
            v.push(make());
        }
    }

    /// A weight site of the given kind, and its bias site when `bias` is true.
    pub(crate) fn weight(
        &mut self,
        weight: String,
        bias: Option<String>,
        kind: SiteKind,
        activations: ArrayView2<f64>,
        backprops: ArrayView2<f64>,
    ) {
        self.push(|| SiteRecord::dense(weight, kind, activations.to_owned(), backprops.to_owned()));
        if let Some(b) = bias {
            self.push(|| SiteRecord::bias(b, backprops.to_owned()));
        }
    }

    /// An `nn.Linear` named `<module>.weight` / `<module>.bias`.
    pub(crate) fn linear(
        &mut self,
        module: &str,
        has_bias: bool,
        activations: ArrayView2<f64>,
        backprops: ArrayView2<f64>,
    ) {
        if self.on() {
            self.weight(
                format!("{module}.weight"),
                has_bias.then(|| format!("{module}.bias")),
                SiteKind::Linear,
                activations,
                backprops,
            );
        }
    }

    /// [`Sites::norm`] of an RMSNorm (no bias) that a layer may lack: nothing when `cache` is
    /// `None`, that is when the layer has no such norm.
    pub(crate) fn optional_norm(
        &mut self,
        module: &str,
        cache: Option<&NormCache>,
        backprops: Option<&Array2<f64>>,
    ) {
        if let (Some(cache), Some(backprops)) = (cache, backprops) {
            self.norm(module, false, cache, backprops.view());
        }
    }

    /// A normalization weight (kind `layernorm`, activations x̂), and its bias when it has one.
    pub(crate) fn norm(
        &mut self,
        module: &str,
        has_bias: bool,
        cache: &NormCache,
        backprops: ArrayView2<f64>,
    ) {
        if self.on() {
            self.weight(
                format!("{module}.weight"),
                has_bias.then(|| format!("{module}.bias")),
                SiteKind::LayerNorm,
                cache.xhat.view(),
                backprops,
            );
        }
    }
}
