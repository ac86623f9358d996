#![allow(dead_code)]
use ghost_oracle_reference as reference;
use ndarray::Array2;
use reference::{Batch, Gpt2, Gpt2Config, Options};

/// A seeded batch with repeated tokens: ids drawn from a small range.
pub fn batch(b: usize, t: usize, vocab: usize, seed: u64) -> Batch {
    let mut rng = reference::SplitMix64::new(seed);
    let ids = Array2::from_shape_fn((b, t), |_| rng.below(vocab.min(6)) as i64);
    Batch::new(ids, None).unwrap()
}

pub fn tiny(tied: bool, layers: usize, seed: u64) -> Gpt2 {
    let cfg = Gpt2Config::tiny(23, 16, 8, layers, 2);
    Gpt2::random(if tied { cfg } else { cfg.untied() }, seed, 0.5)
}

pub fn reference_with_trace(model: &Gpt2, batch: &Batch) -> reference::Reference {
    let opts = Options {
        record_trace: true,
        keep_gradients: true,
        ..Options::default()
    };
    reference::compute(model, batch, &opts, &mut |_| {}).unwrap()
}

/// Generates `<name>::cpu` and, with the `cuda` feature, `<name>::cuda` from one test body
/// that takes the device.
#[macro_export]
macro_rules! device_test {
    ($name:ident, $body:expr) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            #[test]
            fn cpu() {
                let body: fn(&candle_core::Device) = $body;
                body(&candle_core::Device::Cpu);
            }

            #[cfg(feature = "cuda")]
            #[test]
            fn cuda() {
                let body: fn(&candle_core::Device) = $body;
                body(&candle_core::Device::new_cuda(0).expect("a CUDA device"));
            }
        }
    };
}

/// Two examples of three positions over two-wide sites and a vocabulary of 4, no cancellation:
/// a small valid synthetic trace to edit.
pub fn tiny_synthetic_spec() -> ghost_oracle::synthetic::SyntheticSpec {
    ghost_oracle::synthetic::SyntheticSpec {
        batch: 2,
        seq: 3,
        width: 2,
        vocab: 4,
        id_range: 4,
        cancellation: 0.0,
        leftover_log10: -3.0,
        scale_log10_range: 0.0,
    }
}

/// C for a test that knows it is positive.
pub fn cn(c: f64) -> ghost_oracle::ClipNorm {
    ghost_oracle::ClipNorm::new(c).unwrap()
}

/// σ for a test that knows it is non-negative.
pub fn nm(sigma: f64) -> ghost_oracle::NoiseMultiplier {
    ghost_oracle::NoiseMultiplier::new(sigma).unwrap()
}
