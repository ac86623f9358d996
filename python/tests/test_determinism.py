"""Determinism: the same model, batch and seed give byte-identical traces and JSON reports, run
after run in one process and in a fresh process on one thread (torch's intra-op threads and the
native judge's RAYON_NUM_THREADS) against this one on two.

The report holds no timing or other run-dependent figure by design (docs/python.md, "Things to
know"); the trace's header is written with its keys in sorted order, where safetensors alone
writes them in a HashMap's per-call order. Models: the tiny tied GPT-2 (probes, a tied head,
LayerNorm, 1×T positions) at B = 4, and an MLP at B = 12, past the batch size up to which every
example is probed, so that the seeded choice of probed examples is exercised."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ghost_oracle
from ghost_oracle.torch import export_trace

HERE = Path(__file__).resolve().parent


def _mlp_case():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.GELU(), torch.nn.LayerNorm(5),
                                torch.nn.Linear(5, 3)).float()
    x = torch.randn(12, 6, generator=torch.Generator().manual_seed(4))

    def loss(m, xx):
        return torch.nn.functional.cross_entropy(m(xx), torch.arange(xx.shape[0]) % 3, reduction="none")

    return model, loss, x


def _gpt2_case():
    from ghost_oracle.testing import gpt2, gpt2_ids, gpt2_loss
    return gpt2(), gpt2_loss, gpt2_ids()


CASES = {"gpt2": _gpt2_case, "mlp": _mlp_case}


def export_and_check(case: str, out_dir: str) -> None:
    """Exports `case` with claims 1 % low on the first example (so that the report has a failing
    case to explain) and writes the trace and the JSON report of its check to `out_dir`."""
    model, loss, x = CASES[case]()
    trace = os.path.join(out_dir, "trace.safetensors")
    export_trace(model, loss, x, trace, claimed_norms=ghost_oracle.torch.UNCLAIMED, max_grad_norm=1.0)
    truth = ghost_oracle.check(trace).true_norms
    claims = [n * (0.99 if i == 0 else 1.0) for i, n in enumerate(truth)]
    export_trace(model, loss, x, trace, claimed_norms=claims, max_grad_norm=float(sorted(truth)[len(truth) // 2]))
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        f.write(ghost_oracle.check(trace).to_json())


def _in_subprocess(case: str, out_dir: Path, threads: int) -> None:
    code = (f"import sys, torch; torch.set_num_threads({threads}); sys.path.insert(0, {str(HERE)!r}); "
            f"import test_determinism as t; t.export_and_check({case!r}, {str(out_dir)!r})")
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]


def _files(d: Path) -> dict[str, bytes]:
    return {name: (d / name).read_bytes() for name in ("trace.safetensors", "report.json")}


@pytest.mark.parametrize("case", list(CASES))
def test_byte_identical_traces_and_reports_across_runs_and_threads(tmp_path, case):
    threads = torch.get_num_threads()
    runs = {}
    try:
        torch.set_num_threads(2)
        for k in range(2):
            d = tmp_path / f"in-process-{k}"
            d.mkdir()
            export_and_check(case, str(d))
            runs[f"in process, 2 threads, run {k}"] = _files(d)
    finally:
        torch.set_num_threads(threads)
    for n in (1, 2):
        d = tmp_path / f"subprocess-{n}"
        d.mkdir()
        _in_subprocess(case, d, n)
        runs[f"a fresh process on {n} thread(s)"] = _files(d)
    (first, reference), *others = runs.items()
    report = json.loads(reference["report.json"])
    # a report with something to say: the first example's claim, 1 % low, fails
    assert not report["passed"], report["verdicts"]
    for what, files in others:
        for name in reference:
            assert files[name] == reference[name], f"{name} of {what} differs from {first}'s"


def test_a_report_holds_no_timing():
    """The JSON report's keys, searched for anything that measures time."""
    report = ghost_oracle.check(Path(__file__).resolve().parents[2] / "oracles" / "golden" / "traces" /
                                "opacus_per_sample.safetensors")
    doc = json.loads(report.to_json())
    keys: set[str] = set()

    def walk(v):
        if isinstance(v, dict):
            keys.update(v)
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    walk(doc)
    timed = sorted(k for k in keys if any(w in k.lower() for w in ("time", "second", "elapsed", "duration", "date")))
    assert timed == [], timed
