//! Properties of the norm math on random factored traces (proptest; shapes shrink first), and
//! the false-alarm sweep: correct clippers must never be flagged, whatever the shapes, scales or
//! cancellation. `PROPTEST_CASES=10000 cargo test --release --test integration false_alarm --
//! --nocapture` runs the long sweep.

use candle_core::{DType, Device, Tensor};
use ghost_oracle::synthetic::{synthetic_trace, SyntheticSpec};
use ghost_oracle::*;
use ghost_oracle_reference::Trace as RefTrace;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

fn spec_strategy() -> impl Strategy<Value = (SyntheticSpec, u64)> {
    (
        (1usize..5, 1usize..10, 1usize..8, 1usize..16, 1usize..16),
        prop_oneof![Just(0.0), 0.0..1.0f64, Just(1.0)],
        -6.0..0.0f64,
        0.0..3.0f64,
        any::<u64>(),
    )
        .prop_map(
            |(
                (batch, seq, width, vocab, id_range),
                cancellation,
                leftover_log10,
                scale_log10_range,
                seed,
            )| {
                (
                    SyntheticSpec {
                        batch,
                        seq,
                        width,
                        vocab,
                        id_range,
                        cancellation,
                        leftover_log10,
                        scale_log10_range,
                    },
                    seed,
                )
            },
        )
}

fn to_candle(t: &RefTrace, dtype: DType) -> Trace {
    Trace::from_reference(t, dtype, &Device::Cpu).unwrap()
}

fn close(a: f64, b: f64, scale: f64) -> bool {
    (a - b).abs() <= 1e-11 * scale.max(1e-300)
}

proptest! {
    #[test]
    fn gram_identity_equals_materialization((spec, seed) in spec_strategy()) {
        let rt = synthetic_trace(&spec, seed);
        let t = to_candle(&rt, DType::F64);
        let m = rt.materialized_norms().unwrap();
        let f: Vec<factor::Factored> = t.sites.iter().map(|s| factor::Factored::of(s).unwrap()).collect();
        for (j, fj) in f.iter().enumerate() {
            let own = factor::inner(fj, fj, DType::F64).unwrap();
            // Rounding is relative to the absolute sum of the terms (cancellation), not the result.
            let abs = factor::to_f64_vec(&factor::term_magnitudes(fj, fj, DType::F64).unwrap().0).unwrap();
            for (i, v) in own.iter().enumerate() {
                let g = rt.site_gradient(j, i).unwrap();
                let want: f64 = g.iter().map(|x| x * x).sum();
                prop_assert!(close(*v, want, abs[i]), "site {} example {i}: gram {v} vs materialized {want}", t.sites[j].spec.name);
            }
        }
        for (param, j, k) in t.shared_pairs() {
            let x = factor::inner(&f[j], &f[k], DType::F64).unwrap();
            let abs = factor::to_f64_vec(&factor::term_magnitudes(&f[j], &f[k], DType::F64).unwrap().0).unwrap();
            for (i, v) in x.iter().enumerate() {
                let inner = &m[i].shared_inner[&param];
                let pos = |s: usize| rt.params().into_iter().find(|(p, _)| *p == param).unwrap().1.iter().position(|&z| z == s).unwrap();
                let want = inner[pos(j)][pos(k)];
                prop_assert!(close(*v, want, abs[i]), "{param} example {i}: cross {v} vs {want}");
            }
        }
    }

    #[test]
    fn tied_norm_is_the_materialized_norm_and_ghost_misses_exactly_the_cross_terms((spec, seed) in spec_strategy()) {
        let rt = synthetic_trace(&spec, seed);
        let t = to_candle(&rt, DType::F64);
        let truth = rt.materialized_norms().unwrap();
        let tied = TiedGhostClipper.norms(&t).unwrap();
        let ghost = GhostClipper.norms(&t).unwrap();
        for (i, e) in truth.iter().enumerate() {
            let own: f64 = tied.site_sq.iter().map(|s| s[i]).sum();
            let cross: f64 = tied.cross.iter().map(|c| c.values[i]).sum();
            let abs: f64 = own + 2.0 * tied.cross.iter().map(|c| c.values[i].abs()).sum::<f64>();
            prop_assert!(close(tied.norms[i].powi(2), e.total_sq, abs), "tied {} vs {}", tied.norms[i].powi(2), e.total_sq);
            prop_assert!(close(ghost.norms[i].powi(2), e.total_sq - 2.0 * cross, abs));
        }
    }

    #[test]
    fn norms_are_invariant_under_permutations_and_scale_with_a_factor((spec, seed) in spec_strategy(), a in -5.0..5.0f64) {
        let rt = synthetic_trace(&spec, seed);
        let base = TiedGhostClipper.norms(&to_candle(&rt, DType::F64)).unwrap();
        let abs = |r: &NormReport, i: usize| r.site_sq.iter().map(|s| s[i].abs()).sum::<f64>()
            + 2.0 * r.cross.iter().map(|c| c.values[i].abs()).sum::<f64>();

        // Reverse positions (same permutation at every site) and examples.
        let mut rev = rt.clone();
        for s in &mut rev.sites {
            s.backprops.invert_axis(ndarray::Axis(1));
            s.backprops.invert_axis(ndarray::Axis(0));
            if let Some(x) = &mut s.activations { x.invert_axis(ndarray::Axis(1)); x.invert_axis(ndarray::Axis(0)); }
            if let Some(ids) = &mut s.ids { ids.invert_axis(ndarray::Axis(1)); ids.invert_axis(ndarray::Axis(0)); }
        }
        let r = TiedGhostClipper.norms(&to_candle(&rev, DType::F64)).unwrap();
        let b = base.norms.len();
        for i in 0..b {
            prop_assert!(close(r.norms[b - 1 - i].powi(2), base.norms[i].powi(2), abs(&base, i)));
        }

        // Scale the conv site's activations by a: its own squared norm scales by a².
        let j = rt.sites.iter().position(|s| s.spec.name == "conv.weight").unwrap();
        let mut scaled = rt.clone();
        scaled.sites[j].activations.as_mut().unwrap().mapv_inplace(|v| v * a);
        let r = TiedGhostClipper.norms(&to_candle(&scaled, DType::F64)).unwrap();
        for i in 0..b {
            prop_assert!(close(r.site_sq[j][i], a * a * base.site_sq[j][i], a * a * base.site_sq[j][i]));
        }

        // Swap the two sites of the tied pair: the cross term and the norm do not change.
        let mut swapped = rt.clone();
        swapped.sites.swap(0, 1);
        let r = TiedGhostClipper.norms(&to_candle(&swapped, DType::F64)).unwrap();
        for i in 0..b {
            prop_assert!(close(r.cross[0].values[i], base.cross[0].values[i], abs(&base, i)));
            prop_assert!(close(r.norms[i].powi(2), base.norms[i].powi(2), abs(&base, i)));
        }
    }

    #[test]
    fn true_norms_pass_and_shrunk_norms_violate_privacy_past_the_bound((spec, seed) in spec_strategy()) {
        let rt = synthetic_trace(&spec, seed);
        let truth = Truth::from_trace(&rt).unwrap();
        let trace = to_candle(&rt, DType::F64);
        let u = unit_roundoff(DType::F64);
        let c = truth.norms.iter().cloned().fold(f64::INFINITY, f64::min) * 0.5; // every example clipped
        let claim = |scale: &dyn Fn(usize) -> f64| {
            let norms: Vec<f64> = truth.norms.iter().enumerate().map(|(i, n)| n * scale(i)).collect();
            let coefficients = clip_coefficients(&norms, c);
            let clipped_sum = clipped_sum(&trace, &coefficients).unwrap();
            let report = NormReport { norms, ..Default::default() };
            evaluate("prop", &truth, &Clipped { report, coefficients, clipped_sum }, c, 1.0, u).unwrap()
        };
        let exact = claim(&|_| 1.0);
        prop_assert_eq!(exact.verdict, Verdict::Pass);
        prop_assert!(exact.max_sensitivity_ratio <= 1.0 + 1e-12 && exact.decision_flips == 0);
        // Claim example 0 smaller by 3× its bound: a privacy violation whenever that is < 1.
        let eps = 3.0 * truth.norm_bound(0, u);
        if eps < 0.5 {
            let shrunk = claim(&|i| if i == 0 { 1.0 - eps } else { 1.0 });
            prop_assert_eq!(shrunk.verdict, Verdict::PrivacyViolation);
            let slightly = claim(&|i| if i == 0 { 1.0 - eps / 6.0 } else { 1.0 });
            prop_assert_eq!(slightly.verdict, Verdict::Pass);
        }
    }
}

/// Correct clippers in f32 and f64 are never flagged on random shapes, T = 1 upwards, repeated
/// ids, scales over six decades and near-total cancellation of the tied paths; f16-gram is.
#[test]
fn false_alarm_sweep() {
    let mut runner = TestRunner::new(Config::default());
    let stats = std::cell::RefCell::new((0usize, 0.0f64, 0usize));
    let result = runner.run(&spec_strategy(), |(spec, seed)| {
        let rt = synthetic_trace(&spec, seed);
        let truth = Truth::from_trace(&rt).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut sorted = truth.norms.clone();
        sorted.sort_by(|a, b| a.total_cmp(b));
        let c = sorted[sorted.len() / 2];
        for dtype in [DType::F32, DType::F64] {
            let trace = to_candle(&rt, dtype);
            let u = unit_roundoff(dtype);
            for clipper in [&TiedGhostClipper as &dyn Clipper, &MaterializeClipper] {
                let m = evaluate(
                    "sweep",
                    &truth,
                    &clipper.clip(&trace, c).unwrap(),
                    c,
                    1.0,
                    u,
                )
                .unwrap();
                prop_assert_eq!(
                    m.verdict,
                    Verdict::Pass,
                    "{} {:?}: {:?} {:?}",
                    clipper.name(),
                    dtype,
                    spec,
                    m.examples[m.worst_example]
                );
                let mut st = stats.borrow_mut();
                st.1 = st.1.max(m.max_err_units);
            }
            if dtype == DType::F32 {
                let m = evaluate(
                    "sweep",
                    &truth,
                    &MutantClipper(Mutant::F16Gram).clip(&trace, c).unwrap(),
                    c,
                    1.0,
                    u,
                )
                .unwrap();
                stats.borrow_mut().2 += (m.verdict != Verdict::Pass) as usize;
            }
        }
        stats.borrow_mut().0 += 1;
        Ok(())
    });
    let (cases, max_units, f16_caught) = *stats.borrow();
    eprintln!(
        "false-alarm sweep: {cases} cases, 0 false alarms, largest error {max_units:.3e} of the bound; f16-gram caught on {f16_caught}/{cases}"
    );
    result.unwrap();
    assert!(max_units < 1.0);
    assert!(
        f16_caught * 10 >= cases * 8,
        "f16-gram caught on only {f16_caught}/{cases}"
    );
}

#[test]
fn a_gram_without_repeat_merging_is_caught_by_the_identity_property() {
    // The planted bug of docs/detection.md: treating onehot(x_t)·onehot(x_s) as [t = s].
    let spec = SyntheticSpec {
        batch: 1,
        seq: 4,
        width: 2,
        vocab: 3,
        id_range: 1,
        cancellation: 0.0,
        leftover_log10: -3.0,
        scale_log10_range: 0.0,
    };
    let rt = synthetic_trace(&spec, 1);
    let t = to_candle(&rt, DType::F64);
    let f = factor::Factored::of(&t.sites[0]).unwrap();
    let right = factor::gram(&f.right, &f.right, DType::F64).unwrap();
    let eye = Tensor::eye(4, DType::F64, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let buggy: f64 = (right * eye)
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar()
        .unwrap();
    let want: f64 = rt.site_gradient(0, 0).unwrap().iter().map(|x| x * x).sum();
    assert!(
        !close(buggy, want, want),
        "all ids equal: merging repeats must matter"
    );
}
