"""`assert_norms` and `assert_update`: export to a temporary file (or `trace_path`), check with
the f64 reference, raise `ClippingCheckFailed` unless the verdict is pass. The keyword arguments
of the check are `ghost_oracle._gate.GateRun`'s, the same as the PyTorch twins'."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import flax.linen as nn

from .. import _gate
from .._report import Report
from .capture import PerExampleLoss
from .trace import UNCLAIMED, export_trace

if TYPE_CHECKING:
    from typing_extensions import Unpack


def _judge(function: str, model: nn.Module, params: Any, per_example_loss: PerExampleLoss, inputs: Any, *,
           claimed_norms: Any, clipper: str, run: _gate.GateRun, export: dict[str, Any]) -> Report:
    """`ghost_oracle._gate.gate` with the Flax exporter. `claimed_norms` None: the exact norms,
    so that only the step is judged."""
    __tracebackhide__ = True

    def write(path: str, norms: Any) -> object:
        return export_trace(model, params, per_example_loss, inputs, path, claimed_norms=norms, clipper=clipper,
                            **export)

    return _gate.gate(write, unclaimed=UNCLAIMED, claimed_norms=claimed_norms, clipper=clipper, run=run,
                      function=function)


def assert_norms(model: nn.Module, params: Any, per_example_loss: PerExampleLoss, inputs: Any,
                 claimed_norms: Any | Callable[[Any, Any], Any], *, max_grad_norm: float,
                 noise_multiplier: float = 1.0, clipper: str = "claimed", claimed_coefficients: Any = None,
                 dtype: str | None = None, batch_axis: int = 0, is_padding_example: Any = None,
                 **run: Unpack[_gate.GateRun]) -> Report:
    """Asserts that `claimed_norms` are the true per-example gradient norms of the Flax `model`
    with `params` on `inputs` (the JAX twin of `ghost_oracle.torch.assert_norms`, with the same
    keyword arguments: `precision`, `sampling_rate`, `steps`, `epochs`, `dataset_size`, `delta`,
    `trace_path`, `max_memory`, `batch_axis`, as documented there).

    `per_example_loss(apply, inputs)` returns the B losses, `apply(*args, **kwargs)` running
    `model.apply({"params": params}, ...)` under the capture. `precision` is the precision the
    judgement assumes (default: the trace's). `batch_axis`: 0, the only axis the Flax exporter
    follows the examples along (`export_trace`). Returns the `Report` on pass; raises
    `ClippingCheckFailed` (an AssertionError, `.report` the whole report) otherwise,
    `TraceExportError` where the model cannot be traced faithfully."""
    __tracebackhide__ = True
    return _judge("assert_norms", model, params, per_example_loss, inputs, claimed_norms=claimed_norms,
                  clipper=clipper, run=run,
                  export={"max_grad_norm": max_grad_norm, "claimed_coefficients": claimed_coefficients,
                          "noise_multiplier": noise_multiplier, "dtype": dtype, "batch_axis": batch_axis,
                          "is_padding_example": is_padding_example})


def assert_update(model: nn.Module, params: Any, per_example_loss: PerExampleLoss, inputs: Any, update: Any, *,
                  max_grad_norm: float, noise_multiplier: float, batch_divisor: float, clipped_sum: Any = None,
                  clip_stabilizer: float = 0.0, clipping: str = "flat", claimed_norms: Any = None,
                  claimed_coefficients: Any = None, clipper: str = "claimed", dtype: str | None = None,
                  batch_axis: int = 0, is_padding_example: Any = None, **run: Unpack[_gate.GateRun]) -> Report:
    """Asserts that `update` (a dict keyed by Flax parameter path, or the params pytree) is the
    DP-SGD update (Σ_i c*_i g*_i + σ C ξ) / D of `model` on `inputs` (the JAX twin of
    `ghost_oracle.torch.assert_update`, with the same keyword arguments); `clipped_sum`, when
    given, is judged exactly and makes the noise testable per tensor. `claimed_norms` default:
    the exact norms, so only the step is judged."""
    __tracebackhide__ = True
    if update is None:
        raise ValueError("update is required: the {name: array} the optimizer steps with")
    return _judge("assert_update", model, params, per_example_loss, inputs, claimed_norms=claimed_norms,
                  clipper=clipper, run=run,
                  export={"max_grad_norm": max_grad_norm, "claimed_coefficients": claimed_coefficients,
                          "noise_multiplier": noise_multiplier, "dtype": dtype, "update": update,
                          "clipped_sum": clipped_sum, "batch_divisor": batch_divisor,
                          "clip_stabilizer": clip_stabilizer, "clipping": clipping, "batch_axis": batch_axis,
                          "is_padding_example": is_padding_example})
