//! Renamed CLI flags keep their old spelling, hidden, until the version `DEPRECATED_UNTIL` in
//! src/cli/mod.rs names: `audit --dtype` and `mutants --dtype` (now `--precision`) do what
//! `--precision` does with a note on stderr, and both spellings at once are a usage error.

use crate::cli::{expect_input_error, run, run_on_golden, stderr};
use std::process::Output;

const NOTE: &str = "ghost-oracle: --dtype is deprecated and goes in 0.2: use --precision";

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn the_old_flag_spellings_go_in_the_version_they_name() {
    let version: Vec<u64> = env!("CARGO_PKG_VERSION")
        .split('.')
        .map(|p| p.parse().unwrap())
        .collect();
    assert!(
        (version[0], version[1]) < (0, 2),
        "ghost-oracle {} has reached 0.2: remove --dtype from audit and mutants",
        env!("CARGO_PKG_VERSION")
    );
}

#[test]
fn audit_takes_dtype_as_precision_with_a_note() {
    let audit = |args: &[&str]| {
        let base = ["--clipper", "ghost-tied", "--no-step"];
        run_on_golden("audit", "tied_l1_h2_t2", &[&base[..], args].concat())
    };
    let (old, new, f32) = (
        audit(&["--dtype", "f16"]),
        audit(&["--precision", "f16"]),
        audit(&[]),
    );
    assert_eq!(old.status.code(), Some(0), "{}", stderr(&old));
    assert!(stderr(&old).contains(NOTE), "{}", stderr(&old));
    assert!(!stderr(&new).contains("deprecated"), "{}", stderr(&new));
    // the audit --precision f16 makes, not the default f32's
    assert_eq!(stdout(&old), stdout(&new));
    assert_ne!(stdout(&old), stdout(&f32));
}

#[test]
fn mutants_takes_dtype_as_precision_with_a_note() {
    let old = run(&["mutants", "--dtype", "f64"]);
    let new = run(&["mutants", "--precision", "f64"]);
    let f32 = run(&["mutants"]);
    assert_eq!(old.status.code(), new.status.code());
    assert!(stderr(&old).contains(NOTE), "{}", stderr(&old));
    assert_eq!(stdout(&old), stdout(&new));
    assert_ne!(stdout(&old), stdout(&f32));
}

#[test]
fn both_spellings_at_once_are_a_usage_error() {
    for sub in ["audit", "mutants"] {
        expect_input_error(
            &[sub, "--dtype", "f16", "--precision", "f16"],
            &["--dtype", "--precision", "cannot be used with"],
        );
    }
}

#[test]
fn the_old_spelling_is_hidden_from_help() {
    for sub in ["audit", "mutants"] {
        let help = stdout(&run(&[sub, "--help"]));
        assert!(help.contains("--precision"), "{sub}: {help}");
        assert!(!help.contains("--dtype"), "{sub}: {help}");
    }
}
