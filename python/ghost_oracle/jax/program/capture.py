"""The two walks of the per-example program (`interpreter.py`): the abstract one lists the uses
and their output shapes; the second, under `jax.jit(jax.vmap(jax.grad(...)))` over the examples
with a zero perturbation at each use's output, gives each example's backprops (the gradient of
its own loss with respect to the perturbation) and records its activations."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._trace.format import TraceExportError
from .examples import Program
from .interpreter import Walker
from .values import Use, Val, View


@dataclass
class Captured:
    uses: list[Use]
    backprops: list[np.ndarray]  # B×R×out per use
    recorded: list[dict[str, np.ndarray]]  # B-leading factors per use


def capture(prog: Program) -> Captured:
    example0 = jax.tree_util.tree_map(lambda a: a[0], prog.batched)
    closed = jax.make_jaxpr(prog.example_loss)(prog.leaves, example0)
    shapes = [tuple(int(d) for d in np.shape(x)) for x in prog.leaves]
    indices = [np.arange(int(np.prod(s)), dtype=np.int32 if np.prod(s) < 2**31 else np.int64).reshape(s)
               for s in shapes]

    def walk(perturbations: dict[int, Any] | None, leaves: list[Any], example: Any) -> tuple[Any, Walker]:
        w = Walker(prog.names, indices, perturbations)
        args = [Val(x, "view", View(i, indices[i])) for i, x in enumerate(leaves)]
        args += [Val.plain(x) for x in jax.tree_util.tree_leaves(example)]
        outs = w.run_closed(closed, args)
        if len(outs) != 1:
            raise TraceExportError(f"fun returns {len(outs)} arrays; it must return the loss alone")
        loss = outs[0]
        if loss.view is not None:
            raise TraceExportError(f"fun returns the parameter `{prog.names[loss.view.leaf]}` itself as its loss")
        return jnp.reshape(loss.value, ()), w

    listed: list[Walker] = []

    def abstract(example: Any) -> Any:
        loss, w = walk(None, prog.leaves, example)
        listed.append(w)
        return loss

    jax.eval_shape(abstract, example0)
    uses = listed[0].uses
    zeros = {k: jnp.zeros(u.out_shape, u.out_dtype) for k, u in enumerate(uses)}

    def per_example(perturbations: dict[int, Any], leaves: list[Any], example: Any) -> tuple[Any, Any]:
        loss, w = walk(perturbations, leaves, example)
        if len(w.uses) != len(uses):
            raise TraceExportError(f"the program's walks met {len(uses)} and {len(w.uses)} uses of its parameters")
        return loss, w.recorded

    grads, recorded = jax.jit(jax.vmap(jax.grad(per_example, has_aux=True), in_axes=(None, None, 0)))(
        zeros, prog.leaves, prog.batched)
    backprops = [u.rows_of(np.asarray(grads[k])) for k, u in enumerate(uses)]
    factors = [{name: np.asarray(v) for name, v in recorded[k].items()} for k in range(len(uses))]
    return Captured(uses=uses, backprops=backprops, recorded=factors)
