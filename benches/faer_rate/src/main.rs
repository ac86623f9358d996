//! f64 matmul rates at the shapes of the reference's per-example work at the Llama-3.2-1B shape
//! (d 2048, intermediate 8192, T = 128, the head 4096 vocabulary rows at a time), through
//! ndarray's `general_mat_mul` (matrixmultiply, 2 threads) and faer's `matmul` (2 rayon
//! threads), on the same inputs, alternating, median of `RUNS`. Both results are compared so
//! that a rate is never taken from a wrong product.

use std::time::Instant;

const RUNS: usize = 5;

fn main() {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // (what, m, k, n): C (m×n) = A (m×k) · B (k×n).
    let shapes = [
        ("square 1024", 1024, 1024, 1024),
        ("up/gate forward: x·Wᵀ", 128, 2048, 8192),
        ("down forward", 128, 8192, 2048),
        ("up/gate input grad: δ·W", 128, 8192, 2048),
        ("up/gate weight grad: δᵀ·x", 8192, 128, 2048),
        ("q/o weight grad", 2048, 128, 2048),
        ("head chunk forward", 128, 2048, 4096),
        ("head chunk weight grad", 4096, 128, 2048),
    ];
    println!("threads: {threads}");
    println!("| m×k · k×n | what | ndarray f64 | faer f64 | max |Δ| / max |C| |");
    println!("|---|---|---|---|---|");
    for (what, m, k, n) in shapes {
        let mut seed = 0x9E37_79B9_7F4A_7C15_u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 11) as f64 / (1u64 << 53) as f64 - 0.5
        };
        let a = ndarray::Array2::from_shape_fn((m, k), |_| next());
        let b = ndarray::Array2::from_shape_fn((k, n), |_| next());
        let mut c_nd = ndarray::Array2::<f64>::zeros((m, n));
        let fa = faer::Mat::<f64>::from_fn(m, k, |i, j| a[(i, j)]);
        let fb = faer::Mat::<f64>::from_fn(k, n, |i, j| b[(i, j)]);
        let mut c_faer = faer::Mat::<f64>::zeros(m, n);
        let par = faer::Par::rayon(threads);
        let (mut t_nd, mut t_faer) = (Vec::new(), Vec::new());
        for _ in 0..RUNS {
            let t = Instant::now();
            ndarray::linalg::general_mat_mul(1.0, &a, &b, 0.0, &mut c_nd);
            t_nd.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            faer::linalg::matmul::matmul(&mut c_faer, faer::Accum::Replace, &fa, &fb, 1.0, par);
            t_faer.push(t.elapsed().as_secs_f64());
        }
        let mut diff: f64 = 0.0;
        let mut scale: f64 = 0.0;
        for i in 0..m {
            for j in 0..n {
                diff = diff.max((c_nd[(i, j)] - c_faer[(i, j)]).abs());
                scale = scale.max(c_nd[(i, j)].abs());
            }
        }
        let flops = 2.0 * (m * k * n) as f64;
        let rate = |t: &mut Vec<f64>| {
            t.sort_by(f64::total_cmp);
            flops / t[RUNS / 2] / 1e9
        };
        println!(
            "| {m}×{k} · {k}×{n} | {what} | {:.1} GFLOP/s | {:.1} GFLOP/s | {:.1e} |",
            rate(&mut t_nd),
            rate(&mut t_faer),
            diff / scale
        );
    }
}
