"""The arguments both JAX routes (linen and program) check the same way: the batch axis, the
header's numbers before the model runs, a per-example array (claimed norms, coefficients) of B
numbers, and the padding examples."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from .._atomic import check_target
from .._trace.format import PRECISION_NAMES, UNCLAIMED, number, step_rule
from .._trace.site import Precision


def check_batch_axis(batch_axis: object) -> None:
    """`batch_axis` 0, or a ValueError naming it. The PyTorch exporter also takes 1 (seq-first
    data), finding each module's own batch axis by its probes; the Flax capture reads B from
    axis 0 and its probes and sites hold every module's examples on axis 0, so a model whose
    arrays are T×B inside could only be refused later, or worse: it is refused here."""
    if type(batch_axis) is not int or batch_axis not in (0, 1):
        raise ValueError(f"batch_axis must be 0 (batch × sequence, the default), got {batch_axis!r}")
    if batch_axis == 1:
        raise ValueError("batch_axis=1 (sequence × batch): the JAX exporter follows the examples along axis 0 only, "
                         "of the inputs and of every modelled module's input and output; give the model its batch "
                         "first (batch_axis=0)")


def per_example(values: Any, b: int, what: str) -> np.ndarray:
    try:
        raw = np.asarray(values)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be an array or list of {b} numbers, got {type(values).__name__}") from e
    if np.iscomplexobj(raw):  # a cast to float64 would drop the imaginary part with only a warning
        raise TypeError(f"{what} is complex ({raw.dtype}): norms and coefficients are real numbers")
    if raw.dtype.kind not in "fiu" and raw.dtype != ml_dtypes.bfloat16:
        raise TypeError(f"{what} must be an array or list of {b} numbers, got {type(values).__name__} of "
                        f"{raw.dtype}")
    arr = raw.astype(np.float64).reshape(-1)
    if arr.shape != (b,):
        raise ValueError(f"{what} has {arr.size} entries; the batch has {b} examples")
    return arr


def kept_examples(is_padding_example: Any, b: int) -> np.ndarray:
    """The examples the trace keeps (a bool array of B): all but those `is_padding_example` marks
    (jax_privacy leaves padding examples out of its sum, so the trace leaves them out too)."""
    if is_padding_example is None:
        return np.ones(b, dtype=bool)
    pad = np.asarray(is_padding_example)
    if pad.shape != (b,) or pad.dtype != np.bool_:
        raise ValueError(f"is_padding_example must be a bool array of shape ({b},), got {pad.dtype} "
                         f"{list(pad.shape)}")
    keep = ~pad
    if not keep.any():
        raise ValueError("is_padding_example marks every example as padding: nothing to trace")
    return keep


@dataclass(frozen=True)
class HeaderArguments:
    """An export's header numbers, checked before the model runs (a path that cannot be written
    fails fast): the path as a str, C, the storage precision asked for (or None), and the step's
    D (or None) and γ."""

    path: str
    max_grad_norm: float
    dtype: Precision | None
    batch_divisor: float | None
    clip_stabilizer: float


def header_arguments(path: Any, *, batch_axis: object, max_grad_norm: Any, noise_multiplier: Any, dtype: Any,
                     batch_divisor: Any, clip_stabilizer: Any, clipping: str, has_update: bool) -> HeaderArguments:
    """Both JAX exporters' argument checks before anything runs, each error naming its argument."""
    check_batch_axis(batch_axis)
    target = check_target(path, "path")
    c = number(max_grad_norm, "max_grad_norm", positive=True)
    if noise_multiplier is not None:
        number(noise_multiplier, "noise_multiplier", positive=False)
    if dtype is not None and dtype not in PRECISION_NAMES:
        raise ValueError(f"dtype must be one of {list(PRECISION_NAMES)}, got {dtype!r}")
    divisor, stabilizer = step_rule(
        batch_divisor=batch_divisor, clip_stabilizer=clip_stabilizer, clipping=clipping, has_update=has_update,
        divisor_is="jax_privacy: normalize_by, times C with rescale_to_unit_norm")
    return HeaderArguments(target, c, dtype, divisor, stabilizer)


def kept_claims(claimed_norms: Any, claimed_coefficients: Any, b: int, keep: np.ndarray,
                call: Callable[[Any], Any]) -> tuple[np.ndarray, np.ndarray | None]:
    """The claimed norms (ones where UNCLAIMED; `call(claimed_norms)` where they are a function
    of the model's arguments) and coefficients (or None) of the kept examples."""
    if claimed_norms is UNCLAIMED:
        norms = np.ones(int(keep.sum()))
    else:
        if callable(claimed_norms):
            claimed_norms = call(claimed_norms)
        norms = per_example(claimed_norms, b, "claimed_norms")[keep]
    coefficients = None if claimed_coefficients is None else \
        per_example(claimed_coefficients, b, "claimed_coefficients")[keep]
    return norms, coefficients
