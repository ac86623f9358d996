#!/usr/bin/env python3
"""Regenerates oracles/golden/accounting.json, the ground truth for src/accountant.

    pip install opacus dp-accounting mpmath
    python3 oracles/golden/make_accounting.py              # about 75 minutes on two cores
    python3 oracles/golden/make_accounting.py --summary    # the numbers of docs/privacy.md
    python3 oracles/golden/make_accounting.py --reuse-log-a  # keep the integrals, redo the rest

What it writes:

* `log_a`: log A_alpha of the Poisson-subsampled Gaussian mechanism for every (sigma, q) of the
  grid and every order of Opacus's RDPAccountant.DEFAULT_ALPHAS, from the definition

      A_alpha = E_{z ~ N(0, sigma^2)} [ ((1 - q) + q exp((2z - 1) / (2 sigma^2)))^alpha ]

  by mpmath tanh-sinh quadrature at 40 digits. Every value is recomputed at 50 digits on a
  different partition of the line and the two must agree to 1e-20 relative, or the script stops.
  Beside it, the worst relative error of Opacus's and dp_accounting's own log A_alpha on that
  (sigma, q) row.
* `epsilon`: for every (sigma, q, steps, delta), epsilon from the integral (the log A above
  through the conversion of Balle et al. 2020, Thm 21, minimized over the same orders), from
  Opacus (compute_rdp + get_privacy_spent), from dp_accounting's RdpAccountant with the same
  orders, and from dp_accounting's PLDAccountant at its default discretization (`pld`) and at a
  ten times finer one (`pld_fine`, where the epsilon is small enough). null where a library gave
  an infinite or NaN epsilon or could not finish (the PLD of the noisiest compositions needs
  more memory than the limit set here; `pld_note` says why).
* `disagreements`: single points where a library's log A_alpha is measurably off the integral;
  `spot_checks`: seeded random points off the grid (q up to 0.998, sigma up to 50).
"""
import json
import math
import multiprocessing as mproc
import os
import platform
import random
import subprocess
import sys
import time
import warnings

import mpmath as mp

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "accounting.json")

SIGMAS = [0.3, 0.5, 0.8, 1.0, 2.0, 5.0]
QS = [1e-4, 1e-3, 0.01, 0.1, 1.0]
STEPS = [1, 100, 10_000, 1_000_000]
DELTAS = [1e-5, 1e-8]
DPS = 40
CHECK_DPS = 50
CHECK_TOL = 1e-20
WORKERS = 2
PLD_MEMORY_BYTES = 6 << 30
PLD_TIMEOUT_S = 300
# dp_accounting's default discretization of the privacy loss, and a finer one. The default
# rounds every step's loss up by up to 1e-4, which a million steps at q = 1e-4 notice (there
# the PLD epsilon is above the RDP one); the finer one is tried where the RDP epsilon is small
# enough for its grid to fit in memory.
PLD_INTERVAL = 1e-4
PLD_FINE_INTERVAL = 1e-5
PLD_FINE_MAX_EPSILON = 20.0
# Single (q, sigma, alpha) points: the first two are where dp_accounting 0.6 is reported off the
# integral; the rest probe what the grid does not (q > 1/2, large orders, large sigma).
DISAGREEMENT_POINTS = [
    (0.25, 2.5, 6.8), (0.01, 1.0, 7.8), (0.1, 1.0, 2.5), (1e-3, 0.5, 30.5),
    (0.6, 1.5, 3.7), (0.9, 4.0, 1.5), (0.05, 0.7, 100.5), (0.3, 10.0, 250.0),
]
SPOT_SEED = 2019
SPOT_COUNT = 40


def spot_points():
    """Seeded random (q, sigma, alpha) off the grid: q up to 0.998, sigma 0.3 .. 50, fractional
    and integer orders up to 64."""
    rng = random.Random(SPOT_SEED)
    pts = []
    for _ in range(SPOT_COUNT):
        q = 10 ** rng.uniform(-6, -0.001)
        sigma = 10 ** rng.uniform(-0.5, 1.7)
        alpha = rng.choice([1 + 3 * rng.random(), rng.uniform(1, 64), float(rng.randint(2, 64))])
        pts.append((q, sigma, max(round(alpha, 3), 1.001)))
    return pts


def default_orders():
    return [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))


# ---------------------------------------------------------------------------------------------
# log A_alpha by quadrature


def _log_integrand_float(z, q, sigma, alpha):
    """log of the integrand without the Gaussian's normalization, in floats (for the scan)."""
    s2 = 2.0 * sigma * sigma
    t = (2.0 * z - 1.0) / s2 + math.log(q)
    if q == 1.0:
        inner = t
    else:
        a = math.log1p(-q)
        hi, lo = max(a, t), min(a, t)
        inner = hi + math.log1p(math.exp(lo - hi))
    return -z * z / s2 + alpha * inner


def log_a_quad(q, sigma, alpha, dps, step, pad):
    """log A_alpha by quadrature at `dps` digits on pieces `step` sigmas long.

    The integrand is a sum of Gaussian bumps centred between 0 and alpha, each sigma wide. A
    float scan finds where it is within e^-130 of its maximum; the integral runs over that
    range widened by `pad` sigmas, cut into pieces so that every piece is resolved.
    """
    lo, hi = -40.0 * sigma, max(alpha, 1.0) + 40.0 * sigma
    n = 4000
    zs = [lo + (hi - lo) * k / n for k in range(n + 1)]
    vals = [_log_integrand_float(z, q, sigma, alpha) for z in zs]
    top = max(vals)
    kept = [z for z, v in zip(zs, vals, strict=True) if v > top - 130.0]
    a, b = kept[0] - pad * sigma, kept[-1] + pad * sigma
    with mp.workdps(dps):
        mq, ms, ma = mp.mpf(q), mp.mpf(sigma), mp.mpf(alpha)
        s2 = 2 * ms * ms
        shift = mp.mpf(top)

        def f(z):
            return mp.exp(-z * z / s2 + ma * mp.log((1 - mq) + mq * mp.exp((2 * z - 1) / s2)) - shift)

        h = mp.mpf(step) * ms
        pts = [mp.mpf(a)]
        while pts[-1] + h < b:
            pts.append(pts[-1] + h)
        pts.append(mp.mpf(b))
        integral = mp.quad(f, pts)
        return shift + mp.log(integral) - mp.log(ms * mp.sqrt(2 * mp.pi))


def log_a_job(args):
    q, sigma, alpha = args
    t0 = time.time()
    main = log_a_quad(q, sigma, alpha, DPS, 2.0, 1.0)
    check = log_a_quad(q, sigma, alpha, CHECK_DPS, 1.3, 2.5)
    with mp.workdps(CHECK_DPS):
        rel = abs(main - check) / abs(check)
    if rel > CHECK_TOL:
        raise RuntimeError(f"quadrature did not converge at q={q} sigma={sigma} alpha={alpha}: "
                           f"{mp.nstr(main, 30)} vs {mp.nstr(check, 30)} (rel {float(rel):.2e})")
    if q == 1.0:
        with mp.workdps(DPS):
            a = mp.mpf(alpha)
            closed = a * (a - 1) / (2 * mp.mpf(sigma) ** 2)
            off = abs(main - closed) > 1e-25 * closed
        if off:
            raise RuntimeError(f"q = 1 integral {main} differs from the closed form {closed}")
    return q, sigma, alpha, mp.nstr(main, 30), float(rel), time.time() - t0


# ---------------------------------------------------------------------------------------------
# the libraries


def opacus_log_a(q, sigma, alpha):
    from opacus.accountants.analysis import rdp as orp
    if q == 1.0:
        return float(orp.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=[alpha])[0] * (alpha - 1))
    return float(orp._compute_log_a(q, sigma, alpha))


def dpa_log_a(q, sigma, alpha):
    from dp_accounting.rdp import rdp_privacy_accountant as drp
    if q == 1.0:
        return float(alpha * (alpha - 1) / (2 * sigma**2))
    return float(drp._compute_log_a(q, sigma, alpha))


def finite_or_none(x):
    x = float(x)
    return x if math.isfinite(x) else None


def opacus_epsilon(q, sigma, steps, delta, orders):
    from opacus.accountants.analysis import rdp as orp
    rdp = orp.compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eps, order = orp.get_privacy_spent(orders=orders, rdp=rdp, delta=delta)
    edge = any("Optimal order is the" in str(w.message) for w in caught)
    if finite_or_none(eps) is None:
        return None
    return {"epsilon": float(eps), "order": float(order), "at_grid_edge": edge}


def dpa_event(q, sigma, steps):
    import dp_accounting as dpa
    return dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)


def dpa_rdp_epsilon(q, sigma, steps, delta, orders):
    import dp_accounting as dpa
    acc = dpa.rdp.RdpAccountant(orders=orders)
    acc.compose(dpa_event(q, sigma, steps))
    eps, order = acc.get_epsilon_and_optimal_order(delta)
    if finite_or_none(eps) is None:
        return None
    return {"epsilon": float(eps), "order": float(order)}


PLD_CHILD = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({mem}, {mem}))
import dp_accounting as dpa
q, sigma, steps, form = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
acc = dpa.pld.PLDAccountant(value_discretization_interval={interval})
if form == "gaussian":
    # q = 1: `steps` Gaussian mechanisms compose to one with noise sigma / sqrt(steps).
    acc.compose(dpa.GaussianDpEvent(sigma / steps ** 0.5))
else:
    acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps))
print(json.dumps([acc.get_epsilon(d) for d in {deltas}]))
"""


def pld_epsilons(q, sigma, steps, interval):
    """PLD epsilons for every delta, in a child process with a memory cap; (values, note)."""
    form = "gaussian" if q == 1.0 else "sampled"
    code = PLD_CHILD.format(mem=PLD_MEMORY_BYTES, deltas=repr(DELTAS), interval=repr(interval))
    try:
        out = subprocess.run([sys.executable, "-c", code, repr(q), repr(sigma), str(steps), form],
                             capture_output=True, text=True, timeout=PLD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [None] * len(DELTAS), f"did not finish in {PLD_TIMEOUT_S} s"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        if "MemoryError" in last or "bad_alloc" in last or "Unable to allocate" in last:
            return [None] * len(DELTAS), f"needs more than {PLD_MEMORY_BYTES >> 30} GiB"
        return [None] * len(DELTAS), last[:200]
    vals = [finite_or_none(v) for v in json.loads(out.stdout)]
    note = "q = 1 composed as one Gaussian with noise sigma/sqrt(steps)" if form == "gaussian" else None
    return vals, note


def epsilon_job(args):
    q, sigma, steps, orders, log_as = args
    t0 = time.time()
    rows = []
    integral = []
    for delta in DELTAS:
        with mp.workdps(DPS):
            best, best_order = None, None
            for alpha, la in zip(orders, log_as, strict=True):
                a = mp.mpf(alpha)
                e = steps * mp.mpf(la) / (a - 1) + mp.log1p(-1 / a) - (mp.log(delta) + mp.log(a)) / (a - 1)
                if best is None or e < best:
                    best, best_order = e, alpha
        integral.append({"epsilon": float(best), "order": float(best_order)})
    pld, note = pld_epsilons(q, sigma, steps, PLD_INTERVAL)
    if None not in pld and max(i["epsilon"] for i in integral) <= PLD_FINE_MAX_EPSILON:
        fine, fine_note = pld_epsilons(q, sigma, steps, PLD_FINE_INTERVAL)
    else:
        fine, fine_note = [None] * len(DELTAS), (
            f"not tried (RDP epsilon above {PLD_FINE_MAX_EPSILON:g} or coarse PLD failed)")
    for k, delta in enumerate(DELTAS):
        rows.append({
            "sigma": sigma, "q": q, "steps": steps, "delta": delta,
            "integral": integral[k],
            "opacus": opacus_epsilon(q, sigma, steps, delta, orders),
            "dp_accounting_rdp": dpa_rdp_epsilon(q, sigma, steps, delta, orders),
            "pld": pld[k],
            "pld_note": note,
            "pld_fine": fine[k],
            "pld_fine_note": fine_note,
        })
    return rows, time.time() - t0


def rel_err(x, exact):
    with mp.workdps(DPS):
        return float(abs(mp.mpf(x) - exact) / abs(exact))


def main(reuse_log_a=False):
    t_start = time.time()
    import dp_accounting
    import numpy
    import opacus
    import scipy
    from opacus.accountants import RDPAccountant

    orders = default_orders()
    assert orders == list(RDPAccountant.DEFAULT_ALPHAS), "Opacus changed its default orders"

    # log A_alpha over the grid
    jobs = [(q, s, a) for s in SIGMAS for q in QS for a in orders]
    exact = {}
    worst_check = 0.0
    if reuse_log_a:
        # The integrals of the existing file (as floats), to redo only the library columns.
        old = json.load(open(OUT))
        assert old["orders"] == orders
        for row in old["log_a"]:
            for a, v in zip(orders, row["integral"], strict=True):
                exact[(row["sigma"], row["q"], a)] = repr(v)
        assert len(exact) == len(jobs), "the existing file lacks some integrals"
        worst_check = old["quadrature"]["max_check_rel_diff"]
        t_log_a = old["runtime_seconds"]["log_a"]
        print(f"reusing the {len(exact)} integrals of {OUT}", flush=True)
    else:
        print(f"{len(jobs)} integrals on {WORKERS} processes", flush=True)
        with mproc.Pool(WORKERS) as pool:
            for n, (q, s, a, val, rel, _) in enumerate(pool.imap_unordered(log_a_job, jobs, chunksize=4), 1):
                exact[(s, q, a)] = val
                worst_check = max(worst_check, rel)
                if n % 100 == 0 or n == len(jobs):
                    print(f"  log A: {n}/{len(jobs)} after {time.time() - t_start:.0f} s", flush=True)
        t_log_a = time.time() - t_start
    t_rest = time.time()

    log_a_rows = []
    for s in SIGMAS:
        for q in QS:
            vals = [exact[(s, q, a)] for a in orders]
            row = {"sigma": s, "q": q, "integral": [float(mp.mpf(v)) for v in vals]}
            for name, fn in (("opacus", opacus_log_a), ("dp_accounting", dpa_log_a)):
                worst, where, nonfinite = 0.0, None, []
                for a, v in zip(orders, vals, strict=True):
                    got = fn(q, s, a)
                    if not math.isfinite(got):
                        nonfinite.append(a)
                        continue
                    e = rel_err(got, mp.mpf(v))
                    if e > worst:
                        worst, where = e, a
                row[f"{name}_max_rel_err"] = worst
                row[f"{name}_max_rel_err_order"] = where
                # orders where the library returned inf/NaN (dp_accounting: series not converged)
                row[f"{name}_nonfinite_orders"] = nonfinite
            log_a_rows.append(row)

    # epsilon over the grid
    ejobs = [(q, s, n, orders, [exact[(s, q, a)] for a in orders]) for s in SIGMAS for q in QS for n in STEPS]
    eps_rows = []
    t_eps0 = time.time()
    with mproc.Pool(WORKERS) as pool:
        for n, (rows, dt) in enumerate(pool.imap_unordered(epsilon_job, ejobs), 1):
            eps_rows.extend(rows)
            r = rows[0]
            print(f"  epsilon: {n}/{len(ejobs)} (sigma={r['sigma']} q={r['q']} steps={r['steps']}, "
                  f"{dt:.1f} s)", flush=True)
    eps_rows.sort(key=lambda r: (r["sigma"], r["q"], r["steps"], r["delta"]))
    t_eps = time.time() - t_eps0

    # the documented disagreements, and random points off the grid
    points = {"disagreements": DISAGREEMENT_POINTS, "spot_checks": spot_points()}
    singles = {name: [] for name in points}
    with mproc.Pool(WORKERS) as pool:
        for name, pts in points.items():
            for q, s, a, val, _, _ in pool.map(log_a_job, pts):
                with mp.workdps(DPS):
                    x = mp.mpf(val)
                    o, d = opacus_log_a(q, s, a), dpa_log_a(q, s, a)
                    singles[name].append({
                        "q": q, "sigma": s, "alpha": a, "integral": float(x), "integral_digits": val,
                        "opacus": finite_or_none(o), "opacus_rel_err": finite_or_none(rel_err(o, x)),
                        "dp_accounting": finite_or_none(d),
                        "dp_accounting_rel_err": finite_or_none(rel_err(d, x))})
                r = singles[name][-1]
                print(f"  {name}: q={q:.4g} sigma={s:.4g} alpha={a}: opacus {r['opacus_rel_err']}, "
                      f"dp_accounting {r['dp_accounting_rel_err']}", flush=True)

    out = {
        "about": "Ground truth for src/accountant; written by oracles/golden/make_accounting.py",
        "command": "python3 oracles/golden/make_accounting.py",
        "versions": {
            "python": platform.python_version(), "opacus": opacus.__version__,
            "dp_accounting": getattr(dp_accounting, "__version__", None) or _dist_version("dp-accounting"),
            "mpmath": mp.__version__, "numpy": numpy.__version__, "scipy": scipy.__version__,
        },
        "quadrature": {"dps": DPS, "check_dps": CHECK_DPS, "check_tol": CHECK_TOL,
                       "max_check_rel_diff": worst_check},
        "runtime_seconds": {"log_a": round(t_log_a), "epsilon": round(t_eps),
                            "total": round(t_log_a + time.time() - t_rest)},
        "pld": {"value_discretization_interval": PLD_INTERVAL,
                "fine_value_discretization_interval": PLD_FINE_INTERVAL,
                "fine_tried_up_to_rdp_epsilon": PLD_FINE_MAX_EPSILON,
                "memory_cap_gib": PLD_MEMORY_BYTES >> 30, "timeout_s": PLD_TIMEOUT_S},
        "orders": orders,
        "sigmas": SIGMAS, "qs": QS, "steps": STEPS, "deltas": DELTAS,
        "log_a": log_a_rows,
        "epsilon": eps_rows,
        "disagreements": singles["disagreements"],
        "spot_checks": singles["spot_checks"],
    }
    with open(OUT, "w") as f:
        json.dump(out, f, indent=1, allow_nan=False)
        f.write("\n")
    print(f"wrote {OUT} in {time.time() - t_start:.0f} s", flush=True)


def _dist_version(name):
    from importlib.metadata import version
    return version(name)


# Rows of the side-by-side table in docs/privacy.md: (sigma, q, steps), delta = 1e-5.
TABLE_ROWS = [
    (0.5, 1e-3, 10_000), (0.8, 0.01, 10_000), (1.0, 1e-3, 1_000_000), (1.0, 0.01, 100),
    (1.0, 0.01, 10_000), (1.0, 0.01, 1_000_000), (1.0, 0.1, 10_000), (2.0, 0.01, 1_000_000),
    (2.0, 0.1, 100), (5.0, 0.1, 10_000), (1.0, 1.0, 100), (0.5, 1e-4, 1_000_000),
    (2.0, 1e-4, 1_000_000), (0.3, 0.1, 1_000_000),
]


def summary(path=OUT):
    """Prints the agreement numbers and the table of docs/privacy.md from the JSON."""
    d = json.load(open(path))

    def worst(pairs):
        best = (0.0, None)
        for e, where in pairs:
            if e is not None and e > best[0]:
                best = (e, where)
        return best

    def rel(a, b):
        return abs(a - b) / abs(b)

    for lib in ("opacus", "dp_accounting"):
        e, where = worst((r[f"{lib}_max_rel_err"], (r["sigma"], r["q"], r[f"{lib}_max_rel_err_order"]))
                         for r in d["log_a"])
        bad = sum(len(r[f"{lib}_nonfinite_orders"]) for r in d["log_a"])
        print(f"log A, {lib} vs integral: worst rel {e:.2e} at (sigma, q, alpha) = {where}; "
              f"{bad} of {len(d['log_a']) * len(d['orders'])} values infinite")
    for name in ("disagreements", "spot_checks"):
        for lib in ("opacus", "dp_accounting"):
            e, where = worst((p[f"{lib}_rel_err"], (p["q"], p["sigma"], p["alpha"])) for p in d[name])
            print(f"log A, {lib} vs integral on the {len(d[name])} {name}: worst rel {e:.2e} at "
                  f"(q, sigma, alpha) = {where}")
    rows = d["epsilon"]
    def key(r):
        return (r["sigma"], r["q"], r["steps"], r["delta"])
    for name, get in (("opacus", lambda r: r["opacus"] and r["opacus"]["epsilon"]),
                      ("dp_accounting RDP", lambda r: r["dp_accounting_rdp"] and r["dp_accounting_rdp"]["epsilon"])):
        e, where = worst((rel(get(r), r["integral"]["epsilon"]) if get(r) is not None else None, key(r))
                         for r in rows)
        print(f"epsilon, {name} vs integral: worst rel {e:.2e} at (sigma, q, steps, delta) = {where}")
    e, where = worst((rel(r["dp_accounting_rdp"]["epsilon"], r["opacus"]["epsilon"])
                      if r["dp_accounting_rdp"] and r["opacus"] else None, key(r)) for r in rows)
    print(f"epsilon, dp_accounting RDP vs opacus: worst rel {e:.2e} at {where}")
    def best_pld(r):
        return r["pld_fine"] if r["pld_fine"] is not None else r["pld"]
    for name, get in (("PLD (1e-4)", lambda r: r["pld"]), ("finest PLD", best_pld)):
        ratios = [(get(r) / r["integral"]["epsilon"], key(r)) for r in rows
                  if get(r) is not None and get(r) > 0]
        print(f"{name} / RDP epsilon: {min(ratios)[0]:.3f} .. {max(ratios)[0]:.3f} over {len(ratios)} "
              f"points with PLD > 0 (min at {min(ratios)[1]}, max at {max(ratios)[1]})")
    print(f"{sum(r['pld'] is None for r in rows)} points without PLD, "
          f"{sum(r['pld_fine'] is not None for r in rows)} with the fine PLD; "
          f"PLD (1e-4) above RDP at {[key(r) for r in rows if r['pld'] and r['pld'] > r['integral']['epsilon']]}")
    print()
    print("| σ | q | steps | Rust ε = integral ε | order | Opacus ε | dp_accounting RDP ε | order "
          "| PLD ε (1e-4) | PLD ε (1e-5) | PLD / RDP |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    def fmt(v, f):
        return "n/a" if v is None else format(v, f)
    for s, q, n in TABLE_ROWS:
        r = next(r for r in rows if key(r) == (s, q, n, 1e-5))
        dr, b = r["dp_accounting_rdp"], best_pld(r)
        print(f"| {s:g} | {q:g} | {n:,} | {r['integral']['epsilon']:.6g} | {r['integral']['order']:g} | "
              f"{r['opacus']['epsilon']:.6g} | {dr['epsilon']:.6g} | {dr['order']:g} | "
              f"{fmt(r['pld'], '.5g')} | {fmt(r['pld_fine'], '.5g')} | "
              f"{fmt(None if b is None else b / r['integral']['epsilon'], '.3f')} |")


if __name__ == "__main__":
    if sys.argv[1:] == ["--summary"]:
        summary()
    elif sys.argv[1:] in ([], ["--reuse-log-a"]):
        main(reuse_log_a=bool(sys.argv[1:]))
        summary()
    else:
        sys.exit("usage: make_accounting.py [--summary | --reuse-log-a]")
