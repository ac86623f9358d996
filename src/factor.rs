//! A site's per-example gradient in factored form, G = Σ_t l_t r_tᵀ in the parameter's layout,
//! and the three operations every clipper is built from: the Gram identity for inner products
//! of two factored gradients, materialization, and the coefficient-weighted sum over examples.
//!
//! | site      | left l_t        | right r_t   | parameter layout |
//! |-----------|-----------------|-------------|------------------|
//! | linear    | δ_t             | a_t         | out × in         |
//! | conv1d    | a_t             | δ_t         | in × out         |
//! | embedding | onehot(x_t)     | δ_t         | vocab × d        |
//! | bias      | δ_t             | 1           | out × 1          |
//! | layernorm | δ_t ⊙ x̂_t       | 1           | d × 1            |

use crate::error::{Error, Result};
use crate::trace::{Site, SiteKind};
use candle_core::{DType, Tensor};

/// One side of a factored gradient, B×T rows.
#[derive(Clone, Debug)]
pub enum Factor {
    /// B×T×m values.
    Dense(Tensor),
    /// B×T ids (u32) into a table of `size` rows: row t is onehot(ids_t).
    OneHot { ids: Tensor, size: usize },
    /// The constant 1 (bias-like sites): m = 1.
    Ones { batch: usize, seq: usize },
}

impl Factor {
    pub fn width(&self) -> usize {
        match self {
            Factor::Dense(t) => t.dims()[2],
            Factor::OneHot { size, .. } => *size,
            Factor::Ones { .. } => 1,
        }
    }

    fn batch_seq(&self) -> (usize, usize) {
        match self {
            Factor::Dense(t) => (t.dims()[0], t.dims()[1]),
            Factor::OneHot { ids, .. } => (ids.dims()[0], ids.dims()[1]),
            Factor::Ones { batch, seq } => (*batch, *seq),
        }
    }
}

/// A site's gradient as a pair of factors.
#[derive(Clone, Debug)]
pub struct Factored {
    pub left: Factor,
    pub right: Factor,
}

/// The (rows, cols) of the gradient a site writes, in the parameter's layout.
pub fn gradient_shape(site: &Site) -> (usize, usize) {
    let width = |t: &Option<Tensor>| t.as_ref().map_or(0, |a| a.dims()[2]);
    let out = site.backprops.dims()[2];
    match site.spec.kind {
        SiteKind::Linear => (out, width(&site.activations)),
        SiteKind::Conv1d => (width(&site.activations), out),
        SiteKind::Embedding => (site.spec.vocab.unwrap_or(0), out),
        SiteKind::Bias | SiteKind::LayerNorm => (out, 1),
    }
}

impl Factored {
    pub fn of(site: &Site) -> Result<Self> {
        let missing =
            |what: &str| Error::input(format!("site `{}`: {what} missing", site.spec.name));
        let bp = site.backprops.clone();
        let (b, t) = (bp.dims()[0], bp.dims()[1]);
        let act = || {
            site.activations
                .clone()
                .ok_or_else(|| missing("activations"))
        };
        Ok(match site.spec.kind {
            SiteKind::Linear => Factored {
                left: Factor::Dense(bp),
                right: Factor::Dense(act()?),
            },
            SiteKind::Conv1d => Factored {
                left: Factor::Dense(act()?),
                right: Factor::Dense(bp),
            },
            SiteKind::Embedding => Factored {
                left: Factor::OneHot {
                    ids: site.ids.clone().ok_or_else(|| missing("ids"))?,
                    size: site.spec.vocab.ok_or_else(|| missing("vocab"))?,
                },
                right: Factor::Dense(bp),
            },
            SiteKind::Bias => Factored {
                left: Factor::Dense(bp),
                right: Factor::Ones { batch: b, seq: t },
            },
            SiteKind::LayerNorm => Factored {
                left: Factor::Dense((bp * act()?)?),
                right: Factor::Ones { batch: b, seq: t },
            },
        })
    }

    pub fn shape(&self) -> (usize, usize) {
        (self.left.width(), self.right.width())
    }

    /// Multiply-adds of the per-example Gram route versus materializing (mixed ghost's rule).
    pub fn prefers_gram(&self) -> bool {
        let (_, t) = self.left.batch_seq();
        let (p, q) = self.shape();
        match (&self.left, &self.right) {
            // One-hot rows cost nothing in a Gram; a materialized table costs vocab × d memory.
            (Factor::OneHot { .. }, _) | (_, Factor::OneHot { .. }) => true,
            _ => t * t * (p + q) < t * p * q,
        }
    }
}

/// The B×T×S matrix of inner products ⟨a_t, b_s⟩ of two factors of equal width.
pub fn gram(a: &Factor, b: &Factor, dtype: DType) -> Result<Tensor> {
    if a.width() != b.width() {
        return Err(Error::input(format!(
            "factor widths differ: {} vs {}",
            a.width(),
            b.width()
        )));
    }
    let (batch, t) = a.batch_seq();
    let (_, s) = b.batch_seq();
    Ok(match (a, b) {
        (Factor::Dense(x), Factor::Dense(y)) => dense_gram(x, y)?,
        // ⟨onehot(x_t), y_s⟩ = y_s[x_t]: a gather, never a one-hot product.
        (Factor::OneHot { ids, .. }, Factor::Dense(y)) => match gather_columns_cpu(y, ids)? {
            Some(g) => g,
            None => {
                let idx = ids
                    .unsqueeze(1)?
                    .broadcast_as((batch, s, t))?
                    .contiguous()?;
                y.gather(&idx, 2)?.transpose(1, 2)?.contiguous()?
            }
        },
        (Factor::Dense(x), Factor::OneHot { ids, .. }) => {
            let idx = ids
                .unsqueeze(1)?
                .broadcast_as((batch, t, s))?
                .contiguous()?;
            x.gather(&idx, 2)?
        }
        (Factor::OneHot { ids: x, .. }, Factor::OneHot { ids: y, .. }) => x
            .unsqueeze(2)?
            .broadcast_eq(&y.unsqueeze(1)?)?
            .to_dtype(dtype)?,
        (Factor::Ones { .. }, Factor::Ones { .. }) => {
            Tensor::ones((batch, t, s), dtype, &a_device(a, b))?
        }
        (Factor::Ones { .. }, other) | (other, Factor::Ones { .. }) => {
            // Width 1 on both sides: the other factor is a single column (or a 1-row table).
            let col = match other {
                Factor::Dense(x) => x.squeeze(2)?,
                Factor::OneHot { ids, .. } => ids.zeros_like()?.eq(ids)?.to_dtype(dtype)?,
                Factor::Ones { .. } => unreachable!(),
            };
            if matches!(a, Factor::Ones { .. }) {
                col.unsqueeze(1)?
                    .broadcast_as((batch, t, s))?
                    .contiguous()?
            } else {
                col.unsqueeze(2)?
                    .broadcast_as((batch, t, s))?
                    .contiguous()?
            }
        }
    })
}

/// g[b, t, s] = y[b, s, ids[b, t]], read straight from CPU memory: candle's generic gather
/// costs ~50 ns an element, which made the T² gather of the tied cross term dearer than its
/// Gram. `None` where the fast path does not apply (another device or dtype, a strided y).
fn gather_columns_cpu(y: &Tensor, ids: &Tensor) -> Result<Option<Tensor>> {
    fn run<T: candle_core::WithDType>(
        data: &[T],
        ids: &[u32],
        (b, s, v): (usize, usize, usize),
        t: usize,
    ) -> Vec<T> {
        let mut out = Vec::with_capacity(b * t * s);
        for bb in 0..b {
            for tt in 0..t {
                let col = ids[bb * t + tt] as usize;
                out.extend((0..s).map(|ss| data[(bb * s + ss) * v + col]));
            }
        }
        out
    }
    if !y.device().is_cpu() {
        return Ok(None);
    }
    let dims = y.dims3()?;
    let t = ids.dims()[1];
    let ids: Vec<u32> = ids.flatten_all()?.to_vec1()?;
    let (storage, layout) = y.storage_and_layout();
    let (Some((start, end)), candle_core::Storage::Cpu(cpu)) =
        (layout.contiguous_offsets(), &*storage)
    else {
        return Ok(None);
    };
    let out = match cpu {
        candle_core::CpuStorage::F32(d) => Tensor::from_vec(
            run(&d[start..end], &ids, dims, t),
            (dims.0, t, dims.1),
            y.device(),
        )?,
        candle_core::CpuStorage::F64(d) => Tensor::from_vec(
            run(&d[start..end], &ids, dims, t),
            (dims.0, t, dims.1),
            y.device(),
        )?,
        _ => return Ok(None),
    };
    Ok(Some(out))
}

/// Reductions at least this long (an LM head's vocabulary) are split across threads.
const SPLIT_WIDTH: usize = 8192;

/// x yᵀ per example, reading y's transpose in place (a contiguous copy of a B×T×V logit
/// gradient costs more than the product). A long reduction with short T sides is split into one
/// slice per core: the GEMM parallelizes poorly over a 128×128 output, the slices do not.
fn dense_gram(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let width = x.dims()[2];
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(8);
    if width < SPLIT_WIDTH || threads < 2 || !x.device().is_cpu() {
        return Ok(x.matmul(&y.transpose(1, 2)?)?);
    }
    let chunk = width.div_ceil(threads);
    let parts: Vec<Result<Tensor>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|k| {
                s.spawn(move || -> Result<Tensor> {
                    let start = k * chunk;
                    let len = chunk.min(width - start);
                    let (xs, ys) = (x.narrow(2, start, len)?, y.narrow(2, start, len)?);
                    Ok(xs.matmul(&ys.transpose(1, 2)?)?)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("gram thread"))
            .collect()
    });
    let mut parts = parts.into_iter();
    let first = parts.next().expect("at least one slice")?;
    parts.try_fold(first, |acc, p| Ok((acc + p?)?))
}

fn a_device(a: &Factor, b: &Factor) -> candle_core::Device {
    for f in [a, b] {
        match f {
            Factor::Dense(t) => return t.device().clone(),
            Factor::OneHot { ids, .. } => return ids.device().clone(),
            Factor::Ones { .. } => {}
        }
    }
    candle_core::Device::Cpu
}

/// ⟨G_j, G_k⟩ per example = Σ_{t,s} (l_jt·l_ks)(r_jt·r_ks): the Gram identity, used for a site's
/// own squared norm (j = k) and for the cross term of two uses of one parameter.
pub fn inner(a: &Factored, b: &Factored, dtype: DType) -> Result<Tensor> {
    if a.shape() != b.shape() {
        return Err(Error::input(format!(
            "gradient shapes differ: {:?} vs {:?}",
            a.shape(),
            b.shape()
        )));
    }
    let gl = gram(&a.left, &b.left, dtype)?;
    let gr = gram(&a.right, &b.right, dtype)?;
    Ok((gl * gr)?.sum((1, 2))?)
}

/// Magnitudes of the terms of ⟨G_j, G_k⟩, per example: Σ_{t,s} |(l_jt·l_ks)(r_jt·r_ks)| and the
/// diagonal Σ_t (l_jt·l_kt)(r_jt·r_kt) (for j = k: Σ_t ‖l_t‖²‖r_t‖²). They set the tolerance.
pub fn term_magnitudes(a: &Factored, b: &Factored, dtype: DType) -> Result<(Tensor, Tensor)> {
    let prod = (gram(&a.left, &b.left, dtype)? * gram(&a.right, &b.right, dtype)?)?;
    let t = prod.dims()[1];
    let eye = Tensor::eye(t, dtype, prod.device())?;
    let diag = prod.broadcast_mul(&eye)?.sum((1, 2))?;
    Ok((prod.abs()?.sum((1, 2))?, diag))
}

/// Example `i`'s gradient, rows × cols.
pub fn materialize(f: &Factored, i: usize, dtype: DType) -> Result<Tensor> {
    let row = |x: &Tensor| -> Result<Tensor> { Ok(x.get(i)?) };
    let (p, q) = f.shape();
    Ok(match (&f.left, &f.right) {
        (Factor::Dense(l), Factor::Dense(r)) => row(l)?.t()?.contiguous()?.matmul(&row(r)?)?,
        (Factor::Dense(l), Factor::Ones { .. }) => row(l)?.sum(0)?.reshape((p, 1))?,
        (Factor::OneHot { ids, size }, Factor::Dense(r)) => {
            Tensor::zeros((*size, q), dtype, r.device())?.index_add(&row(ids)?, &row(r)?, 0)?
        }
        _ => return Err(Error::internal("materialize: unsupported factor pair")),
    })
}

/// Σ_i w_i G_i (rows × cols) from the factors: the clipped gradient sum, book-keeping style.
pub fn weighted_sum(f: &Factored, weights: &Tensor) -> Result<Tensor> {
    let (p, q) = f.shape();
    let scale = |x: &Tensor| -> Result<Tensor> {
        let w = weights.reshape((weights.dims()[0], 1, 1))?;
        Ok(x.broadcast_mul(&w)?)
    };
    Ok(match (&f.left, &f.right) {
        (Factor::Dense(l), Factor::Dense(r)) => {
            let (b, t) = (l.dims()[0], l.dims()[1]);
            let l = scale(l)?.reshape((b * t, p))?;
            l.t()?.contiguous()?.matmul(&r.reshape((b * t, q))?)?
        }
        (Factor::Dense(l), Factor::Ones { .. }) => scale(l)?.sum((0, 1))?.reshape((p, 1))?,
        (Factor::OneHot { ids, size }, Factor::Dense(r)) => {
            let (b, t) = (r.dims()[0], r.dims()[1]);
            let src = scale(r)?.reshape((b * t, q))?;
            Tensor::zeros((*size, q), r.dtype(), r.device())?.index_add(
                &ids.flatten_all()?,
                &src,
                0,
            )?
        }
        _ => return Err(Error::internal("weighted_sum: unsupported factor pair")),
    })
}

/// Sum of squares of a materialized gradient, accumulated in f64: the sum has as many terms as
/// the parameter has entries (V·d for an LM head), too many for an f32 accumulator.
pub fn sum_sq(t: &Tensor) -> Result<f64> {
    Ok(t.to_dtype(DType::F64)?
        .sqr()?
        .sum_all()?
        .to_scalar::<f64>()?)
}

/// ⟨a, b⟩ of two materialized gradients, accumulated in f64 for the same reason.
pub fn dot_all(a: &Tensor, b: &Tensor) -> Result<f64> {
    Ok((a.to_dtype(DType::F64)? * b.to_dtype(DType::F64)?)?
        .sum_all()?
        .to_scalar::<f64>()?)
}

/// A per-example vector as f64.
pub fn to_f64_vec(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?.to_vec1::<f64>()?)
}
