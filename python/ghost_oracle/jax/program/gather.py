"""Lookups of rows of a 2-D table (an embedding, padding ids included): `gather` with the rows'
ids computed from the example (`E[ids]`, `jnp.take(E, ids, axis=0)`, and the same under `vmap`,
where a scalar lookup becomes a gather of the table's rows), or `dynamic_slice` of one row at
an id. An `embedding` site: ids B×R, backprops B×R×d. The ids are checked to lie in the table
after the walk (`ids_in_table`), clamped where the gather clamps them."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..._trace.format import TraceExportError
from ..sites import precision_of
from .layout import resolve
from .values import Use, Val, Walking, bind, refuse, rows_mapper


def _table(w: Walking, val: Val, primitive: str, where: str) -> tuple[int, int]:
    assert val.view is not None
    shape = np.shape(val.value)
    if len(shape) != 2:
        raise refuse(w.name(val.view.leaf), primitive, where,
                     f"a lookup in a {len(shape)}-D view of shape {list(shape)}; the embedding kind looks up rows of "
                     "a 2-D table")
    return int(shape[0]), int(shape[1])


def use(w: Walking, eqn: object, vals: list[Val], where: str) -> list[Val]:

    name = eqn.primitive.name  # type: ignore[attr-defined]
    params = eqn.params  # type: ignore[attr-defined]
    table = vals[0]
    if table.view is None or any(v.view is not None for v in vals[1:]):
        view = next(v.view for v in vals if v.view is not None)
        raise refuse(w.name(view.leaf), name, where, "a parameter used as the indices of a lookup")
    v_rows, d = _table(w, table, name, where)
    out = bind(eqn, [v.value for v in vals])[0]
    layer, perm = resolve(w, table.view.leaf, table.view.index, name, where)
    out_ndim = len(np.shape(out))
    recorded: dict[str, jnp.ndarray] = {}
    if name == "dynamic_slice":
        if tuple(params["slice_sizes"]) != (1, d):
            raise refuse(w.name(table.view.leaf), name, where,
                         f"a slice of sizes {list(params['slice_sizes'])} at a data-dependent start; a lookup takes "
                         f"one whole row (sizes [1, {d}])")
        ids = jnp.clip(jnp.asarray(vals[1].value), 0, v_rows - 1).reshape(1)  # dynamic_slice clamps its start
        clip = True
        feature_axis = 1
    else:
        dn = params["dimension_numbers"]
        sizes = tuple(params["slice_sizes"])
        if (dn.operand_batching_dims or dn.start_indices_batching_dims or sizes != (1, d)
                or dn.start_index_map[:1] != (0,) or dn.offset_dims[-1:] != (out_ndim - 1,)
                or (1 in dn.collapsed_slice_dims)):
            raise refuse(w.name(table.view.leaf), name, where,
                         f"a gather of slices {list(sizes)} with {dn}; the embedding kind takes whole rows of the "
                         "table, one id each")
        indices = jnp.asarray(vals[1].value)
        ids = indices[..., 0].reshape(-1)
        mode = str(params.get("mode", ""))
        clip = "CLIP" in mode.upper()
        if len(dn.start_index_map) == 2:  # a row and a column start: the column's must be 0 (d of d)
            recorded["columns"] = indices[..., 1].reshape(-1)
        feature_axis = out_ndim - 1
    axes = tuple(a for a in range(out_ndim) if a != feature_axis) + (feature_axis,)
    site = Use(kind="embedding", leaf=table.view.leaf, layer=layer, perm=perm,
               precision=precision_of(table.value.dtype, where), where=where, rows_of=rows_mapper(axes, d),
               vocab=v_rows, clip_ids=clip)
    recorded["ids"] = ids
    return [Val.plain(w.site(site, out, recorded))]


def ids_in_table(name: str, use: Use, ids: np.ndarray, columns: np.ndarray | None) -> np.ndarray:
    """The use's ids (B×R) as the trace holds them: clamped where the lookup clamps, otherwise
    refused by name where one lies outside the table (its row would be a fill value, not a row)."""
    assert use.vocab is not None
    if columns is not None and np.any(columns != 0) and not use.clip_ids:
        raise TraceExportError(f"parameter `{name}` looked up by {use.where}: a column start other than 0 is out of "
                               "the table's row")
    if use.clip_ids:
        return np.asarray(np.clip(ids, 0, use.vocab - 1))
    bad = (ids < 0) | (ids >= use.vocab)
    if bad.any():
        first = int(ids[bad].reshape(-1)[0])
        raise TraceExportError(f"parameter `{name}` looked up by {use.where}: id {first} lies outside its "
                               f"{use.vocab} rows (the lookup's mode fills or is undefined there)")
    return ids
