"""The interpreter: evaluates a jaxpr equation by equation, following every parameter leaf
through layout-only steps (`layout.py`) to its uses, which become sites (`dot_general.py`,
`gather.py`, `elementwise.py`, `conv.py`), and inlining the sub-jaxprs a parameter enters
(`followers.py`). Anything else that a parameter reaches is refused by name.

It runs twice on the same program: once abstractly (`jax.eval_shape`) to list the uses and
their output shapes, then under `jax.vmap(jax.grad(...))` with a zero perturbation added to
every use's output, so that the gradient with respect to the perturbations is each example's
backprops, and the recorded other operands its activations. Both runs walk the program in the
same order, so the k-th use of one is the k-th of the other.

Equations computed from literals and the program's constants alone are folded as they are met
(`jax.ensure_compile_time_eval`): loop counters, a `cond`'s constant index and the start of a
slice of a stacked parameter stay concrete, which is what unrolling a `scan` or a `while` and
naming a layer need."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import numpy as np

from ..._trace.format import TraceExportError
from . import conv, dot_general, elementwise, followers, gather, layout
from .values import Use, Val, bind, refuse

#: Variables of a jaxpr, and the equation type: `jax.extend.core` names them.
Var = Any


class Walker:
    """One walk of the program. `perturbations` None: the abstract walk that lists the uses;
    otherwise the k-th use's output gets `perturbations[k]` added and its factors recorded."""

    def __init__(self, names: Sequence[str], indices: Sequence[np.ndarray],
                 perturbations: dict[int, Any] | None) -> None:
        self.names = list(names)
        # each leaf's `arange(size)` in its shape: a parameter's views are views of it
        self.indices = list(indices)
        self.leaf_shapes = [tuple(int(d) for d in a.shape) for a in indices]
        self.perturbations = perturbations
        self.uses: list[Use] = []
        self.recorded: dict[int, dict[str, Any]] = {}
        self.context: list[str] = []

    def where(self, primitive: str) -> str:
        inside = " > ".join(self.context)
        return f"`{primitive}`" + (f" in {inside}" if inside else " at the program's top level")

    def site(self, use: Use, out: Any, recorded: dict[str, Any]) -> Any:
        """Registers the use, adds its perturbation (the walk under `jax.grad`) and records its
        factors; returns the output the program goes on with."""
        k = len(self.uses)
        use.out_shape = tuple(int(d) for d in np.shape(out))
        use.out_dtype = out.dtype
        self.uses.append(use)
        self.recorded[k] = recorded
        if self.perturbations is not None:
            out = out + self.perturbations[k]
        return out

    def run_closed(self, closed: Any, args: Sequence[Val]) -> list[Val]:
        consts = [Val(c, "const") for c in closed.consts]
        return self.run(closed.jaxpr, consts, args)

    def run(self, jaxpr: Any, consts: Sequence[Val], args: Sequence[Val]) -> list[Val]:
        env: dict[Var, Val] = {}

        def read(v: Any) -> Val:
            if isinstance(v, jcore.Literal):
                return Val(v.val, "const")
            return env[v]

        if len(consts) != len(jaxpr.constvars) or len(args) != len(jaxpr.invars):
            raise TraceExportError(f"{self.where('call')}: a sub-program takes {len(jaxpr.invars)} arguments, "
                                   f"{len(args)} given")
        for v, x in zip(jaxpr.constvars, consts, strict=True):
            env[v] = x
        for v, x in zip(jaxpr.invars, args, strict=True):
            env[v] = x
        for eqn in jaxpr.eqns:
            outs = self.eqn(eqn, [read(v) for v in eqn.invars])
            for v, x in zip(eqn.outvars, outs, strict=True):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def eqn(self, eqn: Any, vals: list[Val]) -> list[Val]:
        name = eqn.primitive.name
        if all(v.status == "const" for v in vals):
            with jax.ensure_compile_time_eval():
                return [Val(o, "const") for o in bind(eqn, [v.value for v in vals])]
        if not any(v.status == "view" for v in vals):
            return [Val.plain(o) for o in bind(eqn, [v.value for v in vals])]
        where = self.where(name)
        if name in layout.LAYOUT:
            if layout.is_lookup(eqn, vals):
                return gather.use(self, eqn, vals, where)
            return layout.step(self, eqn, vals, where)
        if name in followers.FOLLOWED:
            return followers.follow(self, eqn, vals)
        if name == "dot_general":
            return dot_general.use(self, eqn, vals, where)
        if name in ("gather", "dynamic_slice"):
            return gather.use(self, eqn, vals, where)
        if name in elementwise.ELEMENTWISE:
            return elementwise.use(self, eqn, vals, where)
        if name == "conv_general_dilated":
            return conv.use(self, eqn, vals, where)
        view = next(v.view for v in vals if v.view is not None)
        raise refuse(self.names[view.leaf], name, where, "not a use the program route models (the gradient "
                     "through it is not a product of one example's activations and backprops)")

    def name(self, leaf: int) -> str:
        return self.names[leaf]
