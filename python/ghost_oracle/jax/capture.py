"""Capture: every call of a modelled module method (`kinds/`) is seen by `nn.intercept_methods`,
which records the arguments its kind reads and adds to its output a perturbation of its own
(zeros), so that the gradient of a loss with respect to that output comes back from the
pullback of the model's losses. Each call gets its own perturbation, named by the module's path,
method and call count: a module called twice (a tied head, a layer reused) is two uses, not one
summed gradient.

Two passes of `per_example_loss`: the first, without any transformation, records concrete
inputs and creates the perturbations; the second is a `jax.vjp` of the B losses with respect to
the parameters, the perturbations and the floating-point inputs. Its pullback gives the batch
gradient of Σ_i w_i·loss_i (the self-check's) and each call's output gradient, and, with a
one-hot cotangent, single examples' losses pulled back: the probes (`probes.py`) that check each
call's output gradient splits into examples along axis 0, and refuse a model that mixes
examples. Only where a use fails that check is the forward run once more, under `jax.vmap`, to
tell a use shared by every example (a position lookup) from one that mixes them.

`nn.scan` over layers (`scan.py`): during the capture, Flax's scan runs as a Python loop over
the layers, each layer's calls tagged with their layer, so that the stacked parameter
`layers.attn.q.kernel` (L×…) is written as the L parameters `layers.attn.q.kernel[l]`. A scan
the loop cannot replay exactly is refused by name, as is a modelled call under any other
transformation inside the model (`nn.vmap`, `nn.remat`, a jit that `jax.disable_jit` does not reach)."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from .._trace.format import TraceExportError
from .kinds import handler_for
from .probes import Inputs, Probe, check_examples, lifted
from .scan import Layer, scans_as_loops
from .sites import Call

PerExampleLoss = Callable[[Callable[..., Any], Any], Any]
# nn.intercept_methods' interceptor: (the method, its args, its kwargs, the context) -> its output
Interceptor = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any], Any], Any]

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
    # the provenance pass: the calls whose input or output is a traced value (computed from the batch)
    traced: set[str] | None = None
    # a forward probe: each call's floating-point input arrays, by call
    stash: dict[str, list[Any]] | None = None

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
        name = f"{'.'.join(path)}:{context.method_name}@{k}"
        if self.traced is not None and any(isinstance(a, jax.core.Tracer) for a in (*recorded, out)):
            self.traced.add(name)
        if self.stash is not None:
            self.stash[name] = [a for a in recorded if isinstance(a, (jax.Array, np.ndarray))
                                and jnp.issubdtype(a.dtype, jnp.floating)]
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


def _apply_fn(model: nn.Module, variables: dict[str, Any], recorder: _Recorder, applied: list[int],
              outer: Interceptor | None = None) -> Callable[..., Any]:
    def apply(*args: Any, **kwargs: Any) -> Any:
        mutable = kwargs.get("mutable", False)
        names = [mutable] if isinstance(mutable, str) else mutable
        if mutable is not False and (not isinstance(names, (list, tuple)) or "params" in names
                                     or not all(isinstance(n, str) for n in names)):
            # state collections may change (BatchNorm's batch_stats, which it creates when absent);
            # the parameters are the exporter's
            raise ValueError(f"apply: `mutable` may name state collections other than 'params' (as "
                             f"mutable=['batch_stats']), got {mutable!r}")
        if applied:
            raise ValueError("per_example_loss called apply more than once; the exporter traces one forward")
        applied.append(1)
        with contextlib.ExitStack() as stack:
            stack.enter_context(nn.intercept_methods(recorder.intercept))
            if outer is not None:
                # entered last, so it runs first: what it changes of a module (the replay's
                # precision) is what the recorder and the module's method see
                stack.enter_context(nn.intercept_methods(outer))
            stack.enter_context(scans_as_loops(recorder.layers))
            return model.apply(variables, *args, **kwargs)
    return apply


def _losses(value: Any, batch: int) -> jax.Array:
    arr = jnp.asarray(value)
    if arr.shape != (batch,):
        raise ValueError(f"per_example_loss returned shape {tuple(arr.shape)}; expected ({batch},), one loss per "
                         f"example: the examples lie on axis 0 of the inputs (the first array's axis 0 has {batch} "
                         "entries)")
    return arr


_READ_INTO_PYTHON = (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
                     jax.errors.TracerBoolConversionError, jax.errors.TracerIntegerConversionError)


def _float_batch(value: Any, batch: int) -> bool:
    """An input array the probes differentiate: floating point, the examples on axis 0."""
    return (lifted(value) and len(value.shape) >= 1 and int(value.shape[0]) == batch
            and jnp.issubdtype(value.dtype, jnp.floating))


def _output_batch_axis(call: Call) -> int:
    """Where the call's handler takes the examples to lie in its output: axis 0, or where an
    einsum's equation puts the input's first axis (a malformed equation is the handler's to
    refuse, when its sites are built)."""
    handler = handler_for(call.module, call.method)
    find = getattr(handler, "output_batch_axis", None)
    if find is None:
        return 0
    try:
        return int(find(call))
    except TraceExportError:
        return 0


def capture(model: nn.Module, params: Any, per_example_loss: PerExampleLoss, inputs: Any, batch: int,
            weights: np.ndarray, outer: Interceptor | None = None) -> Captured:
    """Records every modelled call on `inputs` and the gradients of Σ_i weights_i·loss_i; the
    probes check that the examples do not mix (refused by name otherwise). `outer`, an
    interceptor run around every module method before the capture's own (the replay's, which
    sets each module's precision: `rounding.py`)."""
    first = _Recorder(batch, recording=True)
    # jit inside the model (the gemma package jits its Transformer's __call__) would hand the
    # interceptor traced values; the passes run eagerly, with the model's own arithmetic. Only
    # the first pass needs concrete values, but the gradient pass under jax.jit, or with the
    # model's own jit left on, was measured no faster on the tiny Gemma 3 and jax_privacy tests
    # (compiling costs what eager dispatch saves) and rounds differently from the first pass
    with jax.disable_jit():
        _losses(per_example_loss(_apply_fn(model, {"params": params}, first, [], outer), inputs), batch)

    flat, treedef = jax.tree_util.tree_flatten_with_path(inputs)
    values = [v for _, v in flat]
    probed = [k for k, v in enumerate(values) if _float_batch(v, batch)]
    names = [f"input `inputs{jax.tree_util.keystr(flat[k][0])}`" for k in probed]

    def with_values(replaced: dict[int, Any]) -> Any:
        return jax.tree_util.tree_unflatten(treedef, [replaced.get(k, v) for k, v in enumerate(values)])

    def run(p: Any, rec: _Recorder, replaced: dict[int, Any]) -> jax.Array:
        return _losses(per_example_loss(_apply_fn(model, {"params": p}, rec, [], outer), with_values(replaced)), batch)

    def forward(p: Any, perts: dict[str, Any], floats: list[Any]) -> jax.Array:
        return run(p, _Recorder(batch, recording=False, perturbations=perts), dict(zip(probed, floats, strict=True)))

    floats = [jnp.asarray(values[k]) for k in probed]
    with jax.disable_jit():
        try:
            losses, pullback = jax.vjp(forward, params, first.perturbations, floats)
        except _READ_INTO_PYTHON as e:
            if not probed:
                raise
            raise TraceExportError(
                f"the forward reads values of {', '.join(names)} into Python ({type(e).__name__}): the exporter "
                "differentiates each example's loss with respect to the floating-point inputs too, to check that "
                "no example's loss depends on another's inputs; compute with jax operations on them") from e
        dtype = np.dtype(losses.dtype)
        g_params, g_perts, g_floats = pullback(jnp.asarray(weights.astype(dtype)))

    def pull(i: int) -> Probe:
        onehot = np.zeros(batch, dtype)
        onehot[i] = 1
        with jax.disable_jit():
            _, gp, gf = pullback(jnp.asarray(onehot))
        return Probe({k: np.asarray(v) for k, v in gp.items()}, [np.asarray(v) for v in gf])

    def batch_dependent() -> set[str] | None:
        """The calls computed from the batch: a pass under jax.vmap over a new leading axis of
        every input array (integer ids too), where every value computed from them is traced."""
        rec = _Recorder(batch, recording=False, perturbations=first.perturbations, traced=set())
        lift = [k for k, v in enumerate(values) if lifted(v)]

        def one(arrays: list[Any]) -> jax.Array:
            return run(params, rec, dict(zip(lift, arrays, strict=True)))

        try:
            with jax.disable_jit():
                jax.vmap(one)([jnp.asarray(values[k])[None] for k in lift])
        except _READ_INTO_PYTHON:
            return None
        assert rec.traced is not None
        return rec.traced

    def first_mixed_use(j: int) -> Call | None:
        """The first call whose floating-point input holds values computed from example j's
        inputs at another example (a jvp from example j's slice of every probed input)."""
        rec = _Recorder(batch, recording=False, perturbations=first.perturbations, stash={})

        def f(fl: list[Any]) -> tuple[jax.Array, dict[str, list[Any]]]:
            out = run(params, rec, dict(zip(probed, fl, strict=True)))
            assert rec.stash is not None
            return out, dict(rec.stash)

        tangents = []
        for x in floats:
            t = np.zeros(x.shape, np.dtype(x.dtype))
            t[j] = 1
            tangents.append(jnp.asarray(t))
        with jax.disable_jit():
            _, (_, moved) = jax.jvp(f, (floats,), (tangents,))
        for call in first.calls:
            for t in moved.get(call.key, []):
                nz = np.asarray(t) != 0
                if nz.ndim >= 1 and nz.shape[0] == batch:
                    nz = np.delete(nz, j, axis=0)
                if nz.any():
                    return call
        return None

    check_examples(first.calls, {c.key: _output_batch_axis(c) for c in first.calls},
                   {k: np.asarray(v) for k, v in g_perts.items()},
                   Inputs(names, [tuple(x.shape) for x in floats]), [np.asarray(g) for g in g_floats], pull, batch,
                   batch_dependent, first_mixed_use)
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
