"""`export_trace` for any JAX program: the function jax_privacy clips, `fun(params, batch)`,
traced per example to a jaxpr (`examples.py`, `capture.py`); its uses become the shared core's
sites (`ghost_oracle._trace`), checked against `jax.grad` of the summed per-example losses
before anything is written."""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from ..._trace import site as core
from ..._trace.check import Against, check_parameter
from ..._trace.format import UNCLAIMED, TraceExportError
from ..._trace.site import Precision
from ..._trace.writer import write_trace
from ..arguments import header_arguments, kept_claims, kept_examples
from ..check import STORAGE
from ..sites import precision_of, raw_bits
from .capture import capture
from .examples import build, check_batch_loss, per_example_losses
from .gather import ids_in_table
from .layout import in_layout
from .naming import param_name, step_tensors

JAX_GRAD = Against("jax.grad", "The program's uses were differentiated through their primal program where a custom "
                               "derivative rule says otherwise, or a loop's trip count differs between examples")


@dataclass
class _Site:
    name: str
    param: str
    kind: core.SiteKind
    tensors: dict[str, np.ndarray]
    precision: str
    where: str
    perm: np.ndarray | None
    vocab: int | None

    def handover(self) -> core.Site[np.ndarray]:
        return core.Site(name=self.name, param=self.param, kind=self.kind,
                         tensors={k: raw_bits(v) for k, v in self.tensors.items()},
                         precision=cast(Precision, self.precision), origin=self.where, vocab=self.vocab)


def _same_layout(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return a is None and b is None or (a is not None and b is not None and np.array_equal(a, b))


def export_program_trace(fun: Callable[..., Any], params: Any, batch: Any, path: str | os.PathLike[str], *,
                         max_grad_norm: float, claimed_norms: Any = UNCLAIMED, clipper: str = "claimed",
                         claimed_coefficients: Any = None, noise_multiplier: float | None = None,
                         dtype: str | None = None, update: Any = None, clipped_sum: Any = None,
                         batch_divisor: float | None = None, clip_stabilizer: float = 0.0, clipping: str = "flat",
                         batch_axis: int = 0, is_padding_example: Any = None, batch_argnums: int | tuple[int, ...] = 1,
                         keep_batch_dim: bool = True) -> list[dict[str, Any]]:
    header = header_arguments(path, batch_axis=batch_axis, max_grad_norm=max_grad_norm,
                              noise_multiplier=noise_multiplier, dtype=dtype, batch_divisor=batch_divisor,
                              clip_stabilizer=clip_stabilizer, clipping=clipping, has_update=update is not None)
    path, c, dtype = header.path, header.max_grad_norm, header.dtype
    batch_divisor, clip_stabilizer = header.batch_divisor, header.clip_stabilizer
    prog = build(fun, params, batch, batch_argnums, keep_batch_dim)
    b = prog.batch
    keep = kept_examples(is_padding_example, b)
    captured = capture(prog)  # first: a use it refuses is named before the batch's loss is weighed
    check_batch_loss(prog, per_example_losses(prog))

    # a leaf's uses are all of the whole leaf, or all of single layers of it (stacked on axis 0)
    layered: dict[int, set[int | None]] = {}
    for u in captured.uses:
        layered.setdefault(u.leaf, set()).add(u.layer)
    for leaf, layers in layered.items():
        if None in layers and len(layers) > 1:
            where = next(u.where for u in captured.uses if u.leaf == leaf and u.layer is not None)
            raise TraceExportError(f"parameter `{prog.names[leaf]}` is used whole and one layer at a time ({where}); "
                                   "its sites would write it in two ways")
    stacked = {prog.names[leaf]: int(np.shape(prog.leaves[leaf])[0]) for leaf, layers in layered.items()
               if None not in layers}

    sites: list[_Site] = []
    seen: dict[str, int] = {}
    for u, back, rec in zip(captured.uses, captured.backprops, captured.recorded, strict=True):
        param = param_name(prog.names[u.leaf], u.layer)
        k = seen.get(param, 0)
        seen[param] = k + 1
        tensors: dict[str, np.ndarray] = {"backprops": back[keep]}
        if u.kind == "embedding":
            columns = rec.get("columns")
            ids = ids_in_table(param, u, rec["ids"].reshape(b, -1).astype(np.int64),
                               None if columns is None else np.asarray(columns))
            tensors["ids"] = ids[keep]
        elif "activations" in rec:
            tensors["activations"] = rec["activations"][keep]
        sites.append(_Site(name=param if k == 0 else f"{param}@{k}", param=param, kind=u.kind, tensors=tensors,
                           precision=u.precision, where=u.where, perm=u.perm, vocab=u.vocab))
    for s in sites:
        want = STORAGE[dtype or s.precision]
        s.tensors = {k: (v if k == "ids" else np.ascontiguousarray(v.astype(want))) for k, v in s.tensors.items()}

    # the batch gradient the sites are held to: jax.grad of the summed losses of the kept
    # examples, one gradient (never B of them), compiled as the capture is: eager, its backward
    # up to a use fused differently and rounded otherwise than the capture's (an f32 bias whose
    # δ cancels was refused for rounding its own terms do not bound); the leaf's dtype is the
    # precision it is judged in
    kept = jnp.asarray(keep)

    def summed_loss(leaves: list[Any]) -> Any:
        losses = jax.vmap(prog.example_loss, in_axes=(None, 0))(leaves, prog.batched)
        return jnp.sum(jnp.where(kept, losses, jnp.zeros_like(losses)))

    summed = [np.asarray(g) for g in jax.jit(jax.grad(summed_loss))(prog.leaves)]
    grads: dict[str, np.ndarray] = {}
    leaf_precision: dict[str, Precision] = {}
    for leaf, name in enumerate(prog.names):
        precision = cast(Precision, precision_of(prog.leaves[leaf].dtype, f"parameter `{name}`"))
        g = summed[leaf]
        if name in stacked:
            for layer in range(stacked[name]):
                grads[param_name(name, layer)] = g[layer]
                leaf_precision[param_name(name, layer)] = precision
        else:
            grads[name] = g
            leaf_precision[name] = precision
    by_param: dict[str, list[_Site]] = {}
    for s in sites:
        by_param.setdefault(s.param, []).append(s)
    unused = []
    for name, grad in grads.items():
        uses = by_param.get(name)
        if not uses:
            if np.any(grad != 0):
                raise TraceExportError(f"parameter `{name}` received a gradient but has no site: the interpreter met "
                                       "no use of it")
            unused.append(name)
            continue
        if any(not _same_layout(s.perm, uses[0].perm) for s in uses[1:]):
            raise TraceExportError(f"parameter `{name}` is used by sites that flatten it differently "
                                   f"({'; '.join(s.where for s in uses)}); one parameter must have one layout")
        check_parameter(f"parameter `{name}`", [s.handover() for s in uses],
                        np.ascontiguousarray(in_layout(grad, uses[0].perm)), leaf_precision[name],
                        dtype, JAX_GRAD)
    for name in unused:
        warnings.warn(f"parameter `{name}` received no gradient: it is left out of the trace", stacklevel=3)
    if not sites:
        raise TraceExportError(f"the program uses none of its parameters {prog.names[:4]}: there is no site")
    parameters = {name: int(g.size) for name, g in grads.items() if name not in unused}
    perms = {s.param: s.perm for s in sites}
    norms, coefficients = kept_claims(claimed_norms, claimed_coefficients, b, keep,
                                      lambda claim: claim(params, batch))
    step = {what: {k: raw_bits(v) for k, v in
                   step_tensors(what, given, prog.names, stacked, parameters, perms).items()}
            for what, given in (("clipped_sum", clipped_sum), ("update", update)) if given is not None}
    return write_trace(path, sites=[s.handover() for s in sites], parameters=parameters, claimed_norms=norms,
                       claimed_coefficients=coefficients, step=step, rounding=None, rounding_method=None,
                       max_grad_norm=c, clipper=clipper, noise_multiplier=noise_multiplier,
                       batch_divisor=batch_divisor, clip_stabilizer=clip_stabilizer, clipping=clipping)
