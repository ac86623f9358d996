//! Where the DP-SGD step's time goes at the GPT-2 tied-head shape (V = 50257, d = 768, T = 128,
//! B = 1, f32): the norm pass, the clipped sum from the factors (the second pass), the noise
//! draws and the update's arithmetic, each timed alone. `cargo bench --bench step_parts`.

use candle_core::{DType, Device, Tensor};
use ghost_oracle::bench::tied_head_trace;
use ghost_oracle::clippers::{clip_coefficients, clipped_sum, noisy_update, NoiseSpec};
use ghost_oracle::{ClipNorm, Clipper, TiedGhostClipper};
use rand_chacha::rand_core::SeedableRng;
use rand_distr::Distribution;

mod common;

fn time<F: FnMut()>(f: F) -> f64 {
    common::median_time(5, f)
}

fn main() {
    let (vocab, hidden, seq) = (50257, 768, 128);
    let trace = tied_head_trace(vocab, hidden, seq, 1, DType::F32, &Device::Cpu).unwrap();
    let report = TiedGhostClipper.norms(&trace).unwrap();
    let c = ClipNorm::new(report.norms[0] / 2.0).unwrap();
    let coefs = clip_coefficients(&report.norms, c);
    let sum = clipped_sum(&trace, &coefs).unwrap();
    let n = vocab * hidden;
    let noise = NoiseSpec {
        std: c.get(),
        divisor: 1.0,
        seed: 1,
    };
    let rows = [
        (
            "norm pass (ghost-tied)",
            time(|| drop(TiedGhostClipper.norms(&trace).unwrap())),
        ),
        (
            "clipped sum Σ c_i g_i from the factors",
            time(|| drop(clipped_sum(&trace, &coefs).unwrap())),
        ),
        (
            "plain gradient Σ g_i from the factors",
            time(|| drop(clipped_sum(&trace, &[1.0]).unwrap())),
        ),
        (
            "noise draws alone, one thread (f32)",
            time(|| {
                let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
                let v: Vec<f32> = (0..n)
                    .map(|_| rand_distr::StandardNormal.sample(&mut rng))
                    .collect();
                drop(v)
            }),
        ),
        (
            "noisy update (draws on every core, add, divide)",
            time(|| drop(noisy_update(&sum, &noise).unwrap())),
        ),
        ("add and divide alone (candle)", {
            let k = &sum[0].1;
            let xi = Tensor::zeros(k.shape(), k.dtype(), k.device()).unwrap();
            time(|| drop(((k + &xi).unwrap() / 2.0).unwrap()))
        }),
    ];
    println!("GPT-2 tied head, V = {vocab}, d = {hidden}, T = {seq}, B = 1, f32; median of 5");
    for (what, s) in rows {
        println!("{what:<50} {s:>9.4} s");
    }
}
