use crate::common::*;
use candle_core::DType;
use ghost_oracle::*;

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs()
}

crate::device_test!(exact_clippers_match_the_reference_in_f64, |device| {
    for tied in [true, false] {
        let model = tiny(tied, 2, 3);
        let b = batch(3, 9, 23, 4);
        let r = reference_with_trace(&model, &b);
        let trace = Trace::from_reference(r.trace.as_ref().unwrap(), DType::F64, device).unwrap();
        for c in [&TiedGhostClipper as &dyn Clipper, &MaterializeClipper] {
            let rep = c.norms(&trace).unwrap();
            for (i, e) in r.examples.iter().enumerate() {
                assert!(
                    rel(rep.norms[i], e.norm) < 1e-12,
                    "{} tied={tied} ex {i}: {} vs {}",
                    c.name(),
                    rep.norms[i],
                    e.norm
                );
            }
        }
        let ghost = GhostClipper.norms(&trace).unwrap();
        for (i, e) in r.examples.iter().enumerate() {
            match e.shared.first() {
                // ghost misses exactly 2⟨g_in, g_out⟩.
                Some((_, s)) => {
                    let want = e.norm * e.norm - 2.0 * s.cross;
                    assert!(rel(ghost.norms[i].powi(2), want) < 1e-12);
                    assert!(!ghost.warnings.is_empty());
                }
                None => assert!(rel(ghost.norms[i], e.norm) < 1e-12),
            }
        }
    }
});

/// A vocabulary past the width where the Gram splits its reduction across threads: the split
/// must give the reference's norms.
#[test]
fn long_reductions_split_across_threads_keep_the_norm_exact() {
    use ghost_oracle_reference::{Site, SiteKind, SiteSpec, SplitMix64, Trace as RefTrace};
    use ndarray::{Array2, Array3};
    // T(V + d) < V·d: the head takes the Gram route, not materialization. Large enough for the
    // threaded schedules of the Gram (≥ 2^26 flops; a batch of 3 splits V on 2 cores) and of the
    // one-hot sums (≥ 2^16 reads) on any machine with two or more cores.
    let (b, t, d, v) = (3, 160, 256, 9001);
    let mut rng = SplitMix64::new(3);
    let mut dense = |m: usize| Array3::from_shape_fn((b, t, m), |_| rng.normal());
    let (e, h, delta) = (dense(d), dense(d), dense(v));
    // Few distinct ids: every example repeats tokens, so the tied paths overlap.
    let ids = Array2::from_shape_fn((b, t), |(i, j)| ((i * 7 + j * 3) % 37) as i64 * 241);
    let spec = |name: &str, kind, vocab| SiteSpec {
        name: name.into(),
        param: "w".into(),
        kind,
        vocab,
    };
    let rt = RefTrace {
        sites: vec![
            Site {
                spec: spec("emb", SiteKind::Embedding, Some(v)),
                activations: None,
                ids: Some(ids),
                backprops: e,
                conv: None,
            },
            Site {
                spec: spec("head", SiteKind::Linear, None),
                activations: Some(h),
                ids: None,
                backprops: delta,
                conv: None,
            },
        ],
    };
    let truth = rt.materialized_norms().unwrap();
    let trace = Trace::from_reference(&rt, DType::F64, &candle_core::Device::Cpu).unwrap();
    let got = TiedGhostClipper.norms(&trace).unwrap();
    for (i, m) in truth.iter().enumerate() {
        assert!(
            rel(got.norms[i].powi(2), m.total_sq) < 1e-12,
            "{} vs {}",
            got.norms[i].powi(2),
            m.total_sq
        );
    }
}
