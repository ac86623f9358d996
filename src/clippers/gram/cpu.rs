//! The Gram identity's CPU kernels: gemm pieces spread over the cores, and the one-hot side
//! read in place. Chosen by `super` when the factors are contiguous f32 or f64 on the CPU.

use super::Factor;
use crate::error::{Error, Result};
use candle_core::Tensor;

/// A tensor's values in CPU memory, when contiguous and f32 or f64.
pub(super) enum CpuData<'a> {
    F32(&'a [f32]),
    F64(&'a [f64]),
}

impl<'a> CpuData<'a> {
    pub(super) fn of(
        storage: &'a candle_core::Storage,
        layout: &candle_core::Layout,
    ) -> Option<Self> {
        use candle_core::{CpuStorage, Storage};
        let (start, end) = layout.contiguous_offsets()?;
        match storage {
            Storage::Cpu(CpuStorage::F32(d)) => Some(CpuData::F32(&d[start..end])),
            Storage::Cpu(CpuStorage::F64(d)) => Some(CpuData::F64(&d[start..end])),
            _ => None,
        }
    }
}

/// B examples of a T×k by S×k product, row-major.
#[derive(Clone, Copy)]
pub(super) struct GramDims {
    pub b: usize,
    pub t: usize,
    pub s: usize,
    pub k: usize,
}

/// Products smaller than this run on one thread: spawning costs more than it saves.
pub(super) const PARALLEL_FLOPS: usize = 1 << 26;

/// x yᵀ per example with gemm, each piece single-threaded and the pieces spread over the cores.
/// A piece is one example, or for a small batch one slice of the reduction (an LM head's
/// vocabulary): gemm's own threading splits the output, which for a 128×128 Gram leaves the cores
/// idle (`cargo bench --bench gram_variants`, docs/results.md: 124 → 199 GFLOP/s at T = 128,
/// B = 8).
pub(super) fn cpu_gram<T: candle_core::WithDType>(
    x: &[T],
    y: &[T],
    d: GramDims,
    threads: usize,
) -> Vec<T> {
    let GramDims { b, t, s, k } = d;
    let out_len = t * s;
    let mut out = vec![T::zero(); b * out_len];
    if out.is_empty() || k == 0 {
        return out;
    }
    if threads < 2 {
        for (i, o) in out.chunks_mut(out_len).enumerate() {
            gemm_piece(x, y, d, i, 0..k, o);
        }
        return out;
    }
    // Pieces per example: enough for every thread to get the same number of equal pieces, and
    // at least two per thread so that one slow piece does not leave a core waiting.
    let mut parts = threads / gcd(b, threads);
    if b * parts < 2 * threads {
        parts *= 2;
    }
    let parts = parts.min(k);
    if parts == 1 {
        // Whole examples: every thread writes its own examples' blocks of the output.
        let mut shares: Vec<Vec<(usize, &mut [T])>> = (0..threads).map(|_| Vec::new()).collect();
        for (i, o) in out.chunks_mut(out_len).enumerate() {
            shares[i % threads].push((i, o));
        }
        let run = |share: Vec<(usize, &mut [T])>| {
            for (i, o) in share {
                gemm_piece(x, y, d, i, 0..k, o);
            }
        };
        std::thread::scope(|sc| {
            let mut shares = shares.into_iter();
            let own = shares.next().expect("at least two threads");
            for share in shares {
                let run = &run;
                sc.spawn(move || run(share));
            }
            run(own);
        });
        return out;
    }
    // Thread th takes pieces th, th + threads, ...; the calling thread is thread 0 and writes
    // into the output, the others into buffers of their own, added at the end.
    let chunk = k.div_ceil(parts);
    let pieces = |th: usize, acc: &mut [T]| {
        for piece in (th..b * parts).step_by(threads) {
            let (i, p) = (piece / parts, piece % parts);
            let range = (p * chunk).min(k)..((p + 1) * chunk).min(k);
            gemm_piece(x, y, d, i, range, &mut acc[i * out_len..][..out_len]);
        }
    };
    let partials: Vec<Vec<T>> = std::thread::scope(|sc| {
        let handles: Vec<_> = (1..threads)
            .map(|th| {
                let pieces = &pieces;
                sc.spawn(move || {
                    let mut acc = vec![T::zero(); b * out_len];
                    pieces(th, &mut acc);
                    acc
                })
            })
            .collect();
        pieces(0, &mut out);
        handles
            .into_iter()
            .map(|h| h.join().expect("gram thread panicked"))
            .collect()
    });
    for part in &partials {
        for (o, v) in out.iter_mut().zip(part) {
            *o += *v;
        }
    }
    out
}

/// The cores to use for a job of `work` units: one below `parallel_from`, else up to 8.
pub(super) fn threads_for(work: usize, parallel_from: usize) -> usize {
    if work < parallel_from {
        return 1;
    }
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(8)
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// o += x_i[:, range] · y_i[:, range]ᵀ on the calling thread.
fn gemm_piece<T: candle_core::WithDType>(
    x: &[T],
    y: &[T],
    d: GramDims,
    i: usize,
    range: std::ops::Range<usize>,
    o: &mut [T],
) {
    let GramDims { b, t, s, k } = d;
    assert!(
        x.len() == b * t * k && y.len() == b * s * k && o.len() == t * s && range.end <= k,
        "gemm_piece: slice lengths do not match the dimensions"
    );
    if range.is_empty() {
        return;
    }
    let (xp, yp) = (&x[i * t * k + range.start..], &y[i * s * k + range.start..]);
    // SAFETY: the assert above bounds every access: gemm reads x at row·k + col and y at
    // col + row·k for row < t (resp. s) and col < range.len(), inside example i's block, and
    // writes o at row·s + col for row < t, col < s.
    unsafe {
        gemm::gemm(
            t,
            s,
            range.len(),
            o.as_mut_ptr(),
            1,
            s as isize,
            true,
            xp.as_ptr(),
            1,
            k as isize,
            yp.as_ptr(),
            k as isize,
            1,
            T::one(),
            T::one(),
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// Σ_{t,s} ⟨l_t, m_s⟩·w[t,s] per example where l or m is one-hot, with ⟨onehot(x_t), y_s⟩ =
/// y_s[x_t] read in place while summing (CPU, f32/f64; `None` elsewhere). The one-hot side of the
/// Gram never becomes a T×S matrix: building it cost an allocation (fresh pages, faulted in on
/// every call at large T) and a second pass over it.
pub(super) fn onehot_inner_cpu(l: &Factor, m: &Factor, w: &Tensor) -> Result<Option<Vec<f64>>> {
    // Elsewhere the ids would be copied to the host only to fall back to the gather.
    if !w.device().is_cpu() {
        return Ok(None);
    }
    let ids_of = |ids: &Tensor, size: usize| -> Result<Vec<u32>> {
        let ids: Vec<u32> = ids.flatten_all()?.to_vec1()?;
        match ids.iter().find(|&&i| i as usize >= size) {
            Some(bad) => Err(Error::input(format!(
                "one-hot id {bad} is outside the table's {size} rows"
            ))),
            None => Ok(ids),
        }
    };
    let (b, t, s) = w.dims3()?;
    // (one-hot ids, the dense factor whose rows are read, w laid out ids-index first)
    let (ids, table, ids_first) = match (l, m) {
        (Factor::OneHot { ids: x, size }, Factor::OneHot { ids: y, .. }) => {
            let (x, y) = (ids_of(x, *size)?, ids_of(y, *size)?);
            if (x.len(), y.len()) != (b * t, b * s) {
                return Ok(None);
            }
            let (ws, wl) = w.storage_and_layout();
            return Ok(match CpuData::of(&ws, wl) {
                Some(CpuData::F32(w)) => Some(equal_ids_sum(&x, &y, w, (b, t, s))),
                Some(CpuData::F64(w)) => Some(equal_ids_sum(&x, &y, w, (b, t, s))),
                None => None,
            });
        }
        (Factor::OneHot { ids, size }, Factor::Dense(y)) => (ids_of(ids, *size)?, y, true),
        (Factor::Dense(x), Factor::OneHot { ids, size }) => (ids_of(ids, *size)?, x, false),
        // No one-hot side: not this kernel's product.
        (Factor::Dense(_) | Factor::Ones { .. }, Factor::Dense(_) | Factor::Ones { .. })
        | (Factor::OneHot { .. }, Factor::Ones { .. })
        | (Factor::Ones { .. }, Factor::OneHot { .. }) => return Ok(None),
    };
    let (rows, n_ids) = if ids_first { (s, t) } else { (t, s) };
    let d = RowDims {
        b,
        rows,
        ids: n_ids,
        v: table.dims()[2],
    };
    if ids.len() != b * n_ids || table.dims()[..2] != [b, rows] {
        return Ok(None);
    }
    let threads = threads_for(b * t * s, PARALLEL_GATHER);
    let (ys, yl) = table.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    Ok(match (CpuData::of(&ys, yl), CpuData::of(&ws, wl)) {
        (Some(CpuData::F32(y)), Some(CpuData::F32(w))) => {
            Some(table_weighted_sum(y, &ids, w, d, ids_first, threads))
        }
        (Some(CpuData::F64(y)), Some(CpuData::F64(w))) => {
            Some(table_weighted_sum(y, &ids, w, d, ids_first, threads))
        }
        _ => None,
    })
}

/// Σ_{t,s: x_t = y_s} w[t,s] per example: the Gram identity's one-hot × one-hot side.
fn equal_ids_sum<T: candle_core::WithDType>(
    x: &[u32],
    y: &[u32],
    w: &[T],
    (b, t, s): (usize, usize, usize),
) -> Vec<f64> {
    (0..b)
        .map(|i| {
            let (x, y, w) = (&x[i * t..][..t], &y[i * s..][..s], &w[i * t * s..][..t * s]);
            let mut acc = 0.0;
            for (tt, xt) in x.iter().enumerate() {
                for (ss, ys) in y.iter().enumerate() {
                    if xt == ys {
                        acc += w[tt * s + ss].to_f64();
                    }
                }
            }
            acc
        })
        .collect()
}

/// A B×rows×V table read at B×ids column indices.
#[derive(Clone, Copy)]
struct RowDims {
    b: usize,
    rows: usize,
    ids: usize,
    v: usize,
}

/// Sums of at least this many table reads are split across threads: every read is a cache miss.
const PARALLEL_GATHER: usize = 1 << 16;

/// Σ_{r,j} y[b, r, ids[b, j]]·w_b(j, r) per example, where w is B×ids×rows (`ids_first`) or
/// B×rows×ids. Row by row of y: the reads of one row stay within V values (a few pages), where
/// column by column every read is on another page.
fn table_weighted_sum<T: candle_core::WithDType>(
    y: &[T],
    ids: &[u32],
    w: &[T],
    d: RowDims,
    ids_first: bool,
    threads: usize,
) -> Vec<f64> {
    let RowDims { b, rows, ids: n, v } = d;
    // Rows q in `range` of the B×rows stack, summed into per-example partials.
    let sum_rows = |range: std::ops::Range<usize>| -> Vec<f64> {
        let mut acc = vec![0.0; b];
        for q in range {
            let (i, r) = (q / rows, q % rows);
            let row = &y[q * v..][..v];
            let ids = &ids[i * n..][..n];
            let w = &w[i * n * rows..][..n * rows];
            acc[i] += if ids_first {
                ids.iter()
                    .enumerate()
                    .map(|(j, &c)| row[c as usize].to_f64() * w[j * rows + r].to_f64())
                    .sum::<f64>()
            } else {
                let w = &w[r * n..][..n];
                ids.iter()
                    .zip(w)
                    .map(|(&c, wj)| row[c as usize].to_f64() * wj.to_f64())
                    .sum::<f64>()
            };
        }
        acc
    };
    let total = b * rows;
    if threads < 2 || total == 0 {
        return sum_rows(0..total);
    }
    let per = total.div_ceil(threads);
    let partials: Vec<Vec<f64>> = std::thread::scope(|sc| {
        let handles: Vec<_> = (1..threads)
            .map(|th| {
                let sum_rows = &sum_rows;
                sc.spawn(move || sum_rows((th * per).min(total)..((th + 1) * per).min(total)))
            })
            .collect();
        let mut all = vec![sum_rows(0..per.min(total))];
        all.extend(
            handles
                .into_iter()
                .map(|h| h.join().expect("one-hot sum thread panicked")),
        );
        all
    });
    (0..b)
        .map(|i| partials.iter().map(|p| p[i]).sum())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::gram;
    use super::*;
    use candle_core::DType;
    use ghost_oracle_reference::SplitMix64;

    fn normals(rng: &mut SplitMix64, n: usize) -> Vec<f64> {
        (0..n).map(|_| rng.normal()).collect()
    }

    // Every schedule (one thread; whole examples per thread; slices of the reduction, with
    // batches that do and do not divide the thread count, and more threads than pieces) against
    // the sum written out.
    #[test]
    fn gram_schedules_agree_with_the_plain_sum() {
        let mut rng = SplitMix64::new(11);
        for (b, t, s, k) in [
            (1, 3, 4, 37),
            (2, 5, 3, 101),
            (3, 2, 2, 7),
            (4, 1, 6, 64),
            (6, 4, 4, 3),
            (1, 2, 2, 1),
        ] {
            let (x, y) = (normals(&mut rng, b * t * k), normals(&mut rng, b * s * k));
            let plain: Vec<f64> = (0..b * t * s)
                .map(|o| {
                    let (i, tt, ss) = (o / (t * s), o / s % t, o % s);
                    (0..k)
                        .map(|kk| x[(i * t + tt) * k + kk] * y[(i * s + ss) * k + kk])
                        .sum()
                })
                .collect();
            for threads in 1..=5 {
                let got = cpu_gram(&x, &y, GramDims { b, t, s, k }, threads);
                for (g, p) in got.iter().zip(&plain) {
                    assert!(
                        (g - p).abs() <= 1e-12 * (1.0 + p.abs()),
                        "b {b} t {t} s {s} k {k}, {threads} threads: {g} vs {p}"
                    );
                }
            }
        }
    }

    #[test]
    fn gram_of_factors_from_different_batches_is_an_error() {
        let dev = candle_core::Device::Cpu;
        let x = Factor::Dense(Tensor::zeros((2, 3, 4), DType::F32, &dev).unwrap());
        let y = Factor::Dense(Tensor::zeros((3, 3, 4), DType::F32, &dev).unwrap());
        let err = gram(&x, &y, DType::F32).unwrap_err().to_string();
        assert!(err.contains("batch sizes or widths differ"), "{err}");
        assert!(err.contains("2×3×4 vs 3×3×4"), "{err}");
    }

    #[test]
    fn one_hot_sums_agree_with_indexing_on_every_schedule() {
        let mut rng = SplitMix64::new(12);
        for (b, rows, n, v) in [(1, 5, 3, 11), (3, 4, 2, 7), (2, 1, 5, 3), (4, 3, 3, 1)] {
            let y = normals(&mut rng, b * rows * v);
            let w = normals(&mut rng, b * rows * n);
            let ids: Vec<u32> = (0..b * n).map(|j| ((j * 7 + 3) % v) as u32).collect();
            for ids_first in [true, false] {
                let plain: Vec<f64> = (0..b)
                    .map(|i| {
                        let mut acc = 0.0;
                        for r in 0..rows {
                            for j in 0..n {
                                let wj = if ids_first {
                                    w[(i * n + j) * rows + r]
                                } else {
                                    w[(i * rows + r) * n + j]
                                };
                                acc += y[(i * rows + r) * v + ids[i * n + j] as usize] * wj;
                            }
                        }
                        acc
                    })
                    .collect();
                for threads in 1..=5 {
                    let d = RowDims { b, rows, ids: n, v };
                    let got = table_weighted_sum(&y, &ids, &w, d, ids_first, threads);
                    for (g, p) in got.iter().zip(&plain) {
                        assert!(
                            (g - p).abs() <= 1e-12 * (1.0 + p.abs()),
                            "b {b} rows {rows} ids {n} v {v}, ids_first {ids_first}, {threads} threads: {g} vs {p}"
                        );
                    }
                }
            }
        }
    }
}
