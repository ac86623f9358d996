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

mod cpu;

use crate::error::{Error, Result};
use crate::trace::{to_f64_vec, Site, SiteKind};
use candle_core::{DType, Tensor};
use cpu::{cpu_gram, onehot_inner_cpu, threads_for, CpuData, GramDims, PARALLEL_FLOPS};

/// One side of a factored gradient, B×R rows (R the site's own rows per example: two sites of
/// one parameter may have different R, and their Gram is then R×S).
#[derive(Clone, Debug)]
pub enum Factor {
    /// B×R×m values.
    Dense(Tensor),
    /// B×R ids (u32) into a table of `size` rows: row t is onehot(ids_t).
    OneHot {
        /// B×R ids.
        ids: Tensor,
        /// Rows of the table: the factor's width.
        size: usize,
    },
    /// The constant 1 (bias-like sites): m = 1.
    Ones {
        /// B, the examples.
        batch: usize,
        /// R, the rows per example.
        rows: usize,
    },
}

impl Factor {
    /// Entries per row: the table's rows for a one-hot factor, 1 for ones.
    pub fn width(&self) -> usize {
        match self {
            Factor::Dense(t) => t.dims()[2],
            Factor::OneHot { size, .. } => *size,
            Factor::Ones { .. } => 1,
        }
    }

    fn batch_rows(&self) -> (usize, usize) {
        match self {
            Factor::Dense(t) => (t.dims()[0], t.dims()[1]),
            Factor::OneHot { ids, .. } => (ids.dims()[0], ids.dims()[1]),
            Factor::Ones { batch, rows } => (*batch, *rows),
        }
    }
}

/// A site's gradient as a pair of factors.
#[derive(Clone, Debug)]
pub struct Factored {
    /// The input-side factor (a per-example gradient is leftᵀ · right).
    pub left: Factor,
    /// The output-side factor.
    pub right: Factor,
}

impl Factored {
    /// The site's two factors by its kind, refused when a tensor the kind needs is missing.
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
                right: Factor::Ones { batch: b, rows: t },
            },
            SiteKind::LayerNorm => Factored {
                left: Factor::Dense((bp * act()?)?),
                right: Factor::Ones { batch: b, rows: t },
            },
        })
    }

    /// (left width, right width): the shape of the per-example gradient the factors make.
    pub fn shape(&self) -> (usize, usize) {
        (self.left.width(), self.right.width())
    }

    /// Multiply-adds of the per-example Gram route versus materializing (mixed ghost's rule).
    pub fn prefers_gram(&self) -> bool {
        let (_, t) = self.left.batch_rows();
        let (p, q) = self.shape();
        match (&self.left, &self.right) {
            // One-hot rows cost nothing in a Gram; a materialized table costs vocab × d memory.
            (Factor::OneHot { .. }, _) | (_, Factor::OneHot { .. }) => true,
            (Factor::Dense(_) | Factor::Ones { .. }, Factor::Dense(_) | Factor::Ones { .. }) => {
                t * t * (p + q) < t * p * q
            }
        }
    }
}

/// The B×T×S matrix of inner products ⟨a_t, b_s⟩ of two factors of equal batch and width.
pub fn gram(a: &Factor, b: &Factor, dtype: DType) -> Result<Tensor> {
    let ((batch, t), (b_batch, s)) = (a.batch_rows(), b.batch_rows());
    if (batch, a.width()) != (b_batch, b.width()) {
        return Err(Error::input(format!(
            "factor batch sizes or widths differ: {batch}×{t}×{} vs {b_batch}×{s}×{}",
            a.width(),
            b.width()
        )));
    }
    Ok(match (a, b) {
        (Factor::Dense(x), Factor::Dense(y)) => dense_gram(x, y)?,
        // ⟨onehot(x_t), y_s⟩ = y_s[x_t]: a gather, never a one-hot product.
        (Factor::OneHot { ids, .. }, Factor::Dense(y)) => {
            let idx = ids
                .unsqueeze(1)?
                .broadcast_as((batch, s, t))?
                .contiguous()?;
            y.gather(&idx, 2)?.transpose(1, 2)?.contiguous()?
        }
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

/// x yᵀ per example. On the CPU (f32 or f64, contiguous) the products go to gemm with the work
/// split by hand (`cpu_gram`); elsewhere candle's matmul reads a transposed *view* of y: a
/// contiguous copy of a B×T×V logit gradient costs more than the product. `gram` has checked
/// that batch and width agree.
fn dense_gram(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let ((b, t, k), s) = (x.dims3()?, y.dims()[1]);
    {
        let (xs, xl) = x.storage_and_layout();
        let (ys, yl) = y.storage_and_layout();
        let dims = GramDims { b, t, s, k };
        match (CpuData::of(&xs, xl), CpuData::of(&ys, yl)) {
            (Some(CpuData::F32(a)), Some(CpuData::F32(c))) => {
                let g = cpu_gram(a, c, dims, threads_for(2 * b * t * s * k, PARALLEL_FLOPS));
                return Ok(Tensor::from_vec(g, (b, t, s), x.device())?);
            }
            (Some(CpuData::F64(a)), Some(CpuData::F64(c))) => {
                let g = cpu_gram(a, c, dims, threads_for(2 * b * t * s * k, PARALLEL_FLOPS));
                return Ok(Tensor::from_vec(g, (b, t, s), x.device())?);
            }
            _ => {}
        }
    }
    Ok(x.matmul(&y.transpose(1, 2)?)?)
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

/// A half-precision tensor widened to f32 for a reduction (candle's CPU sums accumulate in the
/// tensor's own dtype; T² terms in bf16 would lose every digit). Products of bf16 or f16 values
/// are accumulated in f32, as tensor cores and gemm's half-precision kernels do; values are
/// rounded back to the half precision only where they are stored.
fn widened(t: &Tensor) -> Result<Tensor> {
    Ok(match t.dtype() {
        DType::BF16 | DType::F16 => t.to_dtype(DType::F32)?,
        _ => t.clone(),
    })
}

/// ⟨G_j, G_k⟩ per example = Σ_{t,s} (l_jt·l_ks)(r_jt·r_ks): the Gram identity, used for a site's
/// own squared norm (j = k) and for the cross term of two uses of one parameter.
pub fn inner(a: &Factored, b: &Factored, dtype: DType) -> Result<Vec<f64>> {
    if a.shape() != b.shape() {
        return Err(Error::input(format!(
            "gradient shapes differ: {:?} vs {:?}",
            a.shape(),
            b.shape()
        )));
    }
    let gr = gram(&a.right, &b.right, dtype)?;
    if let Some(v) = onehot_inner_cpu(&a.left, &b.left, &gr)? {
        return Ok(v);
    }
    let gl = gram(&a.left, &b.left, dtype)?;
    frobenius_per_example(&gl, &gr)
}

/// Σ_{t,s} x[i,t,s]·y[i,t,s] for every example i. On the CPU one pass accumulating in f64: the
/// sum has T² terms, many for an f32 accumulator.
fn frobenius_per_example(x: &Tensor, y: &Tensor) -> Result<Vec<f64>> {
    fn run<T: candle_core::WithDType>(x: &[T], y: &[T], n: usize) -> Vec<f64> {
        let per = x.len() / n.max(1);
        if per == 0 {
            return vec![0.0; n];
        }
        x.chunks(per)
            .zip(y.chunks(per))
            .map(|(a, b)| a.iter().zip(b).map(|(p, q)| p.to_f64() * q.to_f64()).sum())
            .collect()
    }
    let n = x.dims()[0];
    if x.dims() == y.dims() {
        let (xs, xl) = x.storage_and_layout();
        let (ys, yl) = y.storage_and_layout();
        match (CpuData::of(&xs, xl), CpuData::of(&ys, yl)) {
            (Some(CpuData::F32(a)), Some(CpuData::F32(b))) => return Ok(run(a, b, n)),
            (Some(CpuData::F64(a)), Some(CpuData::F64(b))) => return Ok(run(a, b, n)),
            _ => {}
        }
    }
    to_f64_vec(&(widened(x)? * widened(y)?)?.sum((1, 2))?)
}

/// Example `i`'s gradient, rows × cols.
pub fn materialize(f: &Factored, i: usize, dtype: DType) -> Result<Tensor> {
    let row = |x: &Tensor| -> Result<Tensor> { Ok(x.get(i)?) };
    let (p, q) = f.shape();
    Ok(match (&f.left, &f.right) {
        (Factor::Dense(l), Factor::Dense(r)) => row(l)?.t()?.contiguous()?.matmul(&row(r)?)?,
        (Factor::Dense(l), Factor::Ones { .. }) => widened(&row(l)?)?
            .sum(0)?
            .to_dtype(dtype)?
            .reshape((p, 1))?,
        (Factor::OneHot { ids, size }, Factor::Dense(r)) => {
            let r = widened(&row(r)?)?;
            Tensor::zeros((*size, q), r.dtype(), r.device())?
                .index_add(&row(ids)?, &r, 0)?
                .to_dtype(dtype)?
        }
        // No site kind writes these (kinds map to the three pairs above).
        (Factor::Ones { .. }, Factor::Dense(_) | Factor::OneHot { .. } | Factor::Ones { .. })
        | (Factor::OneHot { .. }, Factor::OneHot { .. } | Factor::Ones { .. })
        | (Factor::Dense(_), Factor::OneHot { .. }) => {
            return Err(Error::internal("materialize: unsupported factor pair"))
        }
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
            // The weights scale the narrower factor (an LM head's activations, d wide, not its
            // V-wide backprops), and lᵀ is read in place: no factor-sized copy is made.
            let (l, r) = if p <= q {
                (scale(l)?, r.clone())
            } else {
                (l.clone(), scale(r)?)
            };
            l.reshape((b * t, p))?
                .t()?
                .matmul(&r.reshape((b * t, q))?)?
        }
        (Factor::Dense(l), Factor::Ones { .. }) => widened(&scale(l)?)?
            .sum((0, 1))?
            .to_dtype(l.dtype())?
            .reshape((p, 1))?,
        (Factor::OneHot { ids, size }, Factor::Dense(r)) => {
            let (b, t) = (r.dims()[0], r.dims()[1]);
            let src = widened(&scale(r)?)?.reshape((b * t, q))?;
            Tensor::zeros((*size, q), src.dtype(), r.device())?
                .index_add(&ids.flatten_all()?, &src, 0)?
                .to_dtype(r.dtype())?
        }
        (Factor::Ones { .. }, Factor::Dense(_) | Factor::OneHot { .. } | Factor::Ones { .. })
        | (Factor::OneHot { .. }, Factor::OneHot { .. } | Factor::Ones { .. })
        | (Factor::Dense(_), Factor::OneHot { .. }) => {
            return Err(Error::internal("weighted_sum: unsupported factor pair"))
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Σ_i w_i Σ_t l_it r_itᵀ written out, on values whose products and sums are exact in f64.
    fn written_out(l: &[f64], r: &[f64], w: &[f64], t: usize, p: usize, q: usize) -> Vec<f64> {
        let mut out = vec![0.0; p * q];
        for (i, wi) in w.iter().enumerate() {
            for s in 0..t {
                let row = i * t + s;
                for a in 0..p {
                    for b in 0..q {
                        out[a * q + b] += wi * l[row * p + a] * r[row * q + b];
                    }
                }
            }
        }
        out
    }

    // The weights go on whichever factor is narrower; both sides of that choice must give the
    // sum the definition gives (small integers, so equal means equal).
    #[test]
    fn weighted_sums_of_wide_and_narrow_left_factors_are_the_written_out_sum() {
        let cpu = candle_core::Device::Cpu;
        let (batch, t) = (3, 4);
        let w = [2.0, -1.0, 3.0];
        for (p, q) in [(5, 9), (9, 5), (6, 6)] {
            let value = |k: usize, m: usize| ((k * m + 3 * k) % 7) as f64 - 3.0;
            let l: Vec<f64> = (0..batch * t * p).map(|k| value(k, 5)).collect();
            let r: Vec<f64> = (0..batch * t * q).map(|k| value(k, 3)).collect();
            let f = Factored {
                left: Factor::Dense(Tensor::from_vec(l.clone(), (batch, t, p), &cpu).unwrap()),
                right: Factor::Dense(Tensor::from_vec(r.clone(), (batch, t, q), &cpu).unwrap()),
            };
            let weights = Tensor::from_vec(w.to_vec(), batch, &cpu).unwrap();
            let got = weighted_sum(&f, &weights).unwrap();
            assert_eq!(got.dims(), &[p, q]);
            let got = got.flatten_all().unwrap().to_vec1::<f64>().unwrap();
            assert_eq!(got, written_out(&l, &r, &w, t, p, q), "p = {p}, q = {q}");
        }
    }
}
