//! Checks shared by the test files: central finite differences of a model's own loss, and the
//! comparison with the PyTorch golden files.
#![allow(dead_code)]

use ghost_oracle_reference::*;
use ndarray::ArrayD;

/// Richardson-extrapolated central difference of example 0's loss along `dir` in `tensor`.
pub fn directional_fd<M: DecoderModel + Clone>(
    model: &M,
    batch: &Batch,
    tensor: &str,
    dir: &ArrayD<f64>,
    h: f64,
) -> f64 {
    let loss_at = |step: f64| {
        let mut m = model.clone();
        let mut found = false;
        for (name, mut t) in m.params_mut().tensors_mut() {
            if name == tensor {
                t.scaled_add(step, dir);
                found = true;
            }
        }
        assert!(found, "no tensor {tensor}");
        example_loss(&m, batch, 0, Reduction::Mean).unwrap()
    };
    let central = |h: f64| (loss_at(h) - loss_at(-h)) / (2.0 * h);
    (4.0 * central(h / 2.0) - central(h)) / 3.0
}

/// The analytic gradient of example 0 with a tied head's two paths added: what a finite
/// difference sees.
pub fn total_gradient<M: DecoderModel>(model: &M, batch: &Batch) -> M::Params {
    let mut g = example_gradient(model, batch, 0, Reduction::Mean, false)
        .unwrap()
        .grad;
    let head = g.lm_head_mut().take().unwrap();
    if model.dims().tie_word_embeddings {
        *g.token_embedding_mut() += &head;
    } else {
        *g.lm_head_mut() = Some(head);
    }
    g
}

/// For every parameter tensor: a random dense direction, the coordinate with the largest
/// gradient and a few sampled coordinates whose gradient is not tiny; each directional
/// derivative must match the finite difference to 1e-6 relative. Returns how many tensors were
/// checked (every one of them, or the test fails).
pub fn check_finite_differences<M: DecoderModel + Clone>(model: &M, batch: &Batch) -> usize {
    let grad = total_gradient(model, batch);
    let mut rng = SplitMix64::new(99);
    let mut checked = 0;
    let tensors = grad.tensors();
    for (name, g) in &tensors {
        let gmax = g.iter().fold(0.0_f64, |a, v| a.max(v.abs()));
        assert!(gmax > 0.0, "{name}: gradient is identically zero");
        let mut dirs = vec![g.mapv(|_| rng.normal())];
        let (imax, _) =
            g.iter().enumerate().fold(
                (0, 0.0),
                |(bi, bv), (i, v)| if v.abs() > bv { (i, v.abs()) } else { (bi, bv) },
            );
        let unit = |i: usize| {
            let mut e = g.mapv(|_| 0.0);
            *e.iter_mut().nth(i).unwrap() = 1.0;
            e
        };
        dirs.push(unit(imax));
        for _ in 0..3 {
            let i = rng.below(g.len());
            if g.iter().nth(i).unwrap().abs() > 1e-3 * gmax {
                dirs.push(unit(i));
            }
        }
        for dir in dirs {
            let analytic: f64 = g.iter().zip(dir.iter()).map(|(a, b)| a * b).sum();
            let fd = directional_fd(model, batch, name, &dir, 1e-3);
            let rel = (fd - analytic).abs() / analytic.abs().max(1e-300);
            assert!(
                rel <= 1e-6,
                "{name}: analytic {analytic:e}, finite difference {fd:e}, relative error {rel:e}"
            );
        }
        checked += 1;
    }
    // The gradient has exactly the model's tensors (a tied head folded into the embedding).
    assert_eq!(checked, model.params().tensors().len());
    checked
}

pub fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * b.abs().max(1e-300)
}
