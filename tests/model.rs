//! The candle GPT-2 (autograd) against the reference (hand-written backward).

use crate::common::*;
use candle_core::{DType, Tensor};
use ghost_oracle::*;
use ghost_oracle_reference::Reduction;

fn max_rel(a: &Tensor, b: &ndarray::ArrayD<f64>) -> f64 {
    let a: Vec<f64> = a
        .to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0_f64, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b.iter())
        .fold(0.0_f64, |m, (x, y)| m.max((x - y).abs() / scale))
}

crate::device_test!(
    candle_trace_and_batch_gradient_match_the_reference,
    |device| {
        for (tied, reduction) in [(true, Reduction::Mean), (false, Reduction::Sum)] {
            let model = tiny(tied, 2, 11);
            let mut b = batch(3, 7, 23, 12);
            b.labels[(1, 3)] = ghost_oracle_reference::IGNORE;
            let opts = ghost_oracle_reference::Options {
                record_trace: true,
                keep_gradients: true,
                reduction,
            };
            let r = ghost_oracle_reference::compute(&model, &b, &opts, &mut |_, _| {}).unwrap();
            for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
                let ex = CandleGpt2::from_reference(&model, dtype, device)
                    .unwrap()
                    .extract(&b, reduction)
                    .unwrap();
                let rt = r.trace.as_ref().unwrap();
                assert_eq!(ex.trace.sites.len(), rt.sites.len());
                for (c, o) in ex.trace.sites.iter().zip(&rt.sites) {
                    assert_eq!(c.spec, o.spec);
                    let e = max_rel(&c.backprops, &o.backprops.clone().into_dyn());
                    assert!(
                        e < tol,
                        "{dtype:?} site {}: backprops differ by {e:e}",
                        c.spec.name
                    );
                    if let (Some(ca), Some(oa)) = (&c.activations, &o.activations) {
                        let e = max_rel(ca, &oa.clone().into_dyn());
                        assert!(
                            e < tol,
                            "{dtype:?} site {}: activations differ by {e:e}",
                            c.spec.name
                        );
                    }
                }
                // Σ_i g_i of every parameter, from the reference's materialized per-example gradients.
                let grads = r.gradients.as_ref().unwrap();
                let mut offset = 0;
                for ((name, shape), (cname, g)) in r.layout.iter().zip(&ex.batch_gradient) {
                    assert_eq!(name, cname);
                    let n: usize = shape.iter().product();
                    let sum: Vec<f64> = (0..n)
                        .map(|k| grads.iter().map(|gi| gi[offset + k]).sum())
                        .collect();
                    let want = ndarray::ArrayD::from_shape_vec(shape.clone(), sum).unwrap();
                    let e = max_rel(g, &want);
                    assert!(e < tol, "{dtype:?} {name}: batch gradient differs by {e:e}");
                    offset += n;
                }
                for (i, e) in r.examples.iter().enumerate() {
                    assert!(
                        (ex.losses[i] - e.loss).abs() < tol * e.loss.abs(),
                        "loss {i}"
                    );
                }
            }
        }
    }
);
