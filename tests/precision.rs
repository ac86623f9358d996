//! Low precision judged for what it is: real Opacus 1.6 norms of bf16 models and of f32 models
//! under bf16 autocast pass, claims 10 %, 50 % and 100 % low fail, the built-in clippers pass in
//! bf16 and f16, and the ε of every such run comes from its measured sensitivity.
//!
//! The golden traces (oracles/golden/traces/precision, made by
//! python/scripts/make_precision_traces.py) hold Opacus's own norms and clip factors; the truth
//! is the f64 materialization of the trace's factors, which shares nothing with the bound.

use crate::cli::{run, stderr, tmp};
use crate::common::{cn, nm};
use ghost_oracle::audit::{builtin_suite, check_trace, run as run_audit};
use ghost_oracle::judge::{Arithmetic, Claim};
use ghost_oracle::{AuditOptions, CheckOptions, Judge, Precision, Verdict};
use ghost_oracle_reference::{read_trace, write_trace, Site, SiteKind, SiteSpec, SplitMix64};
use ghost_oracle_reference::{Trace as RefTrace, TraceMeta};
use ndarray::Array3;
use std::path::{Path, PathBuf};

fn golden_traces() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("oracles/golden/traces/precision");
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    out.sort();
    assert_eq!(out.len(), 6, "{out:?}");
    out
}

/// The trace with its claimed norms scaled and no claimed coefficients (a clipper that
/// believes those norms clips by min(1, C/n)). Factors are written as f32, which holds every
/// bf16 value exactly; the per-site precisions the trace states are kept.
fn scaled(path: &Path, factor: f64) -> PathBuf {
    let (trace, meta) = read_trace(path).unwrap();
    let out = tmp(&format!(
        "precision-{}-{factor}",
        path.file_stem().unwrap().to_string_lossy()
    ))
    .join("t.safetensors");
    let meta = TraceMeta {
        claimed_norms: meta.claimed_norms.iter().map(|n| n * factor).collect(),
        claimed_coefficients: None,
        dtype: Precision::F32,
        compute_dtype: Some(meta.compute_dtype.unwrap_or(meta.dtype)),
        ..meta
    };
    write_trace(&out, &trace, &meta).unwrap();
    out
}

#[test]
fn real_opacus_bf16_and_autocast_norms_pass_and_their_bound_is_tight() {
    for path in golden_traces() {
        let (_, meta) = read_trace(&path).unwrap();
        let autocast = path.to_string_lossy().contains("autocast");
        // Autocast: linear sites bf16, the rest f32; a bf16 model: every site bf16.
        let sites = meta.site_precisions();
        assert!(sites.contains(&Precision::BF16));
        assert_eq!(sites.contains(&Precision::F32), autocast, "{path:?}");
        let a = check_trace(&path, &CheckOptions::default()).unwrap().audit;
        let c = &a.cases[0];
        assert_eq!(a.verdict, Verdict::Pass, "{path:?}: {:?}", c.examples);
        assert_eq!(a.precision, Precision::BF16);
        // The bound is tight: a claim 2 % off is outside it on every example.
        assert!(c.max_bound < 0.02, "{path:?}: bound {}", c.max_bound);
        // Opacus's bf16 rounding is real, and well inside the bound.
        assert!(
            c.max_norm_rel_err > 1e-4 && c.max_err_units < 0.5,
            "{path:?}"
        );
    }
}

#[test]
fn claims_ten_fifty_and_a_hundred_percent_low_fail_at_bf16() {
    for path in golden_traces() {
        for factor in [0.98, 0.9, 0.5, 0.0] {
            let a = check_trace(&scaled(&path, factor), &CheckOptions::default())
                .unwrap()
                .audit;
            assert_ne!(a.verdict, Verdict::Pass, "{path:?} × {factor}");
            // Too-small norms clip too little: every such claim that clips an example lets its
            // contribution past C, and the run's ε says so.
            let s = a.privacy.worst_contribution.unwrap();
            assert_eq!(s, a.cases[0].max_sensitivity_ratio.max(1.0));
            if factor <= 0.9 {
                assert_eq!(a.verdict, Verdict::PrivacyViolation, "{path:?} × {factor}");
                assert!(s > 1.05 && a.privacy.actual() > a.privacy.stated_epsilon);
            }
        }
    }
}

#[test]
fn the_zero_claim_at_t32_is_refused_by_the_gate() {
    // The case that once passed with the old bound (0.905 of it).
    let path = golden_traces()
        .into_iter()
        .find(|p| p.ends_with("bf16_t32.safetensors"))
        .unwrap();
    let zero = scaled(&path, 0.0);
    let o = run(&["check", "--gate", zero.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("PRIVACY-VIOLATION"), "{out}");
    assert!(!out.contains("no clipped contribution above C"), "{out}");
    let o = run(&["check", "--gate", path.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

#[test]
fn wherever_a_contribution_exceeds_c_the_actual_epsilon_exceeds_the_stated_one() {
    for path in golden_traces() {
        for factor in [1.0, 0.999, 0.9] {
            let a = check_trace(&scaled(&path, factor), &CheckOptions::default())
                .unwrap()
                .audit;
            let s = a.cases[0].max_sensitivity_ratio;
            assert_eq!(
                a.privacy.actual() > a.privacy.stated_epsilon,
                s > 1.0,
                "{path:?} × {factor}: sensitivity {s}"
            );
        }
    }
}

#[test]
fn the_built_in_clippers_pass_in_bf16_and_f16_and_ghost_is_still_caught_in_bf16() {
    let clippers = ghost_oracle::registry::clippers(&[]).unwrap();
    for precision in [Precision::BF16, Precision::F16] {
        let opts = AuditOptions {
            precision,
            ..AuditOptions::default()
        };
        let audits = run_audit(builtin_suite(), &clippers, &opts, &mut |_, _, _| {}).unwrap();
        for a in &audits {
            let bound = a.cases.iter().map(|c| c.max_bound).fold(0.0, f64::max);
            assert!(bound < 0.05, "{} {precision}: bound {bound}", a.name);
            match a.name.as_str() {
                "ghost" if precision == Precision::BF16 => {
                    assert_eq!(a.verdict, Verdict::PrivacyViolation)
                }
                "ghost" => assert_ne!(a.verdict, Verdict::Pass),
                _ => assert_eq!(a.verdict, Verdict::Pass, "{} {precision}", a.name),
            }
        }
    }
}

/// One parameter written by two linear sites whose gradients cancel to about a part in 10²: the
/// second site's backprops are the first's negated plus 10⁻² of noise (bf16 keeps it), on the
/// same activations.
/// Rounded to bf16, as a bf16 clipper holds it.
fn cancelling_trace() -> RefTrace {
    let (b, t, p, q) = (2, 6, 4, 3);
    let mut rng = SplitMix64::new(11);
    let act = Array3::from_shape_fn((b, t, p), |_| rng.uniform() - 0.5);
    let bp = Array3::from_shape_fn((b, t, q), |_| rng.uniform() - 0.5);
    let noise = Array3::from_shape_fn((b, t, q), |_| 1e-2 * (rng.uniform() - 0.5));
    let site = |name: &str, backprops: Array3<f64>| Site {
        spec: SiteSpec {
            name: name.into(),
            param: "w".into(),
            kind: SiteKind::Linear,
            vocab: None,
        },
        activations: Some(act.clone()),
        ids: None,
        backprops,
        conv: None,
    };
    RefTrace {
        sites: vec![site("first", bp.clone()), site("second", &noise - &bp)],
    }
    .rounded(Precision::BF16)
}

#[test]
fn a_vacuous_bound_is_cannot_judge_never_a_pass() {
    let judge = Judge::from_trace(cancelling_trace()).unwrap();
    let exact = Claim {
        norms: judge.truth.norms.clone(),
        coefficients: vec![1.0; judge.truth.norms.len()],
        clipped_sum: None,
        clipping: Default::default(),
    };
    let c = cn(judge.truth.norms.iter().cloned().fold(0.0, f64::max) * 2.0);
    let m = judge
        .evaluate("cancelling", &exact, c, nm(1.0), Precision::BF16)
        .unwrap();
    // Even the exact answer is not a pass: the bound could not have told it from a wrong one.
    assert_eq!(m.verdict, Verdict::CannotJudge, "{:?}", m.examples);
    assert!(m.max_bound > 0.1 && !m.unjudgeable_examples.is_empty());
    // The same factors are judged for an f64 clipper.
    let f64 = judge
        .evaluate_at(
            "cancelling",
            &exact,
            c,
            nm(1.0),
            &Arithmetic::Uniform(Precision::F64.unit_roundoff()),
        )
        .unwrap();
    assert_eq!(f64.verdict, Verdict::Pass, "{:?}", f64.examples);
}

#[test]
fn the_cannot_judge_line_names_the_precision_the_shape_and_the_remedy() {
    let rt = cancelling_trace();
    let judge = Judge::from_trace(rt.clone()).unwrap();
    let path = tmp("precision-cannot-judge").join("t.safetensors");
    let meta = TraceMeta {
        clipper: Some("exact".into()),
        compute_dtype: Some(Precision::BF16),
        ..TraceMeta::norms(1.0, judge.truth.norms.clone(), Precision::F32)
    };
    write_trace(&path, &rt, &meta).unwrap();
    let o = run(&["check", "--gate", path.to_str().unwrap()]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{out}{}", stderr(&o));
    assert!(out.contains("CANNOT-JUDGE"), "{out}");
    assert!(
        out.contains("at bf16 the rounding bound is")
            && out.contains("T = 6, widest factor 4")
            && out.contains("store the factors in f32 or accumulate in f32"),
        "{out}"
    );
}
