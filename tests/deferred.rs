//! Statistics deferred until a verdict needs them (docs/tolerances.md): `check` leaves the
//! every-term statistics of its large untied sites as bounds, and takes the figures only of the
//! examples whose findings differ at the two ends. Its verdicts must be the exact tolerance's on
//! every claim, those just inside and just outside each example's bound included.
//!
//! Ground truth: the exact tolerance (`Judge::from_trace`, every term taken), itself held to
//! brute force elsewhere (tolerance.rs's tests and tests/judge.rs).

use ghost_oracle::judge::{Claim, Tolerance};
use ghost_oracle::{ClipNorm, Judge, NoiseMultiplier, Verdict};
use ghost_oracle_reference::{
    ConvGeometry, ConvInput, Precision, Site, SiteKind, SiteSpec, SplitMix64, Trace as RefTrace,
};
use ndarray::Array3;

const B: usize = 6;

fn spec(name: &str, param: &str, kind: SiteKind) -> SiteSpec {
    SiteSpec {
        name: name.into(),
        param: param.into(),
        kind,
        vocab: None,
    }
}

/// A 3×3 convolution over a 24×24 input (576 positions: deferred), its bias, a norm's gain at
/// the same 576 positions (deferred), and a one-row head (exact).
fn trace(seed: u64) -> RefTrace {
    let mut rng = SplitMix64::new(seed);
    let (c_in, c_out, side) = (3, 4, 24);
    let rows = side * side;
    let mut normal = |shape: (usize, usize, usize), relu: bool| {
        Array3::from_shape_simple_fn(shape, || {
            let x = rng.normal();
            if relu {
                x.max(0.0)
            } else {
                x
            }
        })
    };
    let inputs = normal((B, c_in, rows), true);
    // Output gradients with a common direction, as a trained layer's are: random ones over 576
    // positions cancel to a norm so far below their terms' mass that no f32 claim is judgeable.
    let coherent = |x: f64| 1.0 + 0.5 * x;
    let conv_bp = normal((B, rows, c_out), false).mapv(coherent);
    let norm_act = normal((B, rows, c_out), true);
    let norm_bp = normal((B, rows, c_out), false).mapv(coherent);
    let head_act = normal((B, 1, 8), true);
    let head_bp = normal((B, 1, 3), false);
    let geometry = ConvGeometry {
        kernel: vec![3, 3],
        stride: vec![1, 1],
        dilation: vec![1, 1],
        padding: vec![(1, 1), (1, 1)],
        groups: 1,
        input_size: vec![side, side],
    };
    RefTrace {
        sites: vec![
            Site {
                spec: spec("conv.weight", "conv.weight", SiteKind::Linear),
                activations: None,
                ids: None,
                backprops: conv_bp.clone(),
                conv: Some(ConvInput { geometry, inputs }),
            },
            Site {
                spec: spec("conv.bias", "conv.bias", SiteKind::Bias),
                activations: None,
                ids: None,
                backprops: conv_bp,
                conv: None,
            },
            Site {
                spec: spec("norm.weight", "norm.weight", SiteKind::LayerNorm),
                activations: Some(norm_act),
                ids: None,
                backprops: norm_bp,
                conv: None,
            },
            Site {
                spec: spec("head.weight", "head.weight", SiteKind::Linear),
                activations: Some(head_act),
                ids: None,
                backprops: head_bp,
                conv: None,
            },
        ],
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * a.abs().max(b.abs())
}

#[test]
fn the_ends_hold_the_figure_and_refining_gives_it() {
    let t = trace(1);
    let exact = Tolerance::from_trace(&t).unwrap();
    let judge = Judge::from_trace_deferring(t.clone(), &|_, _, _| {}).unwrap();
    let tol = &judge.tolerance;
    let deferred = tol
        .deferred
        .as_ref()
        .expect("the 576-row sites are deferred");
    assert_eq!(
        deferred.sites,
        vec![0, 1, 2],
        "the one-row head is taken exactly"
    );
    assert_eq!(tol.inexact_examples(), (0..B).collect::<Vec<_>>());
    for i in 0..B {
        let (lo, figure, hi) = (deferred.lower[i], exact.abs_terms[i], tol.abs_terms[i]);
        assert!(
            lo <= figure && figure <= hi,
            "example {i}: {lo} ≤ {figure} ≤ {hi}"
        );
        assert!(
            lo < figure && figure < hi,
            "example {i}: the ends are bounds, not the figure"
        );
        assert!(
            close(tol.dot_scale[i], exact.dot_scale[i]),
            "example {i}: D is exact"
        );
    }
    let refined = tol.refined(&t, &(0..B).collect::<Vec<_>>()).unwrap();
    assert!(refined.inexact_examples().is_empty());
    for i in 0..B {
        assert!(
            close(refined.abs_terms[i], exact.abs_terms[i]),
            "example {i}"
        );
        for (j, (r, e)) in refined.own.iter().zip(&exact.own).enumerate() {
            for (what, a, b) in [
                ("abs", r.abs[i], e.abs[i]),
                ("signed", r.signed[i], e.signed[i]),
                ("sq", r.sq[i], e.sq[i]),
                ("gram mass", r.gram_mass[i], e.gram_mass[i]),
            ] {
                assert!(close(a, b), "example {i}, site {j}: {what} {a} vs {b}");
            }
        }
    }
    // Refining some examples leaves the others' bounds as they were.
    let some = tol.refined(&t, &[2]).unwrap();
    assert_eq!(some.inexact_examples(), vec![0, 1, 3, 4, 5]);
    assert_eq!(some.abs_terms[0], tol.abs_terms[0]);
}

#[test]
fn deferred_verdicts_are_the_exact_tolerances_on_claims_at_either_side_of_each_bound() {
    let t = trace(2);
    let exact = Judge::from_trace(t.clone()).unwrap();
    let deferred = Judge::from_trace_deferring(t, &|_, _, _| {}).unwrap();
    let truth = exact.truth.norms.clone();
    let mut sorted = truth.clone();
    sorted.sort_by(f64::total_cmp);
    // About half the examples clipped.
    let c = ClipNorm::new(sorted[B / 2]).unwrap();
    let sigma = NoiseMultiplier::new(1.0).unwrap();
    let (mut left_deferred, mut refined) = (0, 0);
    for precision in [Precision::F32, Precision::BF16, Precision::F64] {
        let claim_of = |norms: Vec<f64>| Claim {
            coefficients: norms.iter().map(|n| (c.get() / n).min(1.0)).collect(),
            norms,
            clipped_sum: None,
            clipping: Default::default(),
        };
        let exact_bounds = exact
            .evaluate("exact", &claim_of(truth.clone()), c, sigma, precision)
            .unwrap()
            .examples
            .iter()
            .map(|e| e.bound)
            .collect::<Vec<_>>();
        // Each example's claim moved by a multiple of its own exact bound, low and high, and
        // a claim 0.1 % low on one example.
        let mut claims = Vec::new();
        for f in [0.0, 0.5, 0.99, 1.01, 2.0, 30.0] {
            for sign in [-1.0, 1.0] {
                claims.push(claim_of(
                    truth
                        .iter()
                        .zip(&exact_bounds)
                        .map(|(n, b)| n * (1.0 + sign * f * b))
                        .collect(),
                ));
            }
        }
        let mut low = truth.clone();
        low[1] *= 0.999;
        claims.push(claim_of(low));
        for (k, claim) in claims.iter().enumerate() {
            let want = exact.evaluate("c", claim, c, sigma, precision).unwrap();
            let got = deferred.evaluate("c", claim, c, sigma, precision).unwrap();
            let at = format!("{precision}, claim {k}");
            assert_eq!(got.verdict, want.verdict, "{at}");
            assert_eq!(got.unjudgeable_examples, want.unjudgeable_examples, "{at}");
            assert_eq!(got.invalid_examples, want.invalid_examples, "{at}");
            for (i, (g, w)) in got.examples.iter().zip(&want.examples).enumerate() {
                assert_eq!(g.judgeable, w.judgeable, "{at}, example {i}");
                let off = |e: &ghost_oracle::judge::ExampleMetrics| e.norm_rel_err > e.bound;
                assert_eq!(off(g), off(w), "{at}, example {i}");
                if g.bound_exact {
                    assert!(close(g.bound, w.bound), "{at}, example {i}");
                    refined += 1;
                } else {
                    // The reported end lies on the verdict's side of the figure.
                    let side = if off(w) {
                        g.bound >= w.bound
                    } else {
                        g.bound <= w.bound
                    };
                    assert!(side, "{at}, example {i}: {} beside {}", g.bound, w.bound);
                    left_deferred += 1;
                }
            }
        }
    }
    assert!(
        left_deferred > 0 && refined > 0,
        "{left_deferred} left deferred, {refined} refined"
    );
    // The verdicts themselves span what the claims were built to reach.
    let v = |claim: Claim| {
        deferred
            .evaluate("c", &claim, c, sigma, Precision::F32)
            .unwrap()
            .verdict
    };
    let exact_claim = Claim {
        coefficients: truth.iter().map(|n| (c.get() / n).min(1.0)).collect(),
        norms: truth.clone(),
        clipped_sum: None,
        clipping: Default::default(),
    };
    assert_eq!(v(exact_claim.clone()), Verdict::Pass);
    // The largest example is clipped: 0.1 % low, its coefficient lets it past C.
    let mut low = exact_claim.norms.clone();
    low[sorted_index(&truth, sorted[B - 1])] *= 0.999;
    let low = Claim {
        coefficients: low.iter().map(|n| (c.get() / n).min(1.0)).collect(),
        norms: low,
        clipped_sum: None,
        clipping: Default::default(),
    };
    assert_eq!(v(low), Verdict::PrivacyViolation);
}

fn sorted_index(v: &[f64], x: f64) -> usize {
    v.iter().position(|&y| y == x).expect("a value of v")
}

#[test]
fn an_example_with_no_gradient_at_the_deferred_sites_is_judged_as_the_exact_tolerance_judges_it() {
    // Example 0's output gradients are zero at every deferred site: both ends of its Σ|terms|
    // there are 0, and still its low-precision figures must be taken, not read as NaN.
    let mut t = trace(3);
    for j in 0..3 {
        t.sites[j]
            .backprops
            .index_axis_mut(ndarray::Axis(0), 0)
            .fill(0.0);
    }
    let exact = Judge::from_trace(t.clone()).unwrap();
    let deferred = Judge::from_trace_deferring(t, &|_, _, _| {}).unwrap();
    let truth = exact.truth.norms.clone();
    let c = ClipNorm::new(truth.iter().copied().fold(0.0, f64::max)).unwrap();
    let claim = Claim {
        coefficients: truth.iter().map(|n| (c.get() / n).min(1.0)).collect(),
        norms: truth.clone(),
        clipped_sum: None,
        clipping: Default::default(),
    };
    let sigma = NoiseMultiplier::new(1.0).unwrap();
    for precision in [Precision::F32, Precision::BF16] {
        let want = exact.evaluate("c", &claim, c, sigma, precision).unwrap();
        let got = deferred.evaluate("c", &claim, c, sigma, precision).unwrap();
        assert_eq!(got.verdict, want.verdict, "{precision}");
        assert_eq!(
            got.unjudgeable_examples, want.unjudgeable_examples,
            "{precision}"
        );
        assert!(
            got.examples[0].bound.is_finite(),
            "{precision}: {}",
            got.examples[0].bound
        );
    }
}
