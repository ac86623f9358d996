"""check, audit and mutants: thin wrappers over the compiled `ghost_oracle._native`."""
from __future__ import annotations

import numbers
import os
import warnings
from collections.abc import Sequence
from typing import Any

from . import _native
from ._deprecated import renamed_keywords
from ._report import Report
from ._types import Precision, Reduction

#: The built-in clippers `audit` runs by default.
BUILTIN_CLIPPERS: tuple[str, ...] = tuple(_native.BUILTIN_CLIPPERS)
#: The seeded bugs (clipper names for `audit(clippers=...)`) and the library behaviour each
#: reproduces.
MUTANTS: dict[str, str] = dict(_native.mutant_list())


def _number(name: str, x: object) -> float | None:
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, numbers.Real) and not hasattr(x, "__float__"):
        raise TypeError(f"{name} must be a number, got {x!r}")
    return float(x)


def _count(name: str, x: object) -> int | None:
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        if isinstance(x, numbers.Real) and float(x).is_integer():
            return int(float(x))
        raise TypeError(f"{name} must be an integer, got {x!r}")
    return int(x)


def _warn_no_noise(sigma: float | None) -> None:
    if sigma == 0:
        warnings.warn("noise_multiplier 0: without noise DP-SGD gives no privacy (ε = ∞)", stacklevel=3)


def _accounting(sampling_rate: object, steps: object, epochs: object, dataset_size: object,
                delta: object) -> dict[str, Any]:
    return {
        "sampling_rate": _number("sampling_rate", sampling_rate),
        "steps": _count("steps", steps),
        "epochs": _number("epochs", epochs),
        "dataset_size": _count("dataset_size", dataset_size),
        "delta": _number("delta", delta),
    }


def _max_memory(value: object) -> str | None:
    """`max_memory=` as the size string the native reader parses (bytes, or "8G")."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"max_memory must be a number of bytes or a size such as '8G', got {value!r}")
    if isinstance(value, int) and value <= 0:
        raise ValueError(f"max_memory: expected a positive size such as 8G, 512M or 1073741824 (bytes), found {value}")
    return str(value)


def check(
    trace: str | os.PathLike[str],
    *,
    noise_multiplier: float | None = None,
    precision: Precision | None = None,
    sampling_rate: float | None = None,
    steps: int | None = None,
    epochs: float | None = None,
    dataset_size: int | None = None,
    delta: float | None = None,
    max_memory: int | str | None = None,
) -> Report:
    """Judges the per-example norms a clipper claimed in a trace file (`ghost-oracle check`).

    Args:
        trace: a trace file (safetensors, format `ghost-oracle-trace/1`, `/2` or `/3`,
            docs/trace-format.md), as written by `ghost_oracle.torch.export_trace`.
        noise_multiplier: σ of the DP-SGD run (default: the trace's, else 1).
        precision: the precision the tolerance assumes: "f64", "f32", "f16" or "bf16"
            (default: the coarser of the stored factors' dtype and the trace's compute dtype).
        sampling_rate, steps, delta: the run the ε speaks of (Poisson sampling rate q, number of
            steps, δ); default: a typical fine-tuning run, q = 0.01, 1000 steps, δ = 1e-5.
        epochs, dataset_size: the steps as epochs over a training set of N examples instead of
            `steps` (give both, and not `steps`): steps = ⌈epochs × ⌈N / round(q·N)⌉⌉.
        max_memory: the most memory reading and judging the trace may take (`--max-memory`): a
            number of bytes, or a size such as "8G" or "512M" (binary units). A trace that would
            need more is refused before it is read. Default: the machine's available memory.

    Returns:
        a `Report` with one clipper and one case.

    Raises:
        FileNotFoundError: the trace does not exist.
        ValueError: the trace is malformed, or an argument is out of range (the message is the
            one `ghost-oracle check` prints).
    """
    sigma = _number("noise_multiplier", noise_multiplier)
    if precision is not None and not isinstance(precision, str):
        raise TypeError(f"precision must be one of 'f64', 'f32', 'f16', 'bf16', got {precision!r}")
    _warn_no_noise(sigma)
    native = _native.check(os.fspath(trace), noise_multiplier=sigma, precision=precision,
                           max_memory=_max_memory(max_memory),
                           **_accounting(sampling_rate, steps, epochs, dataset_size, delta))
    return Report(native)


@renamed_keywords(dtype="precision")
def audit(
    model: str | os.PathLike[str] | None = None,
    batch: str | os.PathLike[str] | None = None,
    *,
    clippers: str | Sequence[str] | None = None,
    max_grad_norm: float | None = None,
    noise_multiplier: float = 1.0,
    precision: Precision = "f32",
    reduction: Reduction = "mean",
    sampling_rate: float | None = None,
    steps: int | None = None,
    epochs: float | None = None,
    dataset_size: int | None = None,
    delta: float | None = None,
) -> Report:
    """Audits clippers against the f64 reference (`ghost-oracle audit`): on the built-in suite
    (seeded tied and untied GPT-2s, no files), or on a checkpoint and a batch.

    Args:
        model: a checkpoint directory (config.json + model.safetensors); needs `batch`.
        batch: a batch file (safetensors with `input_ids`, i64 B×T, optional `labels`).
        clippers: clipper names: "materialize", "ghost", "ghost-tied", or "mutant:NAME" for a
            seeded bug (see `MUTANTS`). Default: the three built-in clippers.
        max_grad_norm: C. Default: each case's median true norm (the built-in suite also tries
            0.5× and 2× that).
        noise_multiplier: σ of the DP-SGD run.
        precision: the precision the clippers compute in: "f64", "f32", "f16" or "bf16" (the
            reference is f64; in f16 and bf16 the clippers accumulate in f32).
        reduction: how each example's loss is reduced over its tokens, "mean" or "sum".
        sampling_rate, steps, epochs, dataset_size, delta: the run the ε speaks of (see `check`).

    Raises:
        FileNotFoundError: the checkpoint or the batch does not exist.
        ValueError: bad input or an argument out of range (the CLI's message).
    """
    if isinstance(clippers, str):
        clippers = [clippers]
    names = None if clippers is None else [str(c) for c in clippers]
    sigma = _number("noise_multiplier", noise_multiplier)
    _warn_no_noise(sigma)
    native = _native.audit(
        model=None if model is None else os.fspath(model),
        batch=None if batch is None else os.fspath(batch),
        clippers=names,
        max_grad_norm=_number("max_grad_norm", max_grad_norm),
        noise_multiplier=1.0 if sigma is None else sigma,
        precision=str(precision),
        reduction=str(reduction),
        **_accounting(sampling_rate, steps, epochs, dataset_size, delta),
    )
    return Report(native)


@renamed_keywords(dtype="precision")
def mutants(
    *,
    precision: Precision = "f32",
    sampling_rate: float | None = None,
    steps: int | None = None,
    epochs: float | None = None,
    dataset_size: int | None = None,
    delta: float | None = None,
) -> Report:
    """The kill matrix (`ghost-oracle mutants`): every seeded bug of a real DP library, and the
    correct clippers, audited on the built-in suite. The report has one entry per clipper of the
    matrix (its `mutant`, `reproduces`, `cells` and `problems` say how the matrix judged it);
    `passed` is true when every mutant is caught with the verdict it must get and no correct
    clipper is flagged. `to_json()` and `repr()` are the CLI's `--json` document and table.

    `precision` is the precision the clippers compute in ("f64", "f32", "f16" or "bf16"); the
    accounting arguments are `check`'s.
    """
    native = _native.mutants(precision=str(precision), **_accounting(sampling_rate, steps, epochs, dataset_size, delta))
    return Report(native)


__all__ = ["BUILTIN_CLIPPERS", "MUTANTS", "audit", "check", "mutants"]
