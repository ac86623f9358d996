"""Capture: every call of a modelled module method (`kinds/`) is seen by `nn.intercept_methods`,
which records the arguments its kind reads and passes the output through `Module.perturb`, so
that the gradient of the summed loss with respect to that output (each example's own output
gradient, since examples do not mix) comes back from one `jax.grad`. Each call gets its own
perturbation, named by the module's path, method and call count: a module called twice (a tied
head, a layer reused) is two uses, not one summed gradient.

Two passes of `per_example_loss`: the first, without any transformation, records concrete
inputs and creates the perturbations; the second differentiates the summed loss with respect to
the parameters (the batch gradient the self-check compares with) and to the perturbations."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ..trace_file import TraceExportError
from .kinds import handler_for
from .sites import Call

# The collection the output perturbations live in: its own name, so that a model's own
# `perturbations` are left alone.
COLLECTION = "ghost_oracle_outputs"

PerExampleLoss = Callable[[Callable[..., Any], Any], Any]


class _Recorder:
    def __init__(self, batch: int, recording: bool) -> None:
        self.batch = batch
        self.recording = recording
        self.calls: list[Call] = []
        self.counts: dict[tuple[tuple[str, ...], str], int] = {}

    def intercept(self, next_fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                  context: Any) -> Any:
        module = context.module
        handler = handler_for(module, context.method_name)
        if handler is None:
            return next_fun(*args, **kwargs)
        out = next_fun(*args, **kwargs)
        path = tuple(str(p) for p in module.scope.path)
        key = (path, context.method_name)
        k = self.counts.get(key, 0)
        self.counts[key] = k + 1
        where = f"module `{'.'.join(path) or '<root>'}` ({type(module).__name__}.{context.method_name})"
        if not isinstance(out, (jax.Array, np.ndarray)):
            raise TraceExportError(f"{where} returned a {type(out).__name__}, not an array")
        recorded = handler.record(args, kwargs)
        if out.ndim >= 1 and out.shape[0] == 1 and self.batch > 1:
            # an output computed once for the batch (a 1×T position lookup): expanded, so that
            # its gradient stays per example instead of the batch's sum
            out = jnp.broadcast_to(out, (self.batch, *out.shape[1:]))
            recorded = tuple(jnp.broadcast_to(a, (self.batch, *a.shape[1:]))
                             if isinstance(a, (jax.Array, np.ndarray)) and a.ndim >= 1 and a.shape[0] == 1 else a
                             for a in recorded)
        out = module.perturb(f"{context.method_name}@{k}", out, collection=COLLECTION)
        if self.recording:
            arrays = [a for a in recorded if isinstance(a, (jax.Array, np.ndarray))]
            if any(isinstance(a, jax.core.Tracer) for a in arrays):
                raise TraceExportError(
                    f"{where} was called under a JAX transformation (nn.scan, nn.vmap, jit or a custom one inside "
                    "the model): its inputs are traced values, not one per example, and the exporter refuses to "
                    "guess how the transformation maps them to examples. Unroll the layers for the trace")
            own = {name: np.asarray(v) for name, v in module.variables.get("params", {}).items()
                   if isinstance(v, (jax.Array, np.ndarray))}
            self.calls.append(Call(path=path, cls=type(module).__name__, method=context.method_name, index=k,
                                   args=tuple(np.asarray(a) if isinstance(a, (jax.Array, np.ndarray)) else a
                                              for a in recorded),
                                   out_dtype=np.dtype(out.dtype), out_shape=tuple(out.shape),
                                   module=module.clone(parent=None), params=own))
        return out


@dataclass
class Captured:
    calls: list[Call]
    losses: np.ndarray
    param_grads: Any  # the params pytree's batch gradient of the summed (unpadded) loss


def _apply_fn(model: nn.Module, variables: dict[str, Any], recorder: _Recorder, mutated: dict[str, Any],
              applied: list[int]) -> Callable[..., Any]:
    def apply(*args: Any, **kwargs: Any) -> Any:
        if "mutable" in kwargs:
            raise ValueError("apply: `mutable` is set by the exporter; per_example_loss may not pass it")
        if applied:
            raise ValueError("per_example_loss called apply more than once; the exporter traces one forward")
        applied.append(1)
        with nn.intercept_methods(recorder.intercept):
            out, state = model.apply(variables, *args, mutable=[COLLECTION], **kwargs)
        mutated.update(state)
        return out
    return apply


def _losses(value: Any, batch: int) -> jax.Array:
    arr = jnp.asarray(value)
    if arr.shape != (batch,):
        raise ValueError(f"per_example_loss returned shape {tuple(arr.shape)}; expected ({batch},), one loss per "
                         "example")
    return arr


def capture(model: nn.Module, params: Any, per_example_loss: PerExampleLoss, inputs: Any, batch: int,
            weights: np.ndarray) -> Captured:
    """Records every modelled call on `inputs` and the gradients of Σ_i weights_i·loss_i."""
    first = _Recorder(batch, recording=True)
    mutated: dict[str, Any] = {}
    # jit inside the model (the gemma package jits its Transformer's __call__) would hand the
    # interceptor traced values; the passes run eagerly, with the model's own arithmetic
    with jax.disable_jit():
        _losses(per_example_loss(_apply_fn(model, {"params": params}, first, mutated, []), inputs), batch)
    perturbations = mutated.get(COLLECTION, {})

    def total(p: Any, perts: Any) -> tuple[jax.Array, jax.Array]:
        rec = _Recorder(batch, recording=False)
        losses = _losses(per_example_loss(_apply_fn(model, {"params": p, COLLECTION: perts}, rec, {}, []), inputs),
                         batch)
        return jnp.sum(losses * jnp.asarray(weights, dtype=losses.dtype)), losses

    with jax.disable_jit():
        (g_params, g_perts), losses = jax.grad(total, argnums=(0, 1), has_aux=True)(params, perturbations)
    for call in first.calls:
        node: Any = g_perts
        for part in call.path:
            node = node[part]
        call.grad = np.asarray(node[f"{call.method}@{call.index}"])
    return Captured(first.calls, np.asarray(losses), g_params)


def flat_params(tree: Any, what: str) -> dict[str, Any]:
    """A nested mapping of arrays as {"a.b.kernel": array}, the Flax path joined with '.'."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: tuple[str, ...]) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, (*prefix, str(k)))
        else:
            if not prefix:
                raise TypeError(f"{what} must be a dict of parameter arrays, got {type(node).__name__}")
            out[".".join(prefix)] = node

    walk(tree, ())
    return out
