"""`assert_norms` and `assert_update`: export to a temporary file (or `trace_path`), check with
the f64 reference, raise `ClippingCheckFailed` unless the verdict is pass. Both take a Flax linen
model (with its per-example loss and inputs) or, in its place, the function jax_privacy clips
(`fun(params, batch)`, captured from its jaxpr: `program/`), dispatched on `nn.Module`. The keyword arguments
of the check are `ghost_oracle._gate.GateRun`'s, the same as the PyTorch twins'."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import flax.linen as nn

from .. import _gate
from .._report import Report
from .trace import UNCLAIMED, export_trace

if TYPE_CHECKING:
    from typing_extensions import Unpack


class _NotGiven:
    """The placeholder of an argument the call left out (None is a value some of them take)."""

    def __repr__(self) -> str:
        return "<not given>"


_NOT_GIVEN: Any = _NotGiven()


def _shifted(function: str, what: str, inputs: Any, keyword: Any) -> Any:
    """The program route's `what`: its fourth positional argument (the linen route's `inputs`
    place), or given by keyword."""
    if inputs is not _NOT_GIVEN and keyword is not _NOT_GIVEN:
        raise TypeError(f"{function}(fun, params, batch, {what}, ...): {what} given twice (positionally and by "
                        "keyword)")
    got = keyword if inputs is _NOT_GIVEN else inputs
    if got is _NOT_GIVEN:
        raise TypeError(f"{function}(fun, params, batch, {what}, ...): missing {what}")
    return got


def _judge(function: str, model: Any, params: Any, per_example_loss: Any, inputs: Any, *,
           claimed_norms: Any, clipper: str, run: _gate.GateRun, export: dict[str, Any]) -> Report:
    """`ghost_oracle._gate.gate` with the JAX exporter, either route (`export_trace`: a linen
    model with its per-example loss and inputs, or the program `fun` with its batch in
    `per_example_loss`' place and `inputs` unused). `claimed_norms` None: the exact norms, so
    that only the step is judged."""
    __tracebackhide__ = True
    program = not isinstance(model, nn.Module)

    def write(path: str, norms: Any) -> object:
        if program:
            return export_trace(model, params, per_example_loss, path, claimed_norms=norms, clipper=clipper, **export)
        return export_trace(model, params, per_example_loss, inputs, path, claimed_norms=norms, clipper=clipper,
                            **export)

    return _gate.gate(write, unclaimed=UNCLAIMED, claimed_norms=claimed_norms, clipper=clipper, run=run,
                      function=function)


def _route(model: Any, inputs: Any, batch_argnums: Any, keep_batch_dim: Any) -> dict[str, Any]:
    """The keyword arguments only the program route takes, checked against the linen route."""
    if isinstance(model, nn.Module):
        if inputs is _NOT_GIVEN:
            raise TypeError("a linen model is judged with (model, params, per_example_loss, inputs, ...): missing "
                            "inputs")
        if batch_argnums != 1 or keep_batch_dim is not True:
            raise ValueError("batch_argnums and keep_batch_dim are the program route's (fun, params, batch, ...); a "
                             "linen model takes per_example_loss and inputs instead")
        return {}
    return {"batch_argnums": batch_argnums, "keep_batch_dim": keep_batch_dim}


def assert_norms(model: nn.Module | Callable[..., Any], params: Any, per_example_loss: Any, inputs: Any = _NOT_GIVEN,
                 claimed_norms: Any | Callable[[Any, Any], Any] = _NOT_GIVEN, *, max_grad_norm: float,
                 noise_multiplier: float = 1.0, clipper: str = "claimed", claimed_coefficients: Any = None,
                 dtype: str | None = None, batch_axis: int = 0, is_padding_example: Any = None,
                 batch_argnums: int | tuple[int, ...] = 1, keep_batch_dim: bool = True,
                 **run: Unpack[_gate.GateRun]) -> Report:
    """Asserts that `claimed_norms` are the true per-example gradient norms (the JAX twin of
    `ghost_oracle.torch.assert_norms`, with the same keyword arguments: `precision`,
    `sampling_rate`, `steps`, `epochs`, `dataset_size`, `delta`, `trace_path`, `max_memory`,
    `batch_axis`, as documented there), of either:

    - a Flax linen `model` with `params` on `inputs`: `assert_norms(model, params,
      per_example_loss, inputs, claimed_norms, ...)`, `per_example_loss(apply, inputs)`
      returning the B losses, `apply(*args, **kwargs)` running `model.apply({"params": params},
      ...)` under the capture;
    - any JAX function, the one jax_privacy's `clipped_grad` clips: `assert_norms(fun, params,
      batch, claimed_norms, max_grad_norm=C)`, `fun(params, batch)` returning the loss of the
      examples in `batch` (B first), `batch_argnums` and `keep_batch_dim` as `clipped_grad`
      reads them (`ghost_oracle.jax.program`).

    `precision` is the precision the judgement assumes (default: the trace's). `batch_axis`: 0,
    the only axis the JAX exporter follows the examples along (`export_trace`). Returns the
    `Report` on pass; raises `ClippingCheckFailed` (an AssertionError, `.report` the whole
    report) otherwise, `TraceExportError` where the model cannot be traced faithfully."""
    __tracebackhide__ = True
    route = _route(model, inputs, batch_argnums, keep_batch_dim)
    if route:
        claimed_norms = _shifted("assert_norms", "claimed_norms", inputs, claimed_norms)
    elif claimed_norms is _NOT_GIVEN:
        raise TypeError("assert_norms(model, params, per_example_loss, inputs, claimed_norms, ...): missing "
                        "claimed_norms")
    return _judge("assert_norms", model, params, per_example_loss, inputs, claimed_norms=claimed_norms,
                  clipper=clipper, run=run,
                  export={"max_grad_norm": max_grad_norm, "claimed_coefficients": claimed_coefficients,
                          "noise_multiplier": noise_multiplier, "dtype": dtype, "batch_axis": batch_axis,
                          "is_padding_example": is_padding_example, **route})


def assert_update(model: nn.Module | Callable[..., Any], params: Any, per_example_loss: Any, inputs: Any = _NOT_GIVEN,
                  update: Any = _NOT_GIVEN, *, max_grad_norm: float, noise_multiplier: float, batch_divisor: float,
                  clipped_sum: Any = None, clip_stabilizer: float = 0.0, clipping: str = "flat",
                  claimed_norms: Any = None, claimed_coefficients: Any = None, clipper: str = "claimed",
                  dtype: str | None = None, batch_axis: int = 0, is_padding_example: Any = None,
                  batch_argnums: int | tuple[int, ...] = 1, keep_batch_dim: bool = True,
                  **run: Unpack[_gate.GateRun]) -> Report:
    """Asserts that `update` (a dict keyed by parameter name, or the params pytree) is the DP-SGD
    update (Σ_i c*_i g*_i + σ C ξ) / D (the JAX twin of `ghost_oracle.torch.assert_update`, with
    the same keyword arguments), of a linen `model` (`assert_update(model, params,
    per_example_loss, inputs, update, ...)`) or of the function jax_privacy clips
    (`assert_update(fun, params, batch, update, ...)`, `batch_argnums` and `keep_batch_dim` as
    `clipped_grad` reads them); see `assert_norms`. `clipped_sum`, when given, is judged exactly
    and makes the noise testable per tensor. `claimed_norms` default: the exact norms, so only
    the step is judged."""
    __tracebackhide__ = True
    route = _route(model, inputs, batch_argnums, keep_batch_dim)
    if route:
        update = _shifted("assert_update", "update", inputs, update)
    elif update is _NOT_GIVEN:
        update = None
    if update is None:
        raise ValueError("update is required: the {name: array} the optimizer steps with")
    return _judge("assert_update", model, params, per_example_loss, inputs, claimed_norms=claimed_norms,
                  clipper=clipper, run=run,
                  export={"max_grad_norm": max_grad_norm, "claimed_coefficients": claimed_coefficients,
                          "noise_multiplier": noise_multiplier, "dtype": dtype, "update": update,
                          "clipped_sum": clipped_sum, "batch_divisor": batch_divisor,
                          "clip_stabilizer": clip_stabilizer, "clipping": clipping, "batch_axis": batch_axis,
                          "is_padding_example": is_padding_example, **route})
