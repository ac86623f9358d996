//! The RDP accountant against its ground truth: log A_α from a 40-digit quadrature of the
//! definition, ε from Opacus 1.6 and from that integral, PLD ε from dp_accounting, all in
//! oracles/golden/accounting.json (written by oracles/golden/make_accounting.py; no Python
//! runs here). Plus the closed forms, the inverse, and every bad argument.

use ghost_oracle::accountant::{
    default_orders, epsilon, log_a, rdp, sigma_for_epsilon, AccountingError, MAX_ORDER,
};
use serde_json::Value;
use std::sync::OnceLock;

fn golden() -> &'static Value {
    static GOLDEN: OnceLock<Value> = OnceLock::new();
    GOLDEN.get_or_init(|| {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/oracles/golden/accounting.json"
        );
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        serde_json::from_str(&text).unwrap()
    })
}

fn f(v: &Value) -> f64 {
    v.as_f64()
        .unwrap_or_else(|| panic!("not a number in the golden file: {v}"))
}

fn rel(got: f64, want: f64) -> f64 {
    if got == want {
        0.0
    } else {
        ((got - want) / want).abs()
    }
}

/// The rows of the golden ε table: (σ, q, steps, δ, row).
fn epsilon_rows() -> impl Iterator<Item = (f64, f64, u64, f64, &'static Value)> {
    golden()["epsilon"].as_array().unwrap().iter().map(|r| {
        (
            f(&r["sigma"]),
            f(&r["q"]),
            r["steps"].as_u64().unwrap(),
            f(&r["delta"]),
            r,
        )
    })
}

#[test]
fn default_orders_are_opacus_default_alphas_bit_for_bit() {
    let want: Vec<f64> = golden()["orders"]
        .as_array()
        .unwrap()
        .iter()
        .map(f)
        .collect();
    let got = default_orders();
    assert_eq!(got.len(), 151);
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.to_bits(), w.to_bits(), "{g} vs {w}");
    }
    assert_eq!(got.len(), want.len());
}

#[test]
fn log_a_matches_the_quadrature_of_the_definition_to_1e_10_on_the_whole_grid() {
    let orders = default_orders();
    let mut worst = (0.0, 0.0, 0.0, 0.0);
    let mut count = 0;
    for row in golden()["log_a"].as_array().unwrap() {
        let (sigma, q) = (f(&row["sigma"]), f(&row["q"]));
        let exact = row["integral"].as_array().unwrap();
        assert_eq!(exact.len(), orders.len());
        for (&alpha, want) in orders.iter().zip(exact) {
            let got = log_a(q, sigma, alpha).unwrap();
            let e = rel(got, f(want));
            assert!(
                e <= 1e-10,
                "σ = {sigma}, q = {q}, α = {alpha}: ln A = {got:e}, integral {want} (rel {e:.1e})"
            );
            // RDP is the same number divided by α − 1.
            let r = rdp(q, sigma, alpha).unwrap();
            assert!(rel(r, f(want) / (alpha - 1.0)) <= 1e-10);
            if e > worst.0 {
                worst = (e, sigma, q, alpha);
            }
            count += 1;
        }
    }
    assert_eq!(count, 30 * 151);
    eprintln!(
        "ln A vs integral: worst rel {:.1e} at σ = {}, q = {}, α = {}",
        worst.0, worst.1, worst.2, worst.3
    );
}

/// The points where the libraries drift from the integral, and 40 seeded random points off
/// the grid (q up to 0.998, σ up to 50, orders up to 64).
#[test]
fn log_a_matches_the_quadrature_off_the_grid() {
    let g = golden();
    let points = g["disagreements"].as_array().unwrap().iter();
    let points: Vec<&Value> = points.chain(g["spot_checks"].as_array().unwrap()).collect();
    assert!(points.len() >= 40);
    let mut worst = 0.0f64;
    for p in points {
        let (q, sigma, alpha) = (f(&p["q"]), f(&p["sigma"]), f(&p["alpha"]));
        let want = f(&p["integral"]);
        let got = log_a(q, sigma, alpha).unwrap();
        let e = rel(got, want);
        assert!(
            e <= 1e-10,
            "q = {q}, σ = {sigma}, α = {alpha}: {got:e} vs integral {want:e}"
        );
        worst = worst.max(e);
        // Where a library is off by more than 1e-10, we are closer to the integral.
        for lib in ["opacus", "dp_accounting"] {
            if let Some(v) = p[lib].as_f64() {
                if rel(v, want) > 1e-10 {
                    assert!(e < rel(v, want) / 100.0, "{lib} at {p}");
                }
            }
        }
    }
    eprintln!("ln A vs integral off the grid: worst rel {worst:.1e}");
}

/// Opacus's own ln A_α loses digits when A_α − 1 is tiny (it sums terms of size 1), and a
/// million steps multiply that: at q = 1e-4, σ = 0.5 its ε is 5e-9 off the integral's. The
/// tolerance is 1e-9 plus Opacus's measured distance from the integral at that point.
#[test]
fn epsilon_matches_opacus_to_1e_9_beyond_its_own_error_with_the_same_optimal_order() {
    let orders = default_orders();
    let mut worst = 0.0f64;
    let mut compared = 0;
    let mut beyond = 0;
    for (sigma, q, steps, delta, row) in epsilon_rows() {
        let Some(want) = row["opacus"].as_object() else {
            continue;
        };
        let got = epsilon(q, sigma, steps, delta, &orders).unwrap();
        let opacus = f(&want["epsilon"]);
        let e = rel(got.epsilon, opacus);
        let own = rel(opacus, f(&row["integral"]["epsilon"]));
        let at = format!("σ = {sigma}, q = {q}, steps = {steps}, δ = {delta}: {got:?} vs {want:?}");
        assert!(
            e <= 1e-9 + 1.01 * own,
            "{at} (rel {e:.1e}, Opacus vs integral {own:.1e})"
        );
        beyond += usize::from(e > 1e-9);
        assert_eq!(got.order, f(&want["order"]), "{at}");
        assert_eq!(
            got.at_grid_edge,
            want["at_grid_edge"].as_bool().unwrap(),
            "{at}"
        );
        worst = worst.max(e);
        compared += 1;
    }
    assert!(compared >= 200, "only {compared} Opacus points");
    eprintln!(
        "ε vs Opacus: worst rel {worst:.1e} over {compared} points, {beyond} above 1e-9 \
         (each within Opacus's own distance from the integral)"
    );
}

#[test]
fn epsilon_matches_the_one_from_the_integral_to_1e_11() {
    let orders = default_orders();
    let mut worst = 0.0f64;
    for (sigma, q, steps, delta, row) in epsilon_rows() {
        let want = &row["integral"];
        let got = epsilon(q, sigma, steps, delta, &orders).unwrap();
        let e = rel(got.epsilon, f(&want["epsilon"]));
        assert!(
            e <= 1e-11,
            "σ = {sigma}, q = {q}, steps = {steps}, δ = {delta}: {got:?} vs {want} (rel {e:.1e})"
        );
        assert_eq!(got.order, f(&want["order"]));
        worst = worst.max(e);
    }
    eprintln!("ε vs integral: worst rel {worst:.1e}");
}

/// PLD accounting is tighter than RDP, but dp_accounting rounds each step's privacy loss up to
/// its grid: at the default 1e-4 a million steps at q = 1e-4 add more than RDP's slack (there
/// its ε is up to 16 % above ours). The finer grid (1e-5) is used where the golden file has it.
#[test]
fn rdp_epsilon_is_never_below_the_tighter_pld_epsilon() {
    let orders = default_orders();
    let mut compared = 0;
    let mut worst = 0.0f64;
    for (sigma, q, steps, delta, row) in epsilon_rows() {
        let Some(pld) = row["pld_fine"].as_f64().or(row["pld"].as_f64()) else {
            continue;
        };
        let got = epsilon(q, sigma, steps, delta, &orders).unwrap().epsilon;
        assert!(
            got >= pld - 1e-3 * pld.max(1.0),
            "σ = {sigma}, q = {q}, steps = {steps}, δ = {delta}: RDP ε {got} < PLD ε {pld}"
        );
        if pld > 0.0 {
            worst = worst.max(pld / got);
        }
        compared += 1;
    }
    assert!(compared >= 200, "only {compared} PLD points");
    eprintln!("PLD ε / RDP ε: at most {worst:.3} over {compared} points");
}

#[test]
fn epsilon_grows_with_steps_and_falls_with_sigma() {
    let g = golden();
    let orders = default_orders();
    let sigmas: Vec<f64> = g["sigmas"].as_array().unwrap().iter().map(f).collect();
    let qs: Vec<f64> = g["qs"].as_array().unwrap().iter().map(f).collect();
    let eps = |q, s, n| epsilon(q, s, n, 1e-5, &orders).unwrap().epsilon;
    for &q in &qs {
        for &s in &sigmas {
            let by_steps: Vec<f64> = [1, 10, 100, 10_000, 1_000_000]
                .iter()
                .map(|&n| eps(q, s, n))
                .collect();
            assert!(
                by_steps.windows(2).all(|w| w[0] < w[1]),
                "q = {q}, σ = {s}: {by_steps:?}"
            );
        }
        for n in [1, 1000] {
            let by_sigma: Vec<f64> = sigmas.iter().map(|&s| eps(q, s, n)).collect();
            assert!(
                by_sigma.windows(2).all(|w| w[0] > w[1]),
                "q = {q}, steps = {n}: {by_sigma:?}"
            );
        }
    }
    // ... and with q.
    let by_q: Vec<f64> = qs.iter().map(|&q| eps(q, 1.0, 100)).collect();
    assert!(by_q.windows(2).all(|w| w[0] < w[1]), "{by_q:?}");
}

#[test]
fn closed_forms_at_q_0_q_1_sigma_0_and_infinite_order() {
    let orders = default_orders();
    for sigma in [0.3, 0.5, 1.0, 2.5, 7.0] {
        for &alpha in &orders {
            assert_eq!(
                rdp(1.0, sigma, alpha).unwrap(),
                alpha / (2.0 * sigma * sigma)
            );
            assert_eq!(
                log_a(1.0, sigma, alpha).unwrap(),
                alpha * (alpha - 1.0) / (2.0 * sigma * sigma)
            );
            assert_eq!(rdp(0.0, sigma, alpha).unwrap(), 0.0);
            assert_eq!(log_a(0.0, sigma, alpha).unwrap(), 0.0);
        }
        assert_eq!(rdp(0.01, sigma, f64::INFINITY).unwrap(), f64::INFINITY);
        assert_eq!(rdp(0.0, sigma, f64::INFINITY).unwrap(), 0.0);
        assert_eq!(rdp(1.0, sigma, f64::INFINITY).unwrap(), f64::INFINITY);
    }
    for alpha in [1.5, 2.0, 63.0] {
        assert_eq!(rdp(0.01, 0.0, alpha).unwrap(), f64::INFINITY);
        assert_eq!(rdp(0.0, 0.0, alpha).unwrap(), 0.0);
    }
    // No noise: ε = +∞ at the first order (Opacus returns the same).
    let none = epsilon(0.01, 0.0, 10, 1e-5, &orders).unwrap();
    assert_eq!(none.epsilon, f64::INFINITY);
    assert_eq!(none.order, orders[0]);
    // q = 0: only the conversion term remains, its minimum over α; with an infinite order in
    // the grid the bound is 0 (pure DP).
    let idle = epsilon(0.0, 1.0, 10, 1e-5, &orders).unwrap();
    let floor = orders
        .iter()
        .map(|&a| (-1.0 / a).ln_1p() - (1e-5f64.ln() + a.ln()) / (a - 1.0))
        .fold(f64::INFINITY, f64::min);
    assert_eq!(idle.epsilon, floor);
    assert!(idle.at_grid_edge && idle.order == 63.0);
    let pure = epsilon(0.0, 1.0, 10, 1e-5, &[2.0, f64::INFINITY]).unwrap();
    assert_eq!((pure.epsilon, pure.order), (0.0, f64::INFINITY));
}

#[test]
fn sigma_for_epsilon_inverts_the_opacus_epsilon() {
    let orders = default_orders();
    let mut checked = 0;
    let mut worst = 0.0f64;
    for (sigma, q, steps, delta, row) in epsilon_rows() {
        let Some(want) = row["opacus"]["epsilon"].as_f64() else {
            continue;
        };
        // 10 000 and a million steps at δ = 1e-5: enough points, and the test stays quick.
        if steps < 10_000 || delta != 1e-5 {
            continue;
        }
        let found = sigma_for_epsilon(q, steps, delta, want, &orders).unwrap();
        let e = rel(found, sigma);
        assert!(
            e < 1e-7,
            "q = {q}, steps = {steps}, ε = {want}: σ = {found}, Opacus ran σ = {sigma}"
        );
        worst = worst.max(e);
        checked += 1;
    }
    assert!(checked >= 55, "only {checked} points");
    eprintln!("σ from Opacus's ε: worst rel {worst:.1e} over {checked} points");
}

#[test]
fn sigma_for_epsilon_round_trips() {
    let orders = default_orders();
    for (q, steps, delta, target) in [
        (0.01, 10_000, 1e-5, 3.0),
        (0.001, 1_000_000, 1e-8, 1.0),
        (0.1, 100, 1e-5, 0.5),
        (1.0, 1, 1e-5, 8.0),
        (0.004, 50_000, 1e-6, 10.0),
        (0.5, 3, 1e-3, 0.2),
    ] {
        let sigma = sigma_for_epsilon(q, steps, delta, target, &orders).unwrap();
        let at = epsilon(q, sigma, steps, delta, &orders).unwrap().epsilon;
        assert!(
            at <= target && at >= target * (1.0 - 1e-9),
            "q = {q}, steps = {steps}: σ = {sigma} gives ε = {at}, target {target}"
        );
        let less = epsilon(q, sigma * (1.0 - 1e-6), steps, delta, &orders)
            .unwrap()
            .epsilon;
        assert!(less > target, "σ = {sigma} is not the smallest: {less}");
    }
}

#[test]
fn unreachable_targets_are_errors_that_name_the_floor() {
    let orders = default_orders();
    let floor = epsilon(0.0, 1.0, 1, 1e-5, &orders).unwrap().epsilon;
    assert!(floor > 0.1 && floor < 0.2, "{floor}");
    let err = sigma_for_epsilon(0.01, 1000, 1e-5, floor * 0.99, &orders).unwrap_err();
    assert_eq!(
        err,
        AccountingError::Unreachable {
            target: floor * 0.99,
            floor
        }
    );
    assert!(err.to_string().contains("unreachable"), "{err}");
    // Just above the floor it is reachable, with a large σ.
    let sigma = sigma_for_epsilon(0.01, 1000, 1e-5, floor + 0.05, &orders).unwrap();
    assert!(sigma > 1.0);
    // q = 0: every σ, including none, meets a target above the floor.
    assert_eq!(
        sigma_for_epsilon(0.0, 1000, 1e-5, floor + 0.01, &orders),
        Ok(0.0)
    );
    assert!(sigma_for_epsilon(0.0, 1000, 1e-5, floor * 0.5, &orders).is_err());
    // Zero and negative targets are below the floor at this δ ...
    for target in [0.0, -1.0] {
        assert!(matches!(
            sigma_for_epsilon(0.01, 1000, 1e-5, target, &orders),
            Err(AccountingError::Unreachable { .. })
        ));
    }
    // ... but a large δ pulls the floor below 0, and a negative ε is then reachable (Opacus
    // does not clamp ε at 0 either).
    let loose = epsilon(0.0, 1.0, 1, 0.5, &orders).unwrap().epsilon;
    assert!(loose < 0.0, "{loose}");
    let sigma = sigma_for_epsilon(0.01, 10, 0.5, loose / 2.0, &orders).unwrap();
    let at = epsilon(0.01, sigma, 10, 0.5, &orders).unwrap().epsilon;
    assert!(at <= loose / 2.0 && at > loose, "{at}");
}

#[test]
fn every_bad_argument_is_an_error_naming_it_and_its_range() {
    use AccountingError as E;
    let o = default_orders();
    let cases: Vec<(Result<f64, E>, E, &str)> = vec![
        (
            log_a(1.5, 1.0, 2.0),
            E::SamplingRate(1.5),
            "q = 1.5 is outside [0, 1]",
        ),
        (
            log_a(-0.1, 1.0, 2.0),
            E::SamplingRate(-0.1),
            "q = -0.1 is outside [0, 1]",
        ),
        (
            rdp(f64::INFINITY, 1.0, 2.0),
            E::SamplingRate(f64::INFINITY),
            "q = inf",
        ),
        (
            log_a(0.1, -1.0, 2.0),
            E::NoiseMultiplier(-1.0),
            "σ = -1 is outside [0, ∞)",
        ),
        (
            rdp(0.1, f64::INFINITY, 2.0),
            E::NoiseMultiplier(f64::INFINITY),
            "σ = inf",
        ),
        (
            log_a(0.1, 1.0, 1.0),
            E::Order(1.0),
            "α = 1 is outside (1, 1000000]",
        ),
        (rdp(0.1, 1.0, 0.5), E::Order(0.5), "α = 0.5"),
        (
            rdp(0.1, 1.0, -f64::INFINITY),
            E::Order(-f64::INFINITY),
            "α = -inf",
        ),
        (
            log_a(0.1, 1.0, 2.0 * MAX_ORDER),
            E::Order(2.0 * MAX_ORDER),
            "α = 2000000",
        ),
        (
            epsilon(0.1, 1.0, 0, 1e-5, &o).map(|s| s.epsilon),
            E::NoSteps,
            "steps = 0",
        ),
        (
            epsilon(0.1, 1.0, 10, 0.0, &o).map(|s| s.epsilon),
            E::Delta(0.0),
            "δ = 0 is outside (0, 1)",
        ),
        (
            epsilon(0.1, 1.0, 10, 1.0, &o).map(|s| s.epsilon),
            E::Delta(1.0),
            "δ = 1 is outside (0, 1)",
        ),
        (
            epsilon(0.1, 1.0, 10, 1e-5, &[]).map(|s| s.epsilon),
            E::NoOrders,
            "empty",
        ),
        (
            epsilon(0.1, 1.0, 10, 1e-5, &[2.0, 1.0]).map(|s| s.epsilon),
            E::Order(1.0),
            "α = 1",
        ),
        (
            epsilon(2.0, 1.0, 10, 1e-5, &o).map(|s| s.epsilon),
            E::SamplingRate(2.0),
            "q = 2",
        ),
        (
            epsilon(0.1, -0.5, 10, 1e-5, &o).map(|s| s.epsilon),
            E::NoiseMultiplier(-0.5),
            "σ = -0.5",
        ),
        (
            sigma_for_epsilon(0.1, 10, 1e-5, -f64::INFINITY, &o),
            E::TargetEpsilon(-f64::INFINITY),
            "target ε = -inf is not a finite number",
        ),
        (
            sigma_for_epsilon(0.1, 10, 1e-5, f64::INFINITY, &o),
            E::TargetEpsilon(f64::INFINITY),
            "target ε = inf",
        ),
        (
            sigma_for_epsilon(0.1, 0, 1e-5, 1.0, &o),
            E::NoSteps,
            "steps = 0",
        ),
        (
            sigma_for_epsilon(0.1, 10, 2.0, 1.0, &o),
            E::Delta(2.0),
            "δ = 2",
        ),
        (
            sigma_for_epsilon(-1.0, 10, 1e-5, 1.0, &o),
            E::SamplingRate(-1.0),
            "q = -1",
        ),
        (
            sigma_for_epsilon(0.1, 10, 1e-5, 1.0, &[]),
            E::NoOrders,
            "empty",
        ),
    ];
    for (got, want, message) in cases {
        let err = got.expect_err(message);
        assert_eq!(err, want);
        let text = err.to_string();
        assert!(text.contains(message), "{text:?} lacks {message:?}");
        let _: &dyn std::error::Error = &err;
    }
    // NaN anywhere is refused too (NaN ≠ NaN, so match on the variant).
    assert!(matches!(log_a(f64::NAN, 1.0, 2.0), Err(E::SamplingRate(_))));
    assert!(matches!(
        log_a(0.1, f64::NAN, 2.0),
        Err(E::NoiseMultiplier(_))
    ));
    assert!(matches!(log_a(0.1, 1.0, f64::NAN), Err(E::Order(_))));
    assert!(matches!(
        epsilon(0.1, 1.0, 1, f64::NAN, &o),
        Err(E::Delta(_))
    ));
    assert!(matches!(
        epsilon(0.1, 1.0, 1, 1e-5, &[f64::NAN]),
        Err(E::Order(_))
    ));
    assert!(matches!(
        sigma_for_epsilon(0.1, 10, 1e-5, f64::NAN, &o),
        Err(E::TargetEpsilon(_))
    ));
    assert!(log_a(0.1, 1.0, f64::NAN)
        .unwrap_err()
        .to_string()
        .contains("α = NaN"));
}

#[test]
fn extreme_arguments_give_numbers_not_nan_or_panics() {
    let qs = [5e-324, 1e-300, 1e-8, 0.5, 1.0 - 1e-16];
    let sigmas = [1e-300, 1e-160, 1e-140, 1e-3, 1e3, 1e140, 1e160, 1e300];
    let alphas = [1.0 + 1e-12, 1.5, 2.0, 63.0, 63.5, 1e3 + 0.5, f64::INFINITY];
    for q in qs {
        for sigma in sigmas {
            for alpha in alphas {
                let la = log_a(q, sigma, alpha).unwrap();
                let r = rdp(q, sigma, alpha).unwrap();
                assert!(
                    la >= 0.0 && r >= 0.0,
                    "q = {q}, σ = {sigma}, α = {alpha}: ln A = {la}, RDP = {r}"
                );
            }
            let e = epsilon(q, sigma, u64::MAX, 1e-300, &alphas).unwrap();
            assert!(!e.epsilon.is_nan(), "q = {q}, σ = {sigma}: {e:?}");
        }
    }
    // Very large noise: RDP vanishes, ε falls to the floor of the conversion.
    let floor = epsilon(0.0, 1.0, 1, 1e-5, &default_orders())
        .unwrap()
        .epsilon;
    let quiet = epsilon(0.01, 1e6, 1000, 1e-5, &default_orders()).unwrap();
    assert!(quiet.epsilon >= floor && quiet.epsilon < floor + 1e-6);
}
