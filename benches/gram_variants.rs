//! Variants of the LM head's Gram ΔΔᵀ (B×T×V by its transpose), side by side in one run, the
//! last column the kernel `factor::gram` ships:
//! `cargo bench --bench gram_variants`.

use candle_core::{DType, Device, Tensor};
use ghost_oracle::clippers::gram::{gram, Factor};
mod common;

fn median<F: FnMut()>(f: F) -> f64 {
    common::median_time(7, f)
}

fn main() {
    let v = 50257;
    println!(
        "{:>4} {:>3}  {:>22}  {:>22}  {:>22}  {:>24}  {:>28}",
        "T",
        "B",
        "transposed view GF/s",
        "contiguous copy GF/s",
        "V split in 4 GF/s",
        "V halves, 2 threads GF/s",
        "gemm pieces (shipped) GF/s"
    );
    for (t, b) in [(128, 1), (128, 8), (256, 1), (512, 1)] {
        let x = Tensor::randn(0f32, 1.0, (b, t, v), &Device::Cpu).unwrap();
        let flops = 2.0 * (b * t * t * v) as f64;
        let view = median(|| {
            std::hint::black_box(x.matmul(&x.transpose(1, 2).unwrap()).unwrap());
        });
        let copy = median(|| {
            std::hint::black_box(
                x.matmul(&x.transpose(1, 2).unwrap().contiguous().unwrap())
                    .unwrap(),
            );
        });
        let split = median(|| {
            let chunk = v.div_ceil(4);
            let mut acc: Option<Tensor> = None;
            for k in 0..4 {
                let start = k * chunk;
                let len = chunk.min(v - start);
                let xs = x.narrow(2, start, len).unwrap();
                let g = xs.matmul(&xs.transpose(1, 2).unwrap()).unwrap();
                acc = Some(match acc {
                    None => g,
                    Some(a) => (a + g).unwrap(),
                });
            }
            std::hint::black_box(acc);
        });
        let threads = median(|| {
            let half = v / 2;
            let (a, c) = (
                x.narrow(2, 0, half).unwrap(),
                x.narrow(2, half, v - half).unwrap(),
            );
            let (ga, gc) = std::thread::scope(|s| {
                let ha = s.spawn(|| a.matmul(&a.transpose(1, 2).unwrap()).unwrap());
                let gc = c.matmul(&c.transpose(1, 2).unwrap()).unwrap();
                (ha.join().unwrap(), gc)
            });
            std::hint::black_box((ga + gc).unwrap());
        });
        let dense = Factor::Dense(x.clone());
        let shipped = median(|| {
            std::hint::black_box(gram(&dense, &dense, DType::F32).unwrap());
        });
        println!(
            "{t:>4} {b:>3}  {:>22.1}  {:>22.1}  {:>22.1}  {:>24.1}  {:>28.1}",
            flops / view / 1e9,
            flops / copy / 1e9,
            flops / split / 1e9,
            flops / threads / 1e9,
            flops / shipped / 1e9
        );
    }
}
