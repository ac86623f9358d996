"""The one-call gate both exporters' `assert_*` share: export a trace, check it, raise
`ClippingCheckFailed` unless it passes. Framework-neutral: the exporter is handed in, and the
trace is rewritten with NumPy."""
from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ._api import check
from ._atomic import check_target, sort_safetensors_metadata, write_atomically
from ._failure import ClippingCheckFailed
from ._report import Report
from ._types import Precision

#: `export(path, claimed_norms)`: writes the trace of the batch with these claimed norms (or the
#: exporter's placeholder for "unclaimed", `unclaimed`).
Export = Callable[[str, Any], object]


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
    changed."""
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    with safe_open(path, framework="np") as f:
        meta = f.metadata()
    tensors = load_file(path)
    tensors["claimed.norms"] = np.asarray([float(n) for n in norms], dtype=np.float64)

    def save(tmp: str) -> None:
        save_file(tensors, tmp, metadata=meta)
        sort_safetensors_metadata(tmp)

    write_atomically(path, "trace_path", save)
