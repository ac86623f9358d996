"""`assert_norms` and `assert_update`: export to a temporary file (or `trace_path`), check with
the f64 reference, raise `ClippingCheckFailed` unless the verdict is pass."""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import flax.linen as nn

from .. import _gate
from .._report import Report
from .._types import Precision
from .capture import PerExampleLoss
from .trace import UNCLAIMED, export_trace


def export_check_assert(model: nn.Module, params: Any, per_example_loss: PerExampleLoss, inputs: Any, *,
                        claimed_norms: Any, clipper: str, precision: Precision | None, sampling_rate: float | None,
                        steps: int | None, delta: float | None, trace_path: str | os.PathLike[str] | None,
                        export: dict[str, Any]) -> Report:
    """`ghost_oracle._gate.export_check_assert` with the Flax exporter. `claimed_norms` None:
    the exact norms, so that only the step is judged."""
    __tracebackhide__ = True

    def write(path: str, norms: Any) -> object:
        return export_trace(model, params, per_example_loss, inputs, path, claimed_norms=norms, clipper=clipper,
                            **export)

    return _gate.export_check_assert(write, unclaimed=UNCLAIMED, claimed_norms=claimed_norms, clipper=clipper,
                                     precision=precision,
                                     accounting=dict(sampling_rate=sampling_rate, steps=steps, delta=delta),
                                     trace_path=trace_path)



def assert_norms(model: nn.Module, params: Any, per_example_loss: PerExampleLoss, inputs: Any,
                 claimed_norms: Any | Callable[[Any, Any], Any], *, max_grad_norm: float,
                 noise_multiplier: float = 1.0, clipper: str = "claimed", claimed_coefficients: Any = None,
                 dtype: str | None = None, precision: Precision | None = None, sampling_rate: float | None = None,
                 steps: int | None = None, delta: float | None = None,
                 trace_path: str | os.PathLike[str] | None = None, is_padding_example: Any = None) -> Report:
    """Asserts that `claimed_norms` are the true per-example gradient norms of the Flax `model`
    with `params` on `inputs` (the JAX twin of `ghost_oracle.torch.assert_norms`).

    `per_example_loss(apply, inputs)` returns the B losses, `apply(*args, **kwargs)` running
    `model.apply({"params": params}, ...)` under the capture. `precision` is the precision the
    judgement assumes (default: the trace's). Returns the `Report` on pass; raises
    `ClippingCheckFailed` (an AssertionError, `.report` the whole report) otherwise,
    `TraceExportError` where the model cannot be traced faithfully."""
    __tracebackhide__ = True
    return export_check_assert(
        model, params, per_example_loss, inputs, claimed_norms=claimed_norms, clipper=clipper, precision=precision,
        sampling_rate=sampling_rate, steps=steps, delta=delta, trace_path=trace_path,
        export={"max_grad_norm": max_grad_norm, "claimed_coefficients": claimed_coefficients,
                "noise_multiplier": noise_multiplier, "dtype": dtype, "is_padding_example": is_padding_example})


def assert_update(model: nn.Module, params: Any, per_example_loss: PerExampleLoss, inputs: Any, update: Any, *,
                  max_grad_norm: float, noise_multiplier: float, batch_divisor: float, clipped_sum: Any = None,
                  clip_stabilizer: float = 0.0, clipping: str = "flat", claimed_norms: Any = None,
                  claimed_coefficients: Any = None, clipper: str = "claimed", dtype: str | None = None,
                  precision: Precision | None = None, sampling_rate: float | None = None, steps: int | None = None,
                  delta: float | None = None, trace_path: str | os.PathLike[str] | None = None,
                  is_padding_example: Any = None) -> Report:
    """Asserts that `update` (a dict keyed by Flax parameter path, or the params pytree) is the
    DP-SGD update (Σ_i c*_i g*_i + σ C ξ) / D of `model` on `inputs` (the JAX twin of
    `ghost_oracle.torch.assert_update`); `clipped_sum`, when given, is judged exactly and makes
    the noise testable per tensor. `claimed_norms` default: the exact norms, so only the step is
    judged."""
    __tracebackhide__ = True
    if update is None:
        raise ValueError("update is required: the {name: array} the optimizer steps with")
    return export_check_assert(
        model, params, per_example_loss, inputs, claimed_norms=claimed_norms, clipper=clipper, precision=precision,
        sampling_rate=sampling_rate, steps=steps, delta=delta, trace_path=trace_path,
        export={"max_grad_norm": max_grad_norm, "claimed_coefficients": claimed_coefficients,
                "noise_multiplier": noise_multiplier, "dtype": dtype, "update": update, "clipped_sum": clipped_sum,
                "batch_divisor": batch_divisor, "clip_stabilizer": clip_stabilizer, "clipping": clipping,
                "is_padding_example": is_padding_example})
