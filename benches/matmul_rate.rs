//! Measured matrix-multiply rates on this machine, the yardstick for the reference's and the
//! clippers' speed: `cargo bench --bench matmul_rate`.

use candle_core::{DType, Device, Tensor};
use ndarray::Array2;

mod common;

fn time<F: FnMut()>(f: F) -> f64 {
    common::median_time(5, f)
}

fn main() {
    // (m, k, n): a square product and the GPT-2 head shapes (T = 128, d = 768, V = 50257).
    // The last two are the head's Gram ΔΔᵀ at T = 128 and 512.
    let shapes = [
        (1024, 1024, 1024),
        (128, 768, 50257),
        (50257, 128, 768),
        (128, 50257, 128),
        (512, 50257, 512),
    ];
    println!(
        "{:>22}  {:>16}  {:>16}",
        "m×k · k×n", "ndarray f64 GF/s", "candle f32 GF/s"
    );
    for (m, k, n) in shapes {
        let flops = 2.0 * (m * k * n) as f64;
        let a = Array2::<f64>::from_shape_fn((m, k), |(i, j)| ((i * 7 + j * 3) % 11) as f64 * 0.1);
        let b = Array2::<f64>::from_shape_fn((k, n), |(i, j)| ((i * 5 + j) % 13) as f64 * 0.1);
        let t64 = time(|| {
            std::hint::black_box(a.dot(&b));
        });
        let ca = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).unwrap();
        let cb = Tensor::randn(0f32, 1.0, (k, n), &Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let t32 = time(|| {
            std::hint::black_box(ca.matmul(&cb).unwrap());
        });
        println!(
            "{:>22}  {:>16.1}  {:>16.1}",
            format!("{m}×{k}·{k}×{n}"),
            flops / t64 / 1e9,
            flops / t32 / 1e9
        );
    }
}
