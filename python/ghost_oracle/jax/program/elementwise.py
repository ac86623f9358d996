"""Elementwise uses of a broadcast parameter: a scale `x ⊙ w` (a norm's gain, also `x̂ ⊙ (1 + w)`:
a shift of the parameter by a constant is followed as a view, and the factor is x̂ either way)
is a `layernorm` site Σ_r δ_r ⊙ x_r; a shift `x + b` (or `b - x`) a `bias` site Σ_r δ_r. The
features are the output's axes along which the parameter's entries change, the rows every
other axis (along which it is broadcast). `x - b` and `c - w` negate the parameter: refused."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..._trace.site import SiteKind
from ..sites import precision_of
from .layout import resolve
from .values import Use, Val, View, Walking, bind, move_last, refuse, rows_mapper

ELEMENTWISE = frozenset({"mul", "add", "sub", "add_any"})


def feature_axes(index: np.ndarray) -> list[int]:
    """The axes along which the parameter's entries change (the others repeat one entry)."""
    return [d for d in range(index.ndim)  # a broadcast axis (stride 0) repeats one entry: not compared
            if index.shape[d] > 1 and index.strides[d] != 0
            and not bool((index == np.take(index, [0], axis=d)).all())]


def use(w: Walking, eqn: object, vals: list[Val], where: str) -> list[Val]:

    name = eqn.primitive.name  # type: ignore[attr-defined]
    a, b = vals
    if a.view is not None and b.view is not None:
        what = "a product" if name == "mul" else "a sum"
        raise refuse(w.name(a.view.leaf), name, where,
                     f"{what} of two parameter uses (with `{w.name(b.view.leaf)}`, or the parameter itself: squared)")
    p_first = a.view is not None
    p, other = (a, b) if p_first else (b, a)
    assert p.view is not None
    out = bind(eqn, [a.value, b.value])[0]
    out_shape = tuple(np.shape(out))
    index = np.broadcast_to(p.view.index, out_shape)
    if name == "sub" and not p_first:
        raise refuse(w.name(p.view.leaf), name, where, "the parameter is subtracted (negated); the program route "
                     "models a scale or a shift by the parameter itself")
    if name != "mul" and other.status == "const":
        # w + c: still the parameter, shifted by a constant (the (1 + w) of a norm's gain)
        return [Val(out, "view", View(p.view.leaf, index))]
    features = feature_axes(index)
    at_first_row = tuple(slice(None) if d in features else 0 for d in range(len(out_shape)))
    entries = index[at_first_row]
    layer, perm = resolve(w, p.view.leaf, entries, name, where)
    width = int(entries.size)
    axes = move_last(len(out_shape), features)
    dtype = out.dtype
    kind: SiteKind
    if name == "mul":
        kind = "layernorm"
        scaled = jnp.broadcast_to(jnp.asarray(other.value), out_shape)
        recorded = {"activations": jnp.transpose(scaled, axes).reshape(-1, width).astype(dtype)}
    else:
        kind = "bias"
        recorded = {}
    site = Use(kind=kind, leaf=p.view.leaf, layer=layer, perm=perm, precision=precision_of(dtype, where),
               where=where, rows_of=rows_mapper(axes, width))
    return [Val.plain(w.site(site, out, recorded))]
