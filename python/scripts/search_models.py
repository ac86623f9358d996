"""The benchmark tier of the model search: N random small PyTorch models (and some Flax ones)
through the exporter and the judge, each held to the invariant of python/tests/model_search.py,
with a tally of what happened.

    python python/scripts/search_models.py                  # 10,000 torch models, seed 0
    python python/scripts/search_models.py -n 500 --seed 1 --flax 50
    python python/scripts/search_models.py -n 2000 --shrink "0.5% low"   # shrink one failure class

Prints progress, then the tally: judged, refused by reason, cannot-judge by reason, crashes,
wrong verdicts (and every other way the invariant failed), each failure class with its count
and its smallest model (a spec whose repr rebuilds it: `run_torch(<spec>)`). The summary is
written as JSON (`--json`), atomically (a temporary file renamed into place), after every
progress line and at the end, so an interrupted run leaves its tally so far and never half a
file.

`--shrink TEXT` instead runs hypothesis with shrinking on until it finds a model whose failure
class contains TEXT, and prints the shrunk model.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import model_search as ms  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402


class Tally:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.n = 0
        self.status: collections.Counter[str] = collections.Counter()
        self.refused: collections.Counter[str] = collections.Counter()
        self.refused_models: collections.Counter[str] = collections.Counter()  # mixing or not
        self.cannot_judge: collections.Counter[str] = collections.Counter()
        self.crashes: collections.Counter[str] = collections.Counter()
        self.failures: collections.Counter[str] = collections.Counter()
        self.examples: dict[str, dict[str, Any]] = {}  # failure class -> the smallest model showing it
        self.refusal_examples: dict[str, str] = {}
        self.verdicts: collections.Counter[str] = collections.Counter()
        # the exact claims' verdicts by the model's dtype: what the model's own rounding costs
        self.exact_by_dtype: collections.Counter[str] = collections.Counter()
        self.models_failing = 0
        self.failing: list[dict[str, Any]] = []  # every model failing the invariant, to classify
        self.truth_errors: list[float] = []
        self.seconds = 0.0
        self.slowest = (0.0, "")

    def add(self, spec: Any, out: ms.Outcome) -> None:
        self.n += 1
        self.seconds += out.seconds
        if out.seconds > self.slowest[0]:
            self.slowest = (out.seconds, repr(spec))
        self.status[out.status] += 1
        if out.status == "refused":
            self.refused[out.reason] += 1
            self.refused_models["built to mix examples" if spec.mixing else "not built to mix"] += 1
            r = repr(spec)
            if out.reason not in self.refusal_examples or len(r) < len(self.refusal_examples[out.reason]):
                self.refusal_examples[out.reason] = r
        if out.status == "crash":
            self.crashes[out.reason] += 1
        for reason in out.cannot_judge:
            self.cannot_judge[reason] += 1
        for what, verdict in out.verdicts.items():
            self.verdicts[f"{what}: {verdict}"] += 1
            if what.startswith("exact"):
                self.exact_by_dtype[f"{spec.dtype} {what}: {verdict}"] += 1
        if out.truth_rel_err == out.truth_rel_err:  # not NaN
            self.truth_errors.append(out.truth_rel_err)
        if out.failures:
            self.models_failing += 1
            self.failing.append({"spec": repr(spec), "classes": sorted({c for c, _ in out.failures}),
                                 "detail": out.failures[0][1][:300]})
        seen = set()
        for cls, detail in out.failures:
            if cls in seen:
                continue
            seen.add(cls)
            self.failures[cls] += 1
            r = repr(spec)
            if cls not in self.examples or len(r) < len(self.examples[cls]["spec"]):
                self.examples[cls] = {"spec": r, "detail": detail,
                                      "message": out.message[-2000:] if out.status == "crash" else ""}

    def wrong_verdicts(self) -> int:
        return sum(n for cls, n in self.failures.items() if cls.startswith("wrong verdict"))

    def summary(self) -> dict[str, Any]:
        errs = sorted(self.truth_errors)
        return {
            "kind": self.kind, "models": self.n, "seconds": round(self.seconds, 1),
            "judged": self.status["judged"], "refused": self.status["refused"], "crashes": self.status["crash"],
            "generator_errors": self.status["generator"], "models_failing_the_invariant": self.models_failing,
            "wrong_verdicts": self.wrong_verdicts(),
            "refused_models": dict(self.refused_models.most_common()),
            "refused_by_reason": dict(self.refused.most_common()),
            "cannot_judge_by_reason": dict(self.cannot_judge.most_common()),
            "crashes_by_reason": dict(self.crashes.most_common()),
            "failures_by_class": dict(self.failures.most_common()),
            "failure_examples": self.examples,
            "failing_models": self.failing,
            "refusal_examples": self.refusal_examples,
            "verdicts": dict(sorted(self.verdicts.items())),
            "exact_verdicts_by_dtype": dict(sorted(self.exact_by_dtype.items())),
            "truth_rel_err_median": errs[len(errs) // 2] if errs else None,
            "slowest_model": {"seconds": round(self.slowest[0], 2), "spec": self.slowest[1]},
        }

    def line(self) -> str:
        return (f"{self.kind}: {self.n} models, {self.status['judged']} judged, {self.status['refused']} refused, "
                f"{self.status['crash']} crashes, {self.wrong_verdicts()} wrong verdicts, "
                f"{self.models_failing} failing the invariant, {self.status['generator']} generator errors")

    def report(self) -> str:
        out = [self.line()]

        def block(title: str, counter: collections.Counter[str]) -> None:
            if counter:
                out.append(f"  {title}:")
                out.extend(f"    {n:6d}  {k}" for k, n in counter.most_common())

        block("refused models", self.refused_models)
        block("refused, by reason", self.refused)
        block("cannot-judge (exact claims), by reason", self.cannot_judge)
        block("crashes, by reason", self.crashes)
        block("failures of the invariant, by class", self.failures)
        block("verdicts", collections.Counter(dict(self.verdicts)))
        block("exact claims' verdicts by dtype", collections.Counter(dict(self.exact_by_dtype)))
        if self.examples:
            out.append("  smallest model of each failure class:")
            for cls, ex in sorted(self.examples.items()):
                out.append(f"    {cls}\n      {ex['spec']}\n      -> {ex['detail'][:300]}")
        return "\n".join(out)


def write_json(path: str, doc: dict[str, Any]) -> None:
    """`doc` at `path`, written to a temporary file beside it and renamed into place."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".search-", suffix=".json", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _settings(n: int, shrink: bool) -> settings:
    phases = [Phase.generate, Phase.shrink] if shrink else [Phase.generate]
    return settings(max_examples=n, deadline=None, database=None, phases=phases,
                    suppress_health_check=list(HealthCheck), derandomize=False)


def run(tally: Tally, n: int, seed_: int, progress: int, on_progress: Any) -> None:
    kind = tally.kind
    strategy = ms.torch_specs() if kind == "torch" else ms.flax_specs()
    runner = ms.run_torch if kind == "torch" else ms.run_flax
    start = time.perf_counter()

    @_settings(n, shrink=False)
    @seed(seed_)
    @given(strategy)
    def one(spec: Any) -> None:
        out = runner(spec)
        tally.add(spec, out)
        if tally.n % progress == 0 or tally.n == n:
            print(f"[{time.perf_counter() - start:7.0f} s] {tally.line()}", flush=True)
            on_progress()

    one()


def shrink(kind: str, n: int, seed_: int, text: str) -> None:
    strategy = ms.torch_specs() if kind == "torch" else ms.flax_specs()
    runner = ms.run_torch if kind == "torch" else ms.run_flax
    last: list[Any] = []

    @_settings(n, shrink=True)
    @seed(seed_)
    @given(strategy)
    def one(spec: Any) -> None:
        out = runner(spec)
        hits = [(c, d) for c, d in out.failures if text in c]
        if hits:
            last[:] = [spec, hits]
            raise AssertionError(hits[0][0])

    try:
        one()
    except AssertionError:
        spec, hits = last
        print(f"shrunk model:\n{spec!r}\n")
        for c, d in hits:
            print(f"  {c}\n    {d}")
        return
    print(f"no model of {n} shows a failure class containing {text!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=10_000, help="torch models (default 10000)")
    ap.add_argument("--flax", type=int, default=None, help="Flax models (default n/20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--progress", type=int, default=100, help="print a progress line every this many models")
    ap.add_argument("--json", default="model-search.json", help="where the summary goes (written atomically)")
    ap.add_argument("--shrink", metavar="TEXT", help="shrink the first model whose failure class contains TEXT")
    ap.add_argument("--kind", choices=["torch", "flax"], default="torch", help="with --shrink: which models")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    if args.shrink:
        shrink(args.kind, args.n, args.seed, args.shrink)
        return 0
    n_flax = args.n // 20 if args.flax is None else args.flax
    start = time.perf_counter()
    tallies: list[Tally] = []

    def save() -> None:
        write_json(args.json, {"command": " ".join(sys.argv), "seed": args.seed,
                               "wall_seconds": round(time.perf_counter() - start, 1),
                               "tallies": [t.summary() for t in tallies]})

    for kind, n in (("torch", args.n), ("flax", n_flax)):
        if n:
            tallies.append(Tally(kind))
            run(tallies[-1], n, args.seed, args.progress, save)
    save()
    wall = time.perf_counter() - start
    print()
    for t in tallies:
        print(t.report())
        print()
    print(f"{' + '.join(f'{t.n} {t.kind}' for t in tallies)} models in {wall:.0f} s; summary in {args.json}")
    bad = sum(t.models_failing for t in tallies)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
