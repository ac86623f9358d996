//! Detection power: every seeded bug caught with the right verdict class, no false alarm, and
//! the CLI contracts of `mutants` and `audit --clipper mutant:NAME --gate`.

use crate::cli::{gate_on_golden, run, stderr, tmp};
use ghost_oracle::audit::{builtin_suite, kill_matrix, run as run_audit};
use ghost_oracle::mutants::{Mutant, MutantClipper};
use ghost_oracle::report::kill_matrix_table;
use ghost_oracle::*;

#[test]
fn kill_matrix_catches_every_mutant_without_false_alarms() {
    for precision in [Precision::F32, Precision::F64, Precision::BF16] {
        let opts = AuditOptions {
            precision,
            ..AuditOptions::default()
        };
        let m = kill_matrix(&builtin_suite(), &opts, &mut |_, _, _| {}).unwrap();
        assert!(m.ok(), "{precision}\n{}", kill_matrix_table(&m));
        assert_eq!(
            m.rows.iter().filter(|r| r.mutant.is_some()).count(),
            Mutant::ALL.len()
        );
        for r in &m.rows {
            let caught = r.cells.iter().filter(|v| **v != Verdict::Pass).count();
            match r.mutant {
                Some(Mutant::CauchySchwarz) => {
                    assert!(caught > 0 && r.cells.iter().all(|v| *v != Verdict::PrivacyViolation))
                }
                // A Gram taken in bf16 is what a bf16 clipper does: shown, not required.
                Some(m) if !m.visible_at(precision) => {
                    assert!(r.invisible && precision == Precision::BF16, "{}", r.clipper)
                }
                // Its clipped sum implies contributions above C, which f32 and f64 bounds are
                // tight enough to attribute; bf16's worst-case bound on a clipped sum (a tenth
                // of ‖S*‖ on this suite) is not, and there it is a distortion.
                Some(Mutant::TiedHeadUnclipped) if precision != Precision::BF16 => {
                    assert!(r.cells.contains(&Verdict::PrivacyViolation), "{precision}")
                }
                Some(_) => assert!(caught > 0, "{} missed at {precision}", r.clipper),
                None => assert_eq!(caught, 0, "{} flagged", r.clipper),
            }
        }
    }
}

/// A bug in the noise is invisible to an audit without noise, and a bug anywhere in the step to
/// one that does not judge it: shown as such, never counted as caught or missed, and the rest
/// still caught.
#[test]
fn step_bugs_are_seen_only_by_an_audit_that_judges_what_they_corrupt() {
    use ghost_oracle::mutants::Corrupts;
    let suite = builtin_suite();
    for (noise, judge_step) in [(0.0, true), (1.0, false)] {
        let opts = AuditOptions {
            noise_multiplier: NoiseMultiplier::new(noise).unwrap(),
            judge_step,
            ..AuditOptions::default()
        };
        let m = kill_matrix(&suite, &opts, &mut |_, _, _| {}).unwrap();
        assert!(
            m.ok(),
            "σ = {noise}, step {judge_step}\n{}",
            kill_matrix_table(&m)
        );
        for r in &m.rows {
            let Some(mutant) = r.mutant else { continue };
            let unseen = match mutant.corrupts() {
                Corrupts::Norms => false,
                Corrupts::Step => !judge_step,
                Corrupts::Noise => true,
            };
            assert_eq!(r.invisible, unseen, "{} σ = {noise}", r.clipper);
            if !unseen {
                assert!(r.cells.iter().any(|v| *v != Verdict::Pass), "{}", r.clipper);
            }
        }
    }
}

#[test]
fn t1_effective_cases_hide_the_bias_and_repeat_bugs() {
    // With T = 2 only position 0 has a target, so position 1's backprops are all zero: the case
    // behaves as T = 1, where ‖ΔΔᵀ‖_F = Σ(ΔΔᵀ) and no token repeats. Both bugs must slip through
    // there (the reason a T = 1 test suite missed them) and be caught at longer T.
    let opts = AuditOptions {
        precision: Precision::F64,
        ..AuditOptions::default()
    };
    let suite = builtin_suite();
    for m in [Mutant::BiasFrobenius, Mutant::NoRepeatMerge] {
        let a = &run_audit(
            &suite,
            &[Box::new(MutantClipper(m)) as Box<dyn Clipper>],
            &opts,
            &mut |_, _, _| {},
        )
        .unwrap()[0];
        for c in &a.cases {
            let short = c.case.starts_with("tied-T2@");
            // The built-in Llama case has no biases: nothing for the bias bug to get wrong.
            let no_bias = m == Mutant::BiasFrobenius && c.case.starts_with("llama-");
            assert_eq!(
                c.verdict == Verdict::Pass,
                short || no_bias,
                "{} on {}",
                m.name(),
                c.case
            );
        }
    }
}

#[test]
fn mutants_cli_lists_runs_and_writes_json() {
    let o = run(&["mutants", "--list"]);
    assert!(o.status.success());
    let listed = String::from_utf8_lossy(&o.stdout);
    for m in Mutant::ALL {
        assert!(listed.contains(&format!("mutant:{}", m.name())));
    }
    let json = tmp("mutants").join("m.json");
    let o = run(&["mutants", "--json", json.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(doc["ok"], true);
    assert_eq!(doc["rows"].as_array().unwrap().len(), Mutant::ALL.len() + 2);
}

#[test]
fn drop_cross_gate_fails_on_tied_and_passes_on_untied_checkpoints() {
    let gate = |case: &str| gate_on_golden(case, "mutant:drop-cross");
    assert_eq!(gate("tied_l1_h2_t2"), Some(1));
    assert_eq!(gate("tied_l2_h4_t33"), Some(1));
    assert_eq!(gate("untied_l2_h3_t8"), Some(0));
    assert_eq!(gate("untied_l1_h2_t2"), Some(0));
}
