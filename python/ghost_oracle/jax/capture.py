"""Capture: every call of a modelled module method (`kinds/`) is seen by `nn.intercept_methods`,
which records the arguments its kind reads and adds to its output a perturbation of its own
(zeros), so that the gradient of the summed loss with respect to that output (each example's own
output gradient, since examples do not mix) comes back from one `jax.grad`. Each call gets its
own perturbation, named by the module's path, method and call count: a module called twice (a
tied head, a layer reused) is two uses, not one summed gradient.

Two passes of `per_example_loss`: the first, without any transformation, records concrete
inputs and creates the perturbations; the second differentiates the summed loss with respect to
the parameters (the batch gradient the self-check compares with) and to the perturbations.

`nn.scan` over layers (`scan.py`): during the capture, Flax's scan runs as a Python loop over
the layers, each layer's calls tagged with their layer, so that the stacked parameter
`layers.attn.q.kernel` (L×…) is written as the L parameters `layers.attn.q.kernel[l]`. A scan
the loop cannot replay exactly is refused by name, as is a modelled call under any other
transformation inside the model (`nn.vmap`, `nn.remat`, a jit that `jax.disable_jit` does not reach)."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ..trace_file import TraceExportError
from .kinds import handler_for
from .scan import Layer, scans_as_loops
from .sites import Call

PerExampleLoss = Callable[[Callable[..., Any], Any], Any]

# what a tracer met in the first pass (which runs without any transformation) says about the
# transformation inside the model that made it
_TRANSFORMS = {"BatchTracer": "nn.vmap or jax.vmap", "JVPTracer": "a jvp or grad",
               "DynamicJaxprTracer": "nn.remat, jax.checkpoint, a jit or a custom transformation",
               "JaxprTracer": "a partial evaluation (jax.linearize, a custom transformation)"}


@dataclass
class _Recorder:
    batch: int
    recording: bool
    perturbations: dict[str, Any] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    counts: dict[tuple[tuple[str, ...], str], int] = field(default_factory=dict)
    layers: list[Layer] = field(default_factory=list)
    scans: dict[tuple[str, ...], int] = field(default_factory=dict)  # scanned module path -> L

    def _enter_layer(self, path: tuple[str, ...]) -> None:
        """The first call inside a scan iteration is the scanned module's own: its path is the
        prefix of the stacked parameters."""
        layer = self.layers[-1]
        layer.prefix = path
        name = ".".join(path) or "<root>"
        if layer.refusal is not None:
            raise TraceExportError(f"module `{name}` is an nn.scan whose {layer.refusal}; the exporter replays a "
                                   "scan whose parameters are stacked on axis 0 (variable_axes={'params': 0}), "
                                   "one layer per index, and refuses this one rather than write a wrong trace")
        if self.scans.setdefault(path, layer.length) != layer.length:
            raise TraceExportError(f"module `{name}`: scanned with lengths {self.scans[path]} and {layer.length}")

    def layer_of(self, path: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(f.index for f in self.layers if f.prefix is not None and path[:len(f.prefix)] == f.prefix)

    def intercept(self, next_fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                  context: Any) -> Any:
        module = context.module
        if self.layers and self.layers[-1].prefix is None:
            self._enter_layer(tuple(str(p) for p in module.scope.path))
        handler = handler_for(module, context.method_name)
        if handler is None:
            return next_fun(*args, **kwargs)
        out = next_fun(*args, **kwargs)
        path = tuple(str(p) for p in module.scope.path)
        key = (path, context.method_name)
        k = self.counts.get(key, 0)
        self.counts[key] = k + 1
        layer = self.layer_of(path)
        where = (f"module `{'.'.join(path) or '<root>'}` ({type(module).__name__}.{context.method_name}"
                 + "".join(f", layer {i}" for i in layer) + ")")
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
        name = f"{'.'.join(path)}:{context.method_name}@{k}"
        if self.recording:
            arrays = [a for a in (*recorded, out) if isinstance(a, (jax.Array, np.ndarray))]
            traced = [a for a in arrays if isinstance(a, jax.core.Tracer)]
            if traced:
                by = _TRANSFORMS.get(type(traced[0]).__name__, f"a transformation ({type(traced[0]).__name__})")
                raise TraceExportError(
                    f"{where} was called under {by} inside the model: its inputs are traced values, not one per "
                    "example, and the exporter refuses to guess how the transformation maps them to examples "
                    "(nn.scan over layers with variable_axes={'params': 0} is replayed layer by layer; unroll "
                    "other transformations for the trace)")
            self.perturbations[name] = jnp.zeros(out.shape, out.dtype)
            own = {n: np.asarray(v) for n, v in module.variables.get("params", {}).items()
                   if isinstance(v, (jax.Array, np.ndarray))}
            self.calls.append(Call(path=path, cls=type(module).__name__, method=context.method_name, index=k,
                                   args=tuple(np.asarray(a) if isinstance(a, (jax.Array, np.ndarray)) else a
                                              for a in recorded),
                                   out_dtype=np.dtype(out.dtype), out_shape=tuple(out.shape),
                                   module=module.clone(parent=None), params=own, layer=layer, key=name))
        if name not in self.perturbations:
            raise TraceExportError(f"{where}: called in the gradient pass but not in the recording pass; "
                                   "per_example_loss must run the same forward each time")
        return out + self.perturbations[name]


@dataclass
class Captured:
    calls: list[Call]
    losses: np.ndarray
    param_grads: Any  # the params pytree's batch gradient of the summed (unpadded) loss
    scans: dict[tuple[str, ...], int]  # the path of each module scanned over layers -> its length


def _apply_fn(model: nn.Module, variables: dict[str, Any], recorder: _Recorder, applied: list[int]
              ) -> Callable[..., Any]:
    def apply(*args: Any, **kwargs: Any) -> Any:
        if "mutable" in kwargs:
            raise ValueError("apply: `mutable` is set by the exporter; per_example_loss may not pass it")
        if applied:
            raise ValueError("per_example_loss called apply more than once; the exporter traces one forward")
        applied.append(1)
        with nn.intercept_methods(recorder.intercept), scans_as_loops(recorder.layers):
            return model.apply(variables, *args, **kwargs)
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
    # jit inside the model (the gemma package jits its Transformer's __call__) would hand the
    # interceptor traced values; the passes run eagerly, with the model's own arithmetic. Only
    # the first pass needs concrete values, but the gradient pass under jax.jit, or with the
    # model's own jit left on, was measured no faster on the tiny Gemma 3 and jax_privacy tests
    # (compiling costs what eager dispatch saves) and rounds differently from the first pass
    with jax.disable_jit():
        _losses(per_example_loss(_apply_fn(model, {"params": params}, first, []), inputs), batch)

    def total(p: Any, perts: dict[str, Any]) -> tuple[jax.Array, jax.Array]:
        rec = _Recorder(batch, recording=False, perturbations=perts)
        losses = _losses(per_example_loss(_apply_fn(model, {"params": p}, rec, []), inputs), batch)
        return jnp.sum(losses * jnp.asarray(weights, dtype=losses.dtype)), losses

    with jax.disable_jit():
        (g_params, g_perts), losses = jax.grad(total, argnums=(0, 1), has_aux=True)(params, first.perturbations)
    for call in first.calls:
        call.grad = np.asarray(g_perts[call.key])
    return Captured(first.calls, np.asarray(losses), g_params, dict(first.scans))


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
