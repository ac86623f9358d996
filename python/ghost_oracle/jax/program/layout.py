"""Layout-only steps of a parameter (reshape, transpose, broadcast, convert, squeeze, slicing,
a constant index of a stacked axis, copy) and where a use's entries lie in the parameter
(`resolve`): the whole leaf, or one layer of a leaf stacked on its first axis, named `name[l]`
as the linen route names the layers of `nn.scan` (each layer a parameter of its own)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from .values import Val, View, refuse

if TYPE_CHECKING:
    from .interpreter import Walker

#: Primitives that move, repeat or select a parameter's entries without computing with them
#: (convert and reduce_precision round them, which is the precision the use computes in).
LAYOUT = frozenset({"reshape", "transpose", "broadcast_in_dim", "convert_element_type", "squeeze", "slice",
                    "dynamic_slice", "gather", "copy", "copy_p", "reduce_precision", "rev", "expand_dims"})
#: Those whose value is the view's entries unchanged in place (the index is carried as it is).
_SAME_PLACES = frozenset({"convert_element_type", "copy", "copy_p", "reduce_precision"})


def step(w: Walker, eqn: object, vals: list[Val], where: str) -> list[Val]:
    """A layout step of a view (operand 0), its other operands (slice starts, gather indices)
    constant; a slice or gather at indices computed from the data is a lookup (`gather.py`)."""
    from . import gather
    from .interpreter import bind

    name = eqn.primitive.name  # type: ignore[attr-defined]
    head, rest = vals[0], vals[1:]
    if head.view is None or any(v.status != "const" for v in rest):
        if name in ("gather", "dynamic_slice") and head.view is not None:
            return gather.use(w, eqn, vals, where)
        view = next(v.view for v in vals if v.view is not None)
        raise refuse(w.name(view.leaf), name, where, "a parameter used as the indices of a lookup or slice")
    out = bind(eqn, [v.value for v in vals])[0]
    if name in _SAME_PLACES:
        index = head.view.index
    else:
        with jax.ensure_compile_time_eval():
            moved = bind(eqn, [jnp.asarray(head.view.index, dtype=jnp.int32), *(v.value for v in rest)])[0]
        index = np.asarray(moved).astype(np.int64)
    return [Val(out, "view", View(head.view.leaf, index))]


def is_permutation(t: np.ndarray, n: int) -> bool:
    if t.size != n or n == 0:
        return t.size == n
    if t.min() < 0 or t.max() >= n:
        return False
    return bool((np.bincount(t, minlength=n) == 1).all())


def resolve(w: Walker, leaf: int, flat: np.ndarray, primitive: str, where: str) -> tuple[int | None, np.ndarray]:
    """(layer, perm): the use's entries `flat` (positions in the leaf, in the site's layout
    order) as a permutation of the whole leaf (layer None) or of one layer of it (positions
    relative to the layer's start). Anything else (a part of a parameter, an entry used twice)
    is refused: a site covers its parameter whole."""
    shape = w.leaf_shapes[leaf]
    size = int(np.prod(shape))
    t = flat.reshape(-1).astype(np.int64)
    if is_permutation(t, size):
        return None, t
    if len(shape) >= 2 and shape[0] > 1 and t.size == size // shape[0] and t.size:
        per_layer = size // shape[0]
        layer = int(t.min()) // per_layer
        rel = t - layer * per_layer
        if is_permutation(rel, per_layer):
            return layer, rel
    raise refuse(w.name(leaf), primitive, where,
                 f"the use reaches {t.size} entries of the parameter's {size} ({np.unique(t).size} distinct), not the "
                 "whole parameter nor one layer of it stacked on its first axis; a site covers a parameter whole")


def is_identity(perm: np.ndarray) -> bool:
    return bool(np.array_equal(perm, np.arange(perm.size)))
