"""Parameters named by their pytree key path, entries joined with '.' (DictKey → its key,
GetAttrKey → its name, SequenceKey/FlattenedIndexKey → its index: `embed.embedding`,
`layers.0.w`); a leaf stacked on its first axis whose uses are per layer is written as its
layers, `name[l]`. Claimed step tensors are read from a pytree shaped like the parameters or a
dict keyed by those names (a stacked leaf whole, or by its layers' names)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np

from ..._trace.format import TraceExportError

STEP_DTYPES = (np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def key_name(entry: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def path_name(path: Sequence[Any]) -> str:
    return ".".join(key_name(e) for e in path)


def named_leaves(tree: Any, what: str) -> dict[str, Any]:
    """{name: leaf} of a pytree, in its flattening order; duplicate names refused."""
    out: dict[str, Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = path_name(path)
        if name in out:
            raise ValueError(f"{what}: two leaves are both named `{name}` by their key paths joined with '.'; give "
                             "the pytree keys that do not collide")
        out[name] = leaf
    return out


def param_name(leaf_name: str, layer: int | None) -> str:
    return leaf_name if layer is None else f"{leaf_name}[{layer}]"


def step_tensors(what: str, given: Any, leaf_names: Sequence[str], stacked: Mapping[str, int],
                 parameters: Mapping[str, int], perms: Mapping[str, np.ndarray | None]) -> dict[str, np.ndarray]:
    """`what`'s tensor of every parameter of the manifest, in its order, flattened in the layout
    its sites write (`perms`): from a pytree like the parameters or a dict keyed by names."""
    try:
        flat = named_leaves(given, what)
    except TypeError as e:
        raise TypeError(f"{what} must be a pytree shaped like params or a dict keyed by parameter names") from e
    if "" in flat:
        raise TypeError(f"{what} must be a pytree shaped like params or a dict keyed by parameter names, got a bare "
                        f"{type(flat['']).__name__}")
    out: dict[str, np.ndarray] = {}
    for key, value in flat.items():
        arr = np.asarray(value)
        if arr.dtype not in STEP_DTYPES:
            raise ValueError(f"{what}: the array for parameter `{key}` has dtype {arr.dtype}; the trace stores "
                             "float64, float32, float16 and bfloat16")
        if key in stacked:
            layers = stacked[key]
            if arr.ndim == 0 or arr.shape[0] != layers:
                raise ValueError(f"{what}: the array for `{key}` has shape {list(arr.shape)}; the parameter is "
                                 f"stacked, {layers} layers on its first axis")
            parts = {param_name(key, layer): arr[layer] for layer in range(layers)}
        else:
            parts = {key: arr}
        for name, part in parts.items():
            if name not in parameters:
                if name in leaf_names or name.split("[")[0] in leaf_names:
                    continue  # a parameter left out of the trace (no gradient)
                near = ", ".join(f"`{n}`" for n in list(parameters)[:6])
                raise ValueError(f"{what}: `{name}` is not a parameter of the trace (its parameters are named like "
                                 f"{near}, ...)")
            if part.size != parameters[name]:
                raise ValueError(f"{what}: the array for parameter `{name}` has shape {list(part.shape)} "
                                 f"({part.size} elements); the parameter has {parameters[name]}")
            flat = part.reshape(-1)
            out[name] = np.ascontiguousarray(flat if perms[name] is None else flat[perms[name]])
    missing = [p for p in parameters if p not in out]
    if missing:
        raise ValueError(f"{what}: no array for parameter(s) {', '.join(f'`{m}`' for m in missing)}: it must cover "
                         "every trainable parameter of the trace, or be left out")
    return {p: out[p] for p in parameters}


def check_leaves(names: Sequence[str], leaves: Sequence[Any]) -> None:
    for name, leaf in zip(names, leaves, strict=True):
        dtype = np.dtype(getattr(leaf, "dtype", np.asarray(leaf).dtype))
        if dtype not in STEP_DTYPES:
            raise TraceExportError(f"params: leaf `{name}` is {dtype}; the program route differentiates every leaf of "
                                   "params (as clipped_grad does): pass only the trainable floating-point parameters")
