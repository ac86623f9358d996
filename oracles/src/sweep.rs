//! Element-wise passes over model-sized f64 buffers, on every core.
//!
//! Between its products the reference widens each block's weights to f64, clears the block's
//! gradient buffer and sums the squares of every gradient it forms: about 10 GB written and read
//! per example at the Llama-3.2-1B shape. On one thread those passes left the other core idle for
//! about a quarter of an example (docs/results.md). They run here on rayon's pool, the one faer's
//! products already use, in fixed chunks.
//!
//! A sum is taken chunk by chunk and the chunks' partial sums added in order, so a result does
//! not depend on how the pool happened to split the work: the same inputs give the same bits.

use rayon::prelude::*;

/// Elements per task: large enough that a task's overhead is nothing next to its memory
/// traffic, small enough that both cores get work on a 2048×512 projection.
const CHUNK: usize = 1 << 16;

/// Σ x² over `values`, in a fixed association order.
pub(crate) fn sum_of_squares(values: &[f64]) -> f64 {
    if values.len() <= CHUNK {
        return chunk_sum_of_squares(values);
    }
    let partial: Vec<f64> = values.par_chunks(CHUNK).map(chunk_sum_of_squares).collect();
    partial.iter().sum()
}

/// One chunk's Σ x², with eight independent accumulators so that the adds are not one chain of
/// dependent latencies (the compiler may not reassociate a float sum by itself).
fn chunk_sum_of_squares(values: &[f64]) -> f64 {
    let mut lanes = [0.0_f64; 8];
    let mut blocks = values.chunks_exact(8);
    for block in &mut blocks {
        for (lane, v) in lanes.iter_mut().zip(block) {
            *lane += v * v;
        }
    }
    let tail: f64 = blocks.remainder().iter().map(|v| v * v).sum();
    lanes.iter().sum::<f64>() + tail
}

/// Sets every element of `values` to zero.
pub(crate) fn clear(values: &mut [f64]) {
    values.par_chunks_mut(CHUNK).for_each(|c| c.fill(0.0));
}

/// Fills `out` a chunk at a time: `fill(start, chunk)` writes elements `start..start +
/// chunk.len()` of the whole.
pub(crate) fn fill_chunks(out: &mut [f64], fill: impl Fn(usize, &mut [f64]) + Sync) {
    out.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(k, chunk)| fill(k * CHUNK, chunk));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_of_squares_of_small_integers_are_exact() {
        // Every square and partial sum is an integer below 2⁵³, so any order gives the exact
        // value: n(n+1)(2n+1)/6 for 1..=n, across chunk boundaries and a ragged tail.
        for n in [0_usize, 1, 7, 8, 9, CHUNK - 1, CHUNK, 3 * CHUNK + 5] {
            let values: Vec<f64> = (1..=n).map(|k| k as f64).collect();
            let want = (n * (n + 1) * (2 * n + 1) / 6) as f64;
            assert_eq!(sum_of_squares(&values), want, "n = {n}");
        }
    }

    #[test]
    fn a_sum_is_the_same_bits_every_time() {
        let values: Vec<f64> = (0..5 * CHUNK + 3)
            .map(|k| ((k * 7919) % 1009) as f64 / 997.0 - 0.5)
            .collect();
        let first = sum_of_squares(&values);
        for _ in 0..20 {
            assert_eq!(sum_of_squares(&values).to_bits(), first.to_bits());
        }
        let serial: f64 = values.iter().map(|v| v * v).sum();
        assert!((first - serial).abs() <= 1e-12 * serial);
    }

    #[test]
    fn clearing_and_filling_reach_every_element() {
        let mut values = vec![1.0; 2 * CHUNK + 17];
        clear(&mut values);
        assert!(values.iter().all(|&v| v == 0.0));
        fill_chunks(&mut values, |start, chunk| {
            for (k, v) in chunk.iter_mut().enumerate() {
                *v = (start + k) as f64;
            }
        });
        assert!(values.iter().enumerate().all(|(k, &v)| v == k as f64));
    }
}
