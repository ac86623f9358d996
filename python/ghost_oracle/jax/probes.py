"""Per-example probes: the capture's assumption that examples do not mix, checked rather than
assumed (the JAX twin of `ghost_oracle.torch.layout`).

A site's factors are per example only if its output's gradient splits into examples along
axis 0: the gradient of example i's loss alone must reach example i's slice of every modelled
module's output and no other. That is checked by pulling back single examples' losses (the
pullback of the capture's gradient pass, with a one-hot cotangent per probed example: the same
ops at the same shapes, so nothing new is compiled). An output that example i's loss reaches at
another example belongs to a model that mixes examples (statistics or attention across the
batch), for which a per-example gradient, and so per-example clipping, is not defined: refused,
naming the module. So is an output whose examples lie along another axis (the exporter takes
them on axis 0), with that axis named.

The floating-point inputs are probed too: batch statistics taken of the inputs before the
first modelled module show there and nowhere else (every module's output gradient stays with
its example). A forward probe (a jvp from one example's inputs) then names the first modelled
module whose input holds other examples' values.

One kind of use is neither per-example nor mixing: a use **shared by every example**, computed
from no example of the batch (nanoGPT's `Embed(...)(jnp.arange(T))`, T×d; GPT-2's 1×T position
lookup). Every example's loss reaches all of its output, as in a model that mixes examples, and
its output may have an axis of B entries by coincidence of T. The two are told apart by what
the output was computed from, not by its shape: a pass under `jax.vmap` over a new axis of the
inputs marks every value computed from the batch (integer ids included) as traced, and a shared
use's output is not. Its per-example factors are its one input repeated for every example and
the per-example output gradients ∂L_i/∂out, one probe each (in the trace's factors only: the
model's forward is never changed). Nothing else is broadcast to the batch.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._trace.format import TraceExportError
from .sites import Call

# Examples probed: every one up to this batch size; above it, at least PROBE_AT_LEAST of a
# seeded order, then more until every use and input the batch's gradient reaches was reached
# by some probe (the torch exporter's rule).
PROBE_ALL_UP_TO = 8
PROBE_AT_LEAST = 4
PROBE_SEED = 20260612


def probe_order(b: int) -> list[int]:
    if b <= PROBE_ALL_UP_TO:
        return list(range(b))
    return [int(i) for i in np.random.default_rng(PROBE_SEED).permutation(b)]


@dataclass
class Probe:
    """One example's loss pulled back: its gradient at every call's output (by the call's
    perturbation key) and at every probed input."""

    outputs: dict[str, np.ndarray]
    inputs: list[np.ndarray]


@dataclass
class Seen:
    """What the probes saw at one output (a call's, or an input's): per candidate axis (one of
    B entries), [every probe stayed at its own index, some probe reached its own index]; the
    first probe that reached other examples along `axis`, where the examples are taken to lie
    (0, or for an einsum the output's place of the input's first axis); whether any probe
    reached it."""

    axes: dict[int, list[bool]]
    axis: int = 0  # where its handler takes the examples to lie
    spill: tuple[int, list[int]] | None = None
    reached: bool = False
    grads: dict[int, np.ndarray] = field(default_factory=dict)

    def fits(self) -> list[int]:
        return [a for a, (confined, hit) in self.axes.items() if confined and hit]


def _candidate_axes(shape: Sequence[int], b: int, features_last: bool) -> dict[int, list[bool]]:
    """The axes of B entries; the last holds features and is never the batch (unless it is the
    only one, or `features_last` is False, for an input)."""
    last = len(shape) - 1 if features_last and len(shape) > 1 else len(shape)
    return {a: [True, False] for a in range(last) if shape[a] == b}


def _others(g: np.ndarray, axis: int, i: int, b: int) -> tuple[list[int], bool]:
    """(the indices other than i along `axis` where `g` is nonzero, whether it is at i)."""
    nz = np.moveaxis(g, axis, 0).reshape(b, -1) != 0
    hit = nz.any(1)
    return [int(j) for j in np.flatnonzero(hit) if j != i], bool(hit[i])


def _observe(seen: Seen, g: np.ndarray, i: int, b: int) -> None:
    if not np.any(g != 0):
        return
    seen.reached = True
    for a, st in seen.axes.items():
        others, at_i = _others(g, a, i, b)
        if others:
            st[0] = False
            if a == seen.axis and seen.spill is None:
                seen.spill = (i, others)
        st[1] = st[1] or at_i


def _shown(others: list[int]) -> str:
    return ", ".join(map(str, others[:6])) + (", ..." if len(others) > 6 else "")


@dataclass
class Inputs:
    """The batch's floating-point arrays with the examples on axis 0: their names (`inputs['x']`)."""

    names: list[str]
    shapes: list[tuple[int, ...]]


def check_examples(calls: Sequence[Call], batch_axes: dict[str, int], batch_grads: dict[str, np.ndarray],
                   inputs: Inputs, input_batch_grads: Sequence[np.ndarray], pull: Callable[[int], Probe], b: int,
                   batch_dependent: Callable[[], set[str] | None],
                   first_mixed_use: Callable[[int], Call | None]) -> None:
    """Probes single examples' losses and checks every call's output and every input against
    them. Sets each call's `grad`: the batch gradient where the examples lie along the axis of
    its output its handler takes them on (`batch_axes`: 0, or an einsum's place of them), or,
    for a use shared by every example, the per-example output gradients stacked (and its
    inputs repeated for every example). Raises `TraceExportError` naming the module (or
    the input) where the model mixes examples, or where its examples lie along another axis.

    `pull(i)` pulls back example i's loss alone; `batch_dependent()` the keys of the calls whose
    output or input was computed from the batch (None where that cannot be told);
    `first_mixed_use(j)` the first call whose input holds values computed from example j's
    inputs at another example."""
    seen = {c.key: Seen(_candidate_axes(c.out_shape, b, features_last=True), batch_axes.get(c.key, 0)) for c in calls}
    seen_in = [Seen(_candidate_axes(s, b, features_last=False)) for s in inputs.shapes]
    live = [c.key for c in calls if np.any(batch_grads[c.key] != 0)]
    live_in = [k for k, g in enumerate(input_batch_grads) if np.any(g != 0)]
    probes: dict[int, Probe] = {}
    order = probe_order(b)
    for n, i in enumerate(order):
        if (b > PROBE_ALL_UP_TO and n >= PROBE_AT_LEAST and all(seen[k].reached for k in live)
                and all(seen_in[k].reached for k in live_in)):
            break
        probe = probes[i] = pull(i)
        for c in calls:
            g = probe.outputs[c.key]
            _observe(seen[c.key], g, i, b)
            seen[c.key].grads[i] = g
        for k, g in enumerate(probe.inputs):
            _observe(seen_in[k], g, i, b)
    # the uses whose examples do not lie along their axis: shared by every example, or refused
    failing = [c for c in calls if seen[c.key].reached and seen[c.key].axis not in seen[c.key].fits()]
    if failing:
        dependent = batch_dependent()
        for c in failing:
            if dependent is not None and c.key not in dependent and seen[c.key].axis == 0:
                for i in range(b):  # a shared use needs every example's output gradient
                    if i not in probes:
                        probes[i] = pull(i)
                _share(c, [probes[i].outputs[c.key] for i in range(b)], b)
            else:
                _refuse(c, seen[c.key], b, dependent is None)
    # after the refusals of mixing: where the examples mix, the batch's gradient may hold the
    # rounding of a sum the single examples' losses cancel exactly
    for c in calls:
        if c.key in live and not seen[c.key].reached:
            raise TraceExportError(
                f"{c.where}: its output ({list(c.out_shape)}) receives a gradient from the batch but from none of "
                f"the {len(probes)} examples' losses alone; the batch axis of this use cannot be found")
        if c.grad is None:
            c.grad = batch_grads[c.key]
    for k, s in enumerate(seen_in):
        if s.spill is None:
            continue
        i, others = s.spill
        name = inputs.names[k]
        apart = [a for a in s.fits() if a != 0]
        if len(apart) == 1:
            raise TraceExportError(
                f"{name}: the loss of each example alone reaches it along axis {apart[0]} only, not axis 0: its "
                f"examples lie along axis {apart[0]}. The JAX exporter takes the examples on axis 0 of every input "
                "array: pass the batch with the examples first (transpose seq-first data)")
        use = first_mixed_use(others[0])
        at = (f"; they reach the input of {use.where} at examples other than their own, so the mixing is in the "
              "computation before it" if use is not None else
              "; no modelled module's input shows it, so the mixing is outside them (in per_example_loss, or an op "
              "after the last modelled module)")
        raise TraceExportError(
            f"the model mixes examples: the loss of example {i} alone depends on {name} of example(s) "
            f"{_shown(others)} (along axis 0){at}. Example {i}'s gradient then changes with the other examples of "
            "the batch (batch statistics, such as BatchNorm with use_running_average=False or x - x.mean(0), or "
            "attention across the batch), so per-example clipping bounds nothing: no per-example norm is defined")


def _refuse(c: Call, seen: Seen, b: int, untold: bool) -> None:
    shape = list(c.out_shape)
    fits = [a for a in seen.fits() if a != seen.axis]
    if untold:
        raise TraceExportError(
            f"{c.where}: every example's loss reaches its output ({shape}) outside its own slice of axis "
            f"{seen.axis}, and "
            "the forward could not be followed under jax.vmap (it reads values of the batch into Python), so "
            "whether this use is shared by every example (computed from none of them) or mixes them cannot be "
            "told. Compute it with jax operations, or give it a per-example input")
    if len(fits) == 1:
        a = fits[0]
        raise TraceExportError(
            f"{c.where}: the loss of each example alone reaches its output ({shape}) along axis {a} only, not "
            f"axis {seen.axis}: the examples of this use lie along axis {a}. The JAX exporter takes the examples "
            f"on axis 0 of every modelled module's input (axis {seen.axis} of this output); keep the batch first "
            "(batch-first layers, not a transposed or seq-first layout)")
    if seen.spill is None:
        raise TraceExportError(
            f"the model mixes examples: {c.where} computes its output ({shape}) from the batch's examples "
            f"together, with no axis of the batch's {b} examples to keep them apart, and the examples' losses "
            "reach it (a mean or other reduction over the batch). Per-example clipping bounds nothing where an "
            "example's gradient depends on the others: no per-example norm is defined")
    i, others = seen.spill
    raise TraceExportError(
        f"the model mixes examples: the loss of example {i} alone sends gradient into the output of {c.where} "
        f"({shape}) at example(s) {_shown(others)} along axis {seen.axis}, and no axis of that output keeps the "
        "examples "
        f"apart. Example {i}'s gradient then depends on the other examples of the batch (statistics or attention "
        "across the batch: BatchNorm with use_running_average=False, x - x.mean(0), attention over the batch "
        "axis), so per-example clipping bounds nothing and no per-example norm is defined")


def _share(c: Call, grads: list[np.ndarray], b: int) -> None:
    """Makes a use shared by every example one whose examples lie along axis 0 of its factors:
    its output gradient the per-example gradients ∂L_i/∂out, stacked, and its input arrays the
    one input repeated for every example. Where the output and every input array have a leading
    axis of 1 (a 1×T lookup), the examples take its place, so the use keeps the rank its handler
    models; otherwise they come first as a new axis."""
    stacked = np.stack(grads)
    arrays = [a for a in c.args if isinstance(a, np.ndarray)]
    if len(c.out_shape) >= 1 and c.out_shape[0] == 1 and all(a.ndim >= 1 and a.shape[0] == 1 for a in arrays):
        stacked = stacked[:, 0]

        def repeat(a: np.ndarray) -> np.ndarray:
            return np.broadcast_to(a, (b, *a.shape[1:]))
    else:
        def repeat(a: np.ndarray) -> np.ndarray:
            return np.broadcast_to(a[None], (b, *a.shape))
    c.args = tuple(repeat(a) if isinstance(a, np.ndarray) else a for a in c.args)
    c.grad = stacked
    c.out_shape = tuple(stacked.shape)
    c.shared = True


def lifted(value: Any) -> bool:
    """Whether an input leaf takes part in the provenance pass (an array: vmapped over a new
    leading axis)."""
    return hasattr(value, "shape") and hasattr(value, "dtype")


__all__ = ["PROBE_ALL_UP_TO", "PROBE_AT_LEAST", "PROBE_SEED", "Inputs", "Probe", "check_examples", "lifted",
           "probe_order"]
