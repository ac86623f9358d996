"""Layout-only steps of a parameter (reshape, transpose, broadcast, convert, squeeze, slicing,
a constant index of a stacked axis, copy) and where a use's entries lie in the parameter
(`resolve`): the whole leaf, or one layer of a leaf stacked on its first axis, named `name[l]`
as the linen route names the layers of `nn.scan` (each layer a parameter of its own)."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .values import Val, View, Walking, bind, refuse

#: Primitives that move, repeat or select a parameter's entries without computing with them
#: (convert and reduce_precision round them, which is the precision the use computes in).
LAYOUT = frozenset({"reshape", "transpose", "broadcast_in_dim", "convert_element_type", "squeeze", "slice",
                    "dynamic_slice", "gather", "copy", "copy_p", "reduce_precision", "rev", "expand_dims"})
#: Those whose value is the view's entries unchanged in place (the index is carried as it is).
_SAME_PLACES = frozenset({"convert_element_type", "copy", "copy_p", "reduce_precision"})


def _numpy_step(name: str, params: dict[str, Any], index: np.ndarray, rest: list[Val]) -> np.ndarray | None:
    """The layout step on the index array in numpy, a view of it (no copy) wherever numpy can:
    a parameter's index is then a view of its leaf's `arange`, which `resolve` reads without
    materializing it. None: a step numpy does not take here (a gather at constant indices)."""
    if name in _SAME_PLACES:
        return index
    if name == "reshape":
        return index.reshape(tuple(params["new_sizes"]))
    if name == "transpose":
        return np.transpose(index, tuple(params["permutation"]))
    if name == "broadcast_in_dim":
        shape = tuple(params["shape"])
        placed = [1] * len(shape)
        for i, d in enumerate(params["broadcast_dimensions"]):
            placed[d] = index.shape[i]
        return np.broadcast_to(index.reshape(placed), shape)
    if name == "squeeze":
        return np.squeeze(index, axis=tuple(params["dimensions"]))
    if name == "expand_dims":
        return np.expand_dims(index, tuple(params["dimensions"]))
    if name == "rev":
        return np.flip(index, tuple(params["dimensions"]))
    if name == "slice":
        strides = params.get("strides") or (1,) * index.ndim
        return index[tuple(slice(a, b, c) for a, b, c in
                           zip(params["start_indices"], params["limit_indices"], strides, strict=True))]
    if name == "dynamic_slice":
        sizes = tuple(params["slice_sizes"])
        # dynamic_slice clamps each start so that the slice lies inside the operand
        starts = [min(max(int(np.asarray(v.value)), 0), n - k)
                  for v, n, k in zip(rest, index.shape, sizes, strict=True)]
        return index[tuple(slice(a, a + k) for a, k in zip(starts, sizes, strict=True))]
    return None


def is_lookup(eqn: Any, vals: list[Val]) -> bool:
    """A slice or gather of a parameter's view at indices computed from the data: a lookup
    (`gather.py`), not a layout step."""
    return (eqn.primitive.name in ("gather", "dynamic_slice") and vals[0].view is not None
            and any(v.status != "const" for v in vals[1:]))


def step(w: Walking, eqn: Any, vals: list[Val], where: str) -> list[Val]:
    """A layout step of a view (operand 0), its other operands (slice starts, gather indices)
    constant; a slice or gather at indices computed from the data is a lookup (`is_lookup`,
    `gather.py`), dispatched there before this is called."""
    name = eqn.primitive.name
    head, rest = vals[0], vals[1:]
    if head.view is None or any(v.status != "const" for v in rest):
        view = next(v.view for v in vals if v.view is not None)
        raise refuse(w.name(view.leaf), name, where, "a parameter used as the indices of a lookup or slice")
    out = bind(eqn, [v.value for v in vals])[0]
    index = _numpy_step(name, eqn.params, head.view.index, rest)
    if index is None:
        with jax.ensure_compile_time_eval():
            moved = bind(eqn, [jnp.asarray(head.view.index), *(v.value for v in rest)])[0]
        index = np.asarray(moved)
    if tuple(index.shape) != tuple(np.shape(out)):
        raise refuse(w.name(head.view.leaf), name, where, f"a layout step whose index came out {list(index.shape)} "
                     f"for an output {list(np.shape(out))}")
    return [Val(out, "view", View(head.view.leaf, index))]


def is_permutation(t: np.ndarray, n: int) -> bool:
    if t.size != n or n == 0:
        return t.size == n
    if t.min() < 0 or t.max() >= n:
        return False
    return bool((np.bincount(t, minlength=n) == 1).all())


def resolve(w: Walking, leaf: int, entries: np.ndarray, primitive: str,
            where: str) -> tuple[int | None, np.ndarray | None]:
    """(layer, perm): the use's entries (positions in the leaf, in the site's layout order) as a
    permutation of the whole leaf (layer None) or of one layer of it stacked on its first axis
    (positions relative to the layer's start); perm None where it is the identity. Anything
    else (a part of a parameter, an entry used twice) is refused: a site covers its parameter
    whole. An index still a contiguous view of the leaf's `arange` is read off its first entry,
    without a copy (a 262144-row table's uses cost nothing here)."""
    shape = w.leaf_shapes[leaf]
    size = int(np.prod(shape))
    layers = int(shape[0]) if len(shape) >= 2 and shape[0] > 1 else 0
    per_layer = size // layers if layers else 0
    if entries.size and entries.flags.c_contiguous and np.may_share_memory(entries, w.indices[leaf]):
        first = int(entries.reshape(-1)[0])
        if entries.size == size and first == 0:
            return None, None
        if layers and entries.size == per_layer and first % per_layer == 0:
            return first // per_layer, None
    if entries.size == size and np.may_share_memory(entries, w.indices[leaf]) and _without_overlap(entries):
        # a transposed view of the whole leaf's arange (the tied head's E.T, first tried in the
        # other layout): a permutation, and not the identity, which is C-contiguous and read
        # above; one copy of its order, with no int64 cast, bincount or arange beside it (for a
        # 262144-row table those cost 8 GB and half a minute)
        return None, entries.reshape(-1)
    t = entries.reshape(-1).astype(np.int64)
    if is_permutation(t, size):
        return None, (None if is_identity(t) else t)
    if layers and t.size == per_layer:
        layer = int(t.min()) // per_layer
        rel = t - layer * per_layer
        if is_permutation(rel, per_layer):
            return layer, (None if is_identity(rel) else rel)
    raise refuse(w.name(leaf), primitive, where,
                 f"the use reaches {t.size} entries of the parameter's {size} ({np.unique(t).size} distinct), not the "
                 "whole parameter nor one layer of it stacked on its first axis; a site covers a parameter whole")


def _without_overlap(view: np.ndarray) -> bool:
    """No two positions of `view` share an element: its axes (extent > 1), ordered by |stride|,
    each step past the whole extent of the ones below it. Sufficient, not necessary."""
    axes = sorted((abs(s), n) for s, n in zip(view.strides, view.shape, strict=True) if n > 1)
    reach = view.itemsize
    for stride, extent in axes:
        if stride < reach:
            return False
        reach = stride * extent
    return True


def is_identity(perm: np.ndarray) -> bool:
    return bool(np.array_equal(perm, np.arange(perm.size)))


def in_layout(a: np.ndarray, perm: np.ndarray | None) -> np.ndarray:
    """A parameter's own array (or its gradient) flattened in the layout its sites write."""
    flat = a.reshape(-1)
    return flat if perm is None else flat[perm]
