"""`nn.scan` over layers, for the capture: Flax's scan primitive (`flax.core.axes_scan.scan`,
which `flax.core.lift.scan` reads when a scan runs) is replaced by `layer_loop`, which runs the
scan's body once per layer in a Python loop, as `jax.lax.scan` itself does under
`jax.disable_jit()`, with the same slices of the stacked variables and inputs. Each layer's calls
are then ordinary calls with concrete inputs; the recorder tags each with its layer (`Layer`),
and the stacked parameter `layers.attn.q.kernel` (L×…) is written as the L parameters
`layers.attn.q.kernel[l]` (`split_layers`, for the batch gradient and the claimed step). A scan
the loop cannot replay exactly (its parameters broadcast or carried rather than stacked on axis
0, outputs broadcast out of the body) is refused by name (`scan_refusal`). The replacement is
process-wide while a capture runs."""
from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import axes_scan

from .._trace.format import TraceExportError

_LAYER = re.compile(r"\[\d+\]$")


@dataclass
class Layer:
    """One iteration of a replayed nn.scan: its layer index, the scan's length, the path of the
    scanned module (known at its first call) and, for a scan that cannot be replayed, why."""

    index: int
    length: int
    refusal: str | None = None
    prefix: tuple[str, ...] | None = None



def scan_refusal(broadcast_in: Any, carry: Any, args: tuple[Any, ...], in_axes: Any, out_axes: Any) -> str | None:
    """Why a Flax scan cannot be replayed layer by layer as stacked parameters, or None. The
    arguments are those `flax.core.lift.scan` passes to `axes_scan.scan`: the broadcast
    variables, (carried variables, carry), and (scanned variable groups, rngs, xs) with their
    axes."""
    if len(args) != 3 or not isinstance(in_axes, tuple) or len(in_axes) != 3:
        return "body is not the (variables, rngs, xs) one flax.core.lift.scan builds"

    def holds_params(group: Any) -> bool:  # a group: a tuple of {collection: variables}, one per scope
        if isinstance(group, Mapping):
            return bool(jax.tree_util.tree_leaves(group.get("params", {})))
        return isinstance(group, (tuple, list)) and any(holds_params(g) for g in group)

    if holds_params(broadcast_in):
        return "parameters are broadcast to every layer (variable_broadcast holds 'params')"
    if isinstance(carry, tuple) and carry and holds_params(carry[0]):
        return "parameters are carried from layer to layer (variable_carry holds 'params')"
    groups, _, _ = args
    for group, axis in zip(groups, in_axes[0], strict=True):
        if holds_params(group) and axis != 0:
            return f"parameters are stacked on axis {axis} (variable_axes={{'params': {axis}}}), not 0"
    if any(a is axes_scan.broadcast for a in jax.tree_util.tree_leaves(out_axes)):
        return "outputs are broadcast out of the body (out_axes=nn.broadcast)"
    return None


def layer_loop(layers: list[Layer]) -> Callable[..., Callable[..., Any]]:
    """`axes_scan.scan`'s signature, running the body once per layer in a Python loop: the
    iteration `jax.lax.scan` runs under `jax.disable_jit()` (the same `index_in_dim` slices,
    stacked on the scan axis after), without the partial evaluation Flax runs first to find
    broadcast outputs, which the loop refuses."""
    def scan(fn: Callable[..., Any], in_axes: Any, out_axes: Any, length: int | None = None, reverse: bool = False,
             unroll: int = 1, _split_transpose: bool = False, check_constancy_invariants: bool = True
             ) -> Callable[..., Any]:
        def loop(broadcast_in: Any, init: Any, *args: Any) -> Any:
            refusal = scan_refusal(broadcast_in, init, args, in_axes, out_axes)

            def sizes(ax: Any, arg: Any) -> list[int]:
                if ax is axes_scan.broadcast:
                    return []
                return [int(x.shape[ax]) for x in jax.tree_util.tree_leaves(arg)]

            found = set(itertools.chain.from_iterable(
                jax.tree_util.tree_leaves(jax.tree_util.tree_map(sizes, in_axes, args),
                                          is_leaf=lambda x: isinstance(x, list))))
            n = length if length is not None else (found.pop() if len(found) == 1 else None)
            if n is None or n < 1:
                raise TraceExportError(f"an nn.scan of length {n} (scanned axes of sizes {sorted(found)}): the "
                                       "exporter replays scans of one known positive length")

            def take(i: int) -> Any:
                return jax.tree_util.tree_map(
                    lambda ax, arg: arg if ax is axes_scan.broadcast else jax.tree_util.tree_map(
                        lambda x: jax.lax.index_in_dim(x, i, ax, keepdims=False), arg), in_axes, args)

            carry = init
            ys = []
            order = range(n - 1, -1, -1) if reverse else range(n)
            for i in order:
                layers.append(Layer(index=i, length=n, refusal=refusal))
                try:
                    _, carry, y = fn(broadcast_in, carry, *take(i))
                finally:
                    layer = layers.pop()
                if layer.prefix is None and refusal is not None:
                    raise TraceExportError(f"an nn.scan whose {refusal}: refused")
                ys.append(y)
            if reverse:
                ys.reverse()
            stacked = jax.tree_util.tree_map(
                lambda ax, *per_layer: jax.tree_util.tree_map(lambda *xs: jnp.stack(xs, axis=ax), *per_layer),
                out_axes, *ys)
            return broadcast_in, carry, stacked

        return loop

    return scan


@contextmanager
def scans_as_loops(layers: list[Layer]) -> Iterator[None]:
    """`flax.core.lift.scan` reads `axes_scan.scan` when the scan runs: replaced for the capture."""
    original = axes_scan.scan
    axes_scan.scan = layer_loop(layers)
    try:
        yield
    finally:
        axes_scan.scan = original


def layer_name(name: str, layer: tuple[int, ...]) -> str:
    """Layer l of the stacked parameter `name`: `name[l]` (`name[l][m]` for a scan in a scan)."""
    return name + "".join(f"[{i}]" for i in layer)


def split_layers(flat: Mapping[str, Any], scans: Mapping[tuple[str, ...], int], what: str) -> dict[str, Any]:
    """`flat` ({name: array}) with each parameter stacked by nn.scan split into its layers
    (`name[l]` for each l, the slice on the leading axis); the others as they are."""
    out: dict[str, Any] = {}
    for name, value in flat.items():
        outer = sorted((p for p in scans if name.startswith(".".join(p) + ".")), key=len)
        if not outer or _LAYER.search(name):  # none stacked, or one layer given already
            out[name] = value
            continue
        lengths = tuple(scans[p] for p in outer)
        arr = value if hasattr(value, "shape") else np.asarray(value)
        if tuple(arr.shape[:len(lengths)]) != lengths:
            raise ValueError(f"{what}: the array for `{name}` has shape {list(arr.shape)}; the parameter is stacked "
                             f"by nn.scan over {' × '.join(map(str, lengths))} layers, on its leading axes")
        for index in itertools.product(*(range(n) for n in lengths)):
            out[layer_name(name, index)] = arr[index]
    return out
