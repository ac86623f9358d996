"""The arguments both JAX routes (linen and program) check the same way: the batch axis, a
per-example array (claimed norms, coefficients) of B numbers, and the padding examples."""
from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np


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
