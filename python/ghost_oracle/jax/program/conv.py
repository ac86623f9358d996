"""`conv_general_dilated` with the kernel a parameter: a linear map over unfolded patches, one
row per output position (the batch and spatial axes), a `conv1d` site (in×out) whose `in` is the
patch in `conv_general_dilated_patches`' order (the input's channel, then the window's axes in
the kernel's order), so the kernel's view is read as (I, window…, O). Grouped convolutions and
a parameter as the convolved input are refused."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..sites import precision_of
from .layout import resolve
from .values import Use, Val, Walking, bind, move_last, refuse, rows_mapper


def use(w: Walking, eqn: object, vals: list[Val], where: str) -> list[Val]:

    params = eqn.params  # type: ignore[attr-defined]
    lhs, rhs = vals
    if lhs.view is not None:
        raise refuse(w.name(lhs.view.leaf), "conv_general_dilated", where,
                     "the parameter is the convolved input, not the kernel" +
                     (f" (and `{w.name(rhs.view.leaf)}` the kernel)" if rhs.view is not None else ""))
    assert rhs.view is not None
    if params["feature_group_count"] != 1 or params["batch_group_count"] != 1:
        raise refuse(w.name(rhs.view.leaf), "conv_general_dilated", where,
                     "a grouped convolution (feature_group_count or batch_group_count > 1)")
    dn = params["dimension_numbers"]
    rhs_spec, out_spec = dn.rhs_spec, dn.out_spec
    k_shape = np.shape(rhs.value)
    window = [int(k_shape[d]) for d in rhs_spec[2:]]
    c_in, c_out = int(k_shape[rhs_spec[1]]), int(k_shape[rhs_spec[0]])
    dtype = rhs.value.dtype
    patches = lax.conv_general_dilated_patches(
        jnp.asarray(lhs.value).astype(dtype), window, params["window_strides"], params["padding"],
        lhs_dilation=params["lhs_dilation"], rhs_dilation=params["rhs_dilation"], dimension_numbers=dn,
        precision=lax.Precision.HIGHEST)
    width = c_in * int(np.prod(window))
    layer, perm = resolve(w, rhs.view.leaf, np.transpose(rhs.view.index, (rhs_spec[1], *rhs_spec[2:], rhs_spec[0])),
                          "conv_general_dilated", where)
    out = bind(eqn, [lhs.value, rhs.value])[0]
    axes = move_last(len(np.shape(out)), [out_spec[1]])
    acts = jnp.transpose(patches, axes).reshape(-1, width)
    site = Use(kind="conv1d", leaf=rhs.view.leaf, layer=layer, perm=perm, precision=precision_of(dtype, where),
               where=where, rows_of=rows_mapper(axes, c_out))
    return [Val.plain(w.site(site, out, {"activations": acts}))]
