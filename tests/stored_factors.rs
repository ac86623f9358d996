//! `check` judges a trace file's factors held as they are stored (f32, f16 and bf16 as f32),
//! widened to f64 an example at a time. Widening is exact, so the truth, the tolerance and every
//! verdict must be the bits the same file gives read widened to f64 whole: a conv stored as its
//! input (plain and grouped), its bias and a norm at 576 positions (deferred statistics), and an
//! embedding tied with its head (cross terms).
//!
//! Ground truth: the same file read by `read_trace_within` (every factor widened to f64 as it is
//! read, the judge's reading before factors were held as stored), and for the verdicts a claim
//! 0.1 % off, which the f32 bound must catch.

use ghost_oracle::judge::{Claim, ClippingRule, Precision};
use ghost_oracle::{ClipNorm, Judge, NoiseMultiplier, Verdict};
use ghost_oracle_reference::{
    read_stored_trace_within, read_trace_within, write_trace, ConvGeometry, ConvInput, Factors,
    MemoryBudget, Site, SiteKind, SiteSpec, SplitMix64, Trace as RefTrace, TraceMeta,
};
use ndarray::{Array2, Array3};

const B: usize = 4;

fn spec(name: &str, param: &str, kind: SiteKind, vocab: Option<usize>) -> SiteSpec {
    SiteSpec {
        name: name.into(),
        param: param.into(),
        kind,
        vocab,
    }
}

fn geometry(side: usize, groups: usize) -> ConvGeometry {
    ConvGeometry {
        kernel: vec![3, 3],
        stride: vec![1, 1],
        dilation: vec![1, 1],
        padding: vec![(1, 1), (1, 1)],
        groups,
        input_size: vec![side, side],
    }
}

fn trace(seed: u64) -> RefTrace {
    let mut rng = SplitMix64::new(seed);
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
    let (side, small, v, t) = (24, 6, 9, 5);
    let rows = side * side;
    // Output gradients with a common direction, as a trained layer's are, so that an f32 bound
    // over 576 positions is tight enough to judge.
    let coherent = |x: f64| 1.0 + 0.5 * x;
    let conv_bp = normal((B, rows, 4), false).mapv(coherent);
    let sites = vec![
        Site {
            spec: spec("conv.weight", "conv.weight", SiteKind::Linear, None),
            activations: None,
            ids: None,
            backprops: conv_bp.clone(),
            conv: Some(ConvInput {
                geometry: geometry(side, 1),
                inputs: normal((B, 3, rows), true),
            }),
        },
        Site {
            spec: spec("conv.bias", "conv.bias", SiteKind::Bias, None),
            activations: None,
            ids: None,
            backprops: conv_bp,
            conv: None,
        },
        Site {
            spec: spec("norm.weight", "norm.weight", SiteKind::LayerNorm, None),
            activations: Some(normal((B, rows, 4), true)),
            ids: None,
            backprops: normal((B, rows, 4), false).mapv(coherent),
            conv: None,
        },
        Site {
            spec: spec("grouped.weight", "grouped.weight", SiteKind::Linear, None),
            activations: None,
            ids: None,
            backprops: normal((B, small * small, 4), false).mapv(coherent),
            conv: Some(ConvInput {
                geometry: geometry(small, 2),
                inputs: normal((B, 4, small * small), true),
            }),
        },
        Site {
            spec: spec("wte", "wte.weight", SiteKind::Embedding, Some(v)),
            activations: None,
            ids: Some(Array2::from_shape_fn((B, t), |(i, k)| {
                ((i * 4 + k * 3) % v) as i64
            })),
            backprops: normal((B, t, 6), false),
            conv: None,
        },
        Site {
            spec: spec("head", "wte.weight", SiteKind::Linear, None),
            activations: Some(normal((B, t, 6), false)),
            ids: None,
            backprops: normal((B, t, v), false),
            conv: None,
        },
    ];
    RefTrace { sites }
}

/// Each example's claim: the true norm times `scale[i]`, flat coefficients at C = 1.
fn claim(norms: &[f64], scale: &[f64]) -> Claim {
    let norms: Vec<f64> = norms.iter().zip(scale).map(|(n, s)| n * s).collect();
    Claim {
        coefficients: norms.iter().map(|&n| (1.0 / n).min(1.0)).collect(),
        norms,
        clipped_sum: None,
        clipping: ClippingRule::default(),
    }
}

/// The judge of both readings: truth, tolerance and the metrics of `claims` the same bits.
#[track_caller]
fn assert_same_judgement<F: Factors, G: Factors>(
    stored: &Judge<F>,
    wide: &Judge<G>,
    claims: &[Claim],
    precision: Precision,
    what: &str,
) {
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let (s, w) = (&stored.truth, &wide.truth);
    assert_eq!(bits(&s.norms), bits(&w.norms), "{what}: true norms");
    for (i, (a, b)) in s.gram.iter().zip(&w.gram).enumerate() {
        assert_eq!(bits(a), bits(b), "{what}: Gram row {i}");
    }
    assert_eq!(
        format!("{:?}", s.cross_share),
        format!("{:?}", w.cross_share),
        "{what}"
    );
    for ((p, a), (q, b)) in s.param_sq.iter().zip(&w.param_sq) {
        assert_eq!((p, bits(a)), (q, bits(b)), "{what}");
    }
    // Every statistic of the tolerance: Debug writes each f64 so that it reads back to its bits.
    assert_eq!(
        format!("{:?}", stored.tolerance),
        format!("{:?}", wide.tolerance),
        "{what}: tolerance"
    );
    let c = ClipNorm::new(1.0).unwrap();
    for (k, claim) in claims.iter().enumerate() {
        let a = stored.evaluate("c", claim, c, NoiseMultiplier::ONE, precision);
        let b = wide.evaluate("c", claim, c, NoiseMultiplier::ONE, precision);
        // Every figure of the case and of each example, the verdict among them.
        let json = |m: ghost_oracle::judge::CaseMetrics| serde_json::to_string(&m).unwrap();
        assert_eq!(json(a.unwrap()), json(b.unwrap()), "{what}: claim {k}");
    }
}

#[test]
fn a_trace_held_as_stored_is_judged_as_its_f64_reading_bit_for_bit() {
    let t = trace(7);
    let dir = std::env::temp_dir().join(format!("ghost-oracle-stored-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for dtype in [Precision::F32, Precision::BF16] {
        let path = dir.join(format!("{}.safetensors", dtype.name()));
        write_trace(&path, &t, &TraceMeta::norms(1.0, vec![1.0; B], dtype)).unwrap();
        let budget = MemoryBudget::bytes(1 << 30);
        let (stored, _) = read_stored_trace_within(&path, budget).unwrap();
        let (wide, _) = read_trace_within(&path, budget).unwrap();
        let what = dtype.name();

        let exact = (
            Judge::from_trace(stored.clone()).unwrap(),
            Judge::from_trace(wide.clone()).unwrap(),
        );
        let norms = exact.1.truth.norms.clone();
        // Claims at the truth, a rounding's width off, and one example 0.1 % low.
        let claims = [
            claim(&norms, &[1.0; B]),
            claim(&norms, &[1.0 + 1e-7, 1.0 - 1e-7, 1.0, 1.0 + 3e-7]),
            claim(&norms, &[1.0, 1.0, 1.0 - 1e-3, 1.0]),
        ];
        assert_same_judgement(&exact.0, &exact.1, &claims, dtype, what);
        let deferring = (
            Judge::from_trace_deferring(stored, &|_, _, _| {}).unwrap(),
            Judge::from_trace_deferring(wide, &|_, _, _| {}).unwrap(),
        );
        assert!(
            deferring.0.tolerance.deferred.is_some(),
            "{what}: the 576-position sites are deferred"
        );
        assert_same_judgement(&deferring.0, &deferring.1, &claims, dtype, what);

        // The judgement is one that can fail: at f32 the claims at the truth pass and the
        // 0.1 % low one fails, on both readings.
        if dtype == Precision::F32 {
            for judge in [&exact.0, &deferring.0] {
                let c = ClipNorm::new(1.0).unwrap();
                let at = |k: usize| {
                    judge
                        .evaluate("c", &claims[k], c, NoiseMultiplier::ONE, dtype)
                        .unwrap()
                        .verdict
                };
                assert_eq!(at(0), Verdict::Pass, "{what}");
                assert_ne!(at(2), Verdict::Pass, "{what}");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
