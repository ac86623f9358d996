"""The judging of one captured computation, with the package's public exporter and check only:
the trace is exported from the copied module, its inputs and the surrogate loss (the exporter
re-derives every per-example gradient itself, and refuses what it cannot model), the library's
claimed norms are written into it, and the f64 judge gives the verdict. Nothing here reads the
library's per-sample state."""
from __future__ import annotations

import math
import os
import re
import tempfile
from typing import Any

import numpy as np

from .computation import Computation, Outcome


def _max_rel_err(true: np.ndarray, claimed: np.ndarray) -> float:
    """max_i |claimed_i − true_i| / true_i; an example whose true norm is 0 counts by its absolute
    error (inf when the claim is not 0 either)."""
    worst = 0.0
    for t, c in zip(true.tolist(), claimed.tolist(), strict=True):
        if t > 0:
            worst = max(worst, abs(c - t) / t)
        elif c != 0:
            worst = math.inf
    return worst


def judge(c: Computation, outcome: Outcome, *, max_memory: int | str | None) -> Outcome:
    """Fills `outcome` (its `test` and `call` already set) for computation `c`."""
    import torch

    from .._api import check
    from ..export import TraceExportError, export_trace

    if c.skip_reason is not None:
        outcome.outcome, outcome.message = "skipped", c.skip_reason
        return outcome
    if c.refuse_reason is not None:
        outcome.outcome, outcome.message = "refused", c.refuse_reason
        return outcome
    if c.per_example_loss is None:
        raise ValueError("the computation was never completed by its backward pass")
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{c.library}-{c.mode}-{c.module}")
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        # the library's test may run in deterministic mode; the exporter's own scatter-adds on
        # CUDA have no deterministic kernel, and its arithmetic is f64 and checked against autograd
        if deterministic:
            torch.use_deterministic_algorithms(False)
        with tempfile.TemporaryDirectory(prefix="ghost-oracle-shadow-") as d, torch.enable_grad():
            path = os.path.join(d, f"{name}.safetensors")
            try:
                export_trace(c.model, c.per_example_loss, c.inputs, path, claimed_norms=c.claimed_norms,
                             max_grad_norm=c.max_grad_norm, clipper=f"{c.library}-{c.mode}",
                             batch_axis=c.batch_axis)
            except TraceExportError as e:
                outcome.outcome, outcome.message = "refused", str(e)
                return outcome
            except (ValueError, TypeError, RuntimeError, NotImplementedError) as e:
                outcome.outcome = "refused"
                outcome.message = f"the exporter could not trace it: {type(e).__name__}: {e}"
                return outcome
            try:
                report: Any = check(path, max_memory=max_memory)
            except ValueError as e:
                if "memory" in str(e).lower():
                    outcome.outcome, outcome.message = "skipped", f"over max_memory: {e}"
                else:  # a trace the check cannot read is never a pass
                    outcome.outcome, outcome.message = "refused", f"the check refused the trace: {e}"
                return outcome
    finally:
        if deterministic:
            torch.use_deterministic_algorithms(True, warn_only=warn_only)
    outcome.outcome = "judged"
    outcome.verdict = str(report.verdict)
    outcome.max_rel_err = _max_rel_err(np.asarray(report.true_norms, dtype=np.float64),
                                       np.asarray(report.claimed_norms, dtype=np.float64))
    if outcome.verdict != "pass":
        outcome.explanation = report.explain()
        outcome.message = outcome.explanation.splitlines()[0] if outcome.explanation else outcome.verdict
    outcome.report = report
    return outcome
