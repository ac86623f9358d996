"""The function jax_privacy clips, `fun(params, *args)`, as each example's own loss: the batched
arguments (`batch_argnums`) sliced to one example (`batch[i:i+1]` with `keep_batch_dim`, else
`batch[i]`), the others passed whole, as `clipped_grad` reads them. The per-example losses must
add up to the batch's: `fun` on the whole batch is checked to be their mean or sum
(`check_batch_loss`), since clipping each example's gradient assumes the examples independent."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from ..._trace.format import TraceExportError
from ..._trace.precision import unit_roundoff
from ..._trace.site import Precision
from ..sites import PRECISION_OF
from .naming import check_leaves, named_leaves


@dataclass
class Program:
    names: list[str]
    leaves: list[Any]
    treedef: Any
    batched: Any  # the batched arguments, a tuple, the examples on axis 0 of every leaf
    batch: int
    example_loss: Callable[[list[Any], Any], Any]  # (leaves, one example's batched arguments) -> scalar
    batch_loss: Callable[[], Any] | None  # fun on the whole batch (keep_batch_dim), for the check


def _positions(batch_argnums: object, batch: Any) -> tuple[tuple[Any, ...], tuple[int, ...]]:
    """(fun's arguments after params, the indices among them that are batched)."""
    if isinstance(batch_argnums, bool) or not isinstance(batch_argnums, int | tuple):
        raise TypeError(f"batch_argnums must be an int or a tuple of ints, got {batch_argnums!r}")
    if isinstance(batch_argnums, int):
        if batch_argnums != 1:
            raise ValueError(f"batch_argnums={batch_argnums}: with an int, `batch` is fun's argument 1 (fun(params, "
                             "batch)); give a tuple, batch_argnums=(1, 2, ...), with `batch` the tuple of fun's "
                             "arguments after params")
        return (batch,), (0,)
    if not batch_argnums or any(isinstance(i, bool) or not isinstance(i, int) or i < 1 for i in batch_argnums) \
            or len(set(batch_argnums)) != len(batch_argnums):
        raise ValueError(f"batch_argnums={batch_argnums!r}: distinct positions of fun's arguments, each ≥ 1 "
                         "(0 is params)")
    if not isinstance(batch, tuple | list):
        raise TypeError(f"batch_argnums={batch_argnums!r} (a tuple): `batch` must be the tuple of fun's arguments "
                        f"after params, got {type(batch).__name__}")
    if max(batch_argnums) > len(batch):
        raise ValueError(f"batch_argnums={batch_argnums!r}: `batch` holds {len(batch)} arguments (fun's arguments "
                         f"1..{len(batch)})")
    return tuple(batch), tuple(i - 1 for i in batch_argnums)


def build(fun: Callable[..., Any], params: Any, batch: Any, batch_argnums: object, keep_batch_dim: bool) -> Program:
    if not callable(fun):
        raise TypeError(f"fun must be callable (fun(params, batch) returning the loss), got {type(fun).__name__}")
    if not isinstance(keep_batch_dim, bool):
        raise TypeError(f"keep_batch_dim must be True or False, got {keep_batch_dim!r}")
    args, batched_at = _positions(batch_argnums, batch)
    named = named_leaves(params, "params")
    names = list(named)
    leaves = [jnp.asarray(v) for v in named.values()]
    check_leaves(names, leaves)
    if not leaves:
        raise TraceExportError("params holds no array: there is no parameter to trace")
    treedef = jax.tree_util.tree_structure(params)
    batched = tuple(args[i] for i in batched_at)
    sizes = {int(np.shape(x)[0]) for x in jax.tree_util.tree_leaves(batched) if np.ndim(x) >= 1}
    if any(np.ndim(x) == 0 for x in jax.tree_util.tree_leaves(batched)):
        raise ValueError("batch: a batched argument holds a scalar; every batched array has the examples on axis 0")
    if len(sizes) != 1:
        raise ValueError(f"batch: the batched arrays have {sorted(sizes) or 'no'} examples on axis 0; they must all "
                         "hold the same examples")
    b = sizes.pop()

    def call(leaf_values: list[Any], example: Any) -> Any:
        p = jax.tree_util.tree_unflatten(treedef, leaf_values)
        full = list(args)
        for i, x in zip(batched_at, example, strict=True):
            full[i] = jax.tree_util.tree_map(lambda a: a[None], x) if keep_batch_dim else x
        out = fun(p, *full)
        if not hasattr(out, "shape") or int(np.prod(out.shape)) != 1:
            raise TraceExportError(f"fun returned {type(out).__name__}"
                                   f"{'' if not hasattr(out, 'shape') else ' of shape ' + str(list(out.shape))} for "
                                   "one example; it must return the loss, one number (fun(params, batch) as "
                                   "clipped_grad differentiates it, without auxiliary outputs)")
        return jnp.reshape(out, ())

    def whole() -> Any:
        return fun(params, *args)

    return Program(names=names, leaves=leaves, treedef=treedef, batched=batched, batch=b, example_loss=call,
                   batch_loss=whole if keep_batch_dim else None)


def per_example_losses(prog: Program) -> np.ndarray:
    out = jax.jit(jax.vmap(prog.example_loss, in_axes=(None, 0)))(prog.leaves, prog.batched)
    return np.asarray(out)


def _precision(dtype: Any) -> Precision:
    return cast(Precision, PRECISION_OF.get(np.dtype(dtype).name, "f32"))


def _precisions(jaxpr: Any, found: set[Precision]) -> set[Precision]:
    """The precisions of every floating-point value the program computes, its sub-programs' too."""
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            dtype = getattr(v.aval, "dtype", None)
            if dtype is not None and np.dtype(dtype).name in PRECISION_OF:
                found.add(_precision(dtype))
        for param in eqn.params.values():
            for inner in param if isinstance(param, tuple | list) else (param,):
                if isinstance(inner, jcore.ClosedJaxpr):
                    _precisions(inner.jaxpr, found)
                elif isinstance(inner, jcore.Jaxpr):
                    _precisions(inner, found)
    return found


def check_batch_loss(prog: Program, losses: np.ndarray) -> None:
    """Refuses a fun whose loss of the whole batch is neither the mean nor the sum of its
    examples' own losses (an example's loss would depend on the others: batch statistics, a
    loss normalised over the batch)."""
    if prog.batch_loss is None:
        return
    whole = prog.batch_loss()
    if not hasattr(whole, "shape") or int(np.prod(whole.shape)) != 1:
        raise TraceExportError(f"fun(params, batch) returned {type(whole).__name__} of shape "
                               f"{list(getattr(whole, 'shape', []))}; it must return the batch's loss, one number")
    value = np.float64(np.asarray(whole).astype(np.float64).reshape(()))
    each = losses.astype(np.float64)
    # the coarsest precision the batch's loss is computed in, wherever in the program (Keras 3
    # averages in f32 under x64 and returns f64), or else its dtype's
    found = {_precision(losses.dtype), _precision(np.asarray(whole).dtype)}
    eps = max(2 * unit_roundoff(p) for p in _precisions(jax.make_jaxpr(prog.batch_loss)().jaxpr, found))
    mean, total = float(each.mean()), float(each.sum())
    # a few roundings of each loss and of their reduction, against a structural difference (a
    # loss divided by B², batch statistics) that is a fraction of the loss itself
    if abs(value - mean) <= 16 * eps * (float(np.abs(each).mean()) + abs(mean) + abs(float(value))):
        return
    if abs(value - total) <= 16 * eps * (float(np.abs(each).sum()) + abs(float(value))):
        return
    raise TraceExportError(f"fun(params, batch) = {value!r} is neither the mean ({mean!r}) nor the sum ({total!r}) "
                           f"of its {prog.batch} examples' own losses fun(params, batch[i:i+1]): an example's loss "
                           "depends on the others (batch statistics, a normalisation over the batch), and clipping "
                           "per-example gradients assumes each example's loss its own")
