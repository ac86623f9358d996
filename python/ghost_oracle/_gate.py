"""The one-call gate both exporters' `assert_*` share: export a trace, check it, raise
`ClippingCheckFailed` unless it passes. Framework-neutral: the exporter is handed in, and the
trace's claimed norms are rewritten in its bytes (no framework reads it: NumPy has no bfloat16,
the dtype of a bf16 trace's factors)."""
from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from typing import Any, TypedDict

import numpy as np

from ._api import check
from ._atomic import check_target, write_atomically
from ._failure import ClippingCheckFailed
from ._report import Report
from ._types import Precision

#: `export(path, claimed_norms)`: writes the trace of the batch with these claimed norms (or the
#: exporter's placeholder for "unclaimed", `unclaimed`).
Export = Callable[[str, Any], object]


class GateRun(TypedDict, total=False):
    """The keyword arguments of the check every gate runs, the same for both frameworks'
    `assert_norms` and `assert_update` (one list, so that the twins cannot take different ones):
    the precision the judgement assumes, the run the ε speaks of (as for `ghost_oracle.check`),
    where to keep the trace, and the most memory the check may take."""

    precision: Precision | None
    sampling_rate: float | None
    steps: int | None
    epochs: float | None
    dataset_size: int | None
    delta: float | None
    trace_path: str | os.PathLike[str] | None
    max_memory: int | str | None


_ACCOUNTING = ("sampling_rate", "steps", "epochs", "dataset_size", "delta")


def gate(export: Export, *, unclaimed: Any, claimed_norms: Any, clipper: str, run: Mapping[str, Any],
         function: str) -> Report:
    """`export_check_assert` with a gate's `GateRun` keyword arguments as given (`run`); a key
    that is none of them is refused as Python refuses an unknown keyword of `function`."""
    __tracebackhide__ = True
    for key in run:
        if key not in GateRun.__annotations__:
            raise TypeError(f"{function}() got an unexpected keyword argument {key!r}")
    return export_check_assert(export, unclaimed=unclaimed, claimed_norms=claimed_norms, clipper=clipper,
                               precision=run.get("precision"), accounting={k: run.get(k) for k in _ACCOUNTING},
                               trace_path=run.get("trace_path"), max_memory=run.get("max_memory"))


def export_check_assert(export: Export, *, unclaimed: Any, claimed_norms: Any, clipper: str,
                        precision: Precision | None, accounting: Mapping[str, Any],
                        trace_path: str | os.PathLike[str] | None, max_memory: int | str | None = None) -> Report:
    """Exports (to `trace_path`, or a temporary file), checks, and raises `ClippingCheckFailed`
    unless the verdict is pass. `claimed_norms` None: the exact norms, which the check computes
    from the trace's factors; the trace is exported once with placeholders, its `claimed.norms`
    replaced by the check's true norms and checked again, so that only the step is judged."""
    __tracebackhide__ = True

    def run(path: str) -> Report:
        export(path, unclaimed if claimed_norms is None else claimed_norms)
        report = check(path, precision=precision, max_memory=max_memory, **accounting)
        if claimed_norms is None:
            _replace_claimed_norms(path, report.true_norms)
            report = check(path, precision=precision, max_memory=max_memory, **accounting)
        return report

    if trace_path is not None:
        report = run(check_target(trace_path, "trace_path"))
    else:
        with tempfile.TemporaryDirectory(prefix="ghost-oracle-") as d:
            # the file's name is the case's name in the report's table
            name = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(clipper)).strip("._") or "trace"
            report = run(os.path.join(d, f"{name}.safetensors"))
    if not report.passed:
        raise ClippingCheckFailed(report)
    return report


def _replace_claimed_norms(path: str, norms: Any) -> None:
    """Rewrites the trace at `path` with `claimed.norms` = `norms` (float64), nothing else
    changed. The exporters write `claimed.norms` as float64 [B], so the new values take the old
    ones' bytes; the header and every other tensor are copied as they are, whatever their dtype
    (a bf16 trace's factors included)."""
    values = np.asarray([float(n) for n in norms], dtype="<f8")
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    entry = json.loads(data[8:8 + n]).get(_CLAIMED_NORMS)
    if (not isinstance(entry, dict) or entry.get("dtype") != "F64"
            or entry.get("shape") != [values.size]):
        raise ValueError(f"trace_path {path}: `{_CLAIMED_NORMS}` is not a float64 tensor of {values.size} norms "
                         f"(it is {entry!r}): not a trace this package's exporters wrote")
    start, end = (8 + n + int(o) for o in entry["data_offsets"])
    rewritten = data[:start] + values.tobytes() + data[end:]

    def save(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(rewritten)

    write_atomically(path, "trace_path", save)


_CLAIMED_NORMS = "claimed.norms"
