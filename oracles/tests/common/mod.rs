//! Checks shared by the test files: central finite differences of a model's own loss, the norms a
//! recorded trace gives against the reference's report, and a config's refusal.
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

/// The norms of a report's recorded trace, its factors materialized site by site and summed per
/// parameter, against the report's own (the explicit backward pass): every example's total, each
/// parameter's and the tied split, to 1e-12. A wrong activation or backprop would not match.
pub fn assert_trace_gives_the_reported_norms(r: &Reference, what: &str) {
    let m = r.trace.as_ref().expect("a recorded trace");
    let m = m.materialized_norms().unwrap();
    for (i, e) in r.examples.iter().enumerate() {
        let total = m[i].total_sq.sqrt();
        assert!(
            close(total, e.norm, 1e-12),
            "{what} example {i}: {total} vs {}",
            e.norm
        );
        for (name, v) in &e.params {
            assert!(
                close(m[i].per_param_sq[name].sqrt(), *v, 1e-12),
                "{what} {name}"
            );
        }
        if let Some((name, s)) = e.shared.first() {
            let k = &m[i].shared_inner[name];
            assert!(close(k[0][0], s.input_sq, 1e-12) && close(k[1][1], s.output_sq, 1e-12));
            assert!((k[0][1] - s.cross).abs() <= 1e-12 * (s.input_sq + s.output_sq));
        }
    }
}

/// The message of the error a `config.json` is refused with; a config accepted fails the test.
pub fn config_error(json: &str) -> String {
    match ModelConfig::from_json_str(json) {
        Ok(c) => panic!("accepted {json}: {c:?}"),
        Err(e) => e.to_string(),
    }
}
