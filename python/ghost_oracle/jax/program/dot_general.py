"""`dot_general` with a parameter as one operand (a dense layer, an einsum, an attention
projection, a tied head `x @ E.T`): the gradient of the parameter's view is Σ_r a_r δ_rᵀ over
the rows, the other operand's free axes. The site is `conv1d` (in×out, the parameter's
contracted entries first) where that is the parameter's own flattened layout, else `linear`
(out×in), in the parameter's own order where that matches, else through the permutation that
brings it there. Batch dimensions (a parameter mapped over by `vmap`) are refused: each position
would have its own weight."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..._trace.site import SiteKind
from ..sites import precision_of
from .layout import resolve
from .values import Use, Val, Walking, bind, refuse, rows_mapper


def use(w: Walking, eqn: object, vals: list[Val], where: str) -> list[Val]:

    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]  # type: ignore[attr-defined]
    lhs, rhs = vals
    if lhs.view is not None and rhs.view is not None:
        raise refuse(w.name(lhs.view.leaf), "dot_general", where,
                     f"a product of two parameter uses (with `{w.name(rhs.view.leaf)}`): its gradient is not linear "
                     "in one example's activations")
    p_is_lhs = lhs.view is not None
    p, x = (lhs, rhs) if p_is_lhs else (rhs, lhs)
    assert p.view is not None
    p_contract, x_contract = (list(lc), list(rc)) if p_is_lhs else (list(rc), list(lc))
    p_batch = lb if p_is_lhs else rb
    if len(p_batch):
        raise refuse(w.name(p.view.leaf), "dot_general", where,
                     f"batch dimensions {list(p_batch)} on the parameter's side (the parameter mapped over by vmap: a "
                     "weight of its own for each position), which no site kind expresses")
    pairs = sorted(zip(p_contract, x_contract, strict=True))
    pc = [a for a, _ in pairs]
    xc = [b for _, b in pairs]
    p_shape = np.shape(p.value)
    x_ndim = np.ndim(x.value)
    p_free = [d for d in range(len(p_shape)) if d not in pc]
    x_free = [d for d in range(x_ndim) if d not in xc]
    n_in = int(np.prod([p_shape[d] for d in pc]))
    n_out = int(np.prod([p_shape[d] for d in p_free]))
    index = p.view.index
    layer, perm = resolve(w, p.view.leaf, np.transpose(index, pc + p_free), "dot_general", where)
    kind: SiteKind = "conv1d"
    if perm is not None:
        layer, perm = resolve(w, p.view.leaf, np.transpose(index, p_free + pc), "dot_general", where)
        kind = "linear"
    dtype = p.value.dtype
    acts = jnp.transpose(jnp.asarray(x.value), x_free + xc).reshape(-1, n_in).astype(dtype)
    out = bind(eqn, [lhs.value, rhs.value])[0]
    nxf, npf = len(x_free), len(p_free)
    axes = tuple(range(npf, npf + nxf)) + tuple(range(npf)) if p_is_lhs else tuple(range(nxf + npf))
    site = Use(kind=kind, leaf=p.view.leaf, layer=layer, perm=perm, precision=precision_of(dtype, where),
               where=where, rows_of=rows_mapper(axes, n_out))
    return [Val.plain(w.site(site, out, {"activations": acts}))]
