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
