"""Sub-jaxprs a parameter enters are followed, not bound whole: a call (`jit`/`pjit`,
`closed_call`, `remat`/`checkpoint`, `custom_jvp_call`, `custom_vjp_call`) is inlined, its own
primal program walked (the custom rule is left: the uses inside are differentiated through
their primal, and the self-check holds the result to `jax.grad` of the program as written);
`cond` evaluates its branch where the index is constant, else every branch, selecting the
outputs by the index (an untaken branch's backprops are exactly 0); `scan` is unrolled (also
`fori_loop` with static bounds, which is a scan). A `while_loop` a parameter enters is refused:
JAX's reverse mode does not differentiate it, so the program has no per-example gradients to
trace. A sub-program that no parameter enters is bound whole, its own rules kept."""
from __future__ import annotations

from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
from jax import lax

from .values import Status, Val, View, Walking, refuse

CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "remat", "remat2", "checkpoint", "custom_jvp_call",
                   "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"})
FOLLOWED = CALLS | {"cond", "scan", "while"}


def follow(w: Walking, eqn: Any, vals: list[Val]) -> list[Val]:
    name = eqn.primitive.name
    if name in CALLS:
        return _call(w, eqn, vals)
    if name == "cond":
        return _cond(w, eqn, vals)
    if name == "scan":
        return _scan(w, eqn, vals)
    return _while(w, eqn, vals)


def _inside(w: Walking, what: str) -> Any:
    class Scope:
        def __enter__(self) -> None:
            w.context.append(what)

        def __exit__(self, *exc: object) -> None:
            w.context.pop()
    return Scope()


def _run(w: Walking, program: Any, args: list[Val]) -> list[Val]:
    if isinstance(program, jcore.ClosedJaxpr):
        return w.run_closed(program, args)
    return w.run(program, [], args)


def _call(w: Walking, eqn: Any, vals: list[Val]) -> list[Val]:
    params = eqn.params
    program = next((params[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr") if k in params), None)
    label = f"{eqn.primitive.name} `{params['name']}`" if "name" in params else eqn.primitive.name
    inner = program.jaxpr if isinstance(program, jcore.ClosedJaxpr) else program
    if inner is None or len(inner.invars) != len(vals):
        view = next(v.view for v in vals if v.view is not None)
        raise refuse(w.name(view.leaf), eqn.primitive.name, w.where(eqn.primitive.name),
                     "a call whose program the interpreter cannot follow")
    with _inside(w, label):
        return _run(w, program, vals)


def _no_view_out(w: Walking, outs: list[Val], primitive: str) -> None:
    for v in outs:
        if v.view is not None:
            raise refuse(w.name(v.view.leaf), primitive, w.where(primitive),
                         "the parameter itself leaves the sub-program as an output selected or stacked by it")


def _cond(w: Walking, eqn: Any, vals: list[Val]) -> list[Val]:
    branches = eqn.params["branches"]
    index, ops = vals[0], vals[1:]
    if index.status == "const":
        k = int(np.clip(int(np.asarray(index.value)), 0, len(branches) - 1))
        with _inside(w, f"cond branch {k}"):
            return w.run_closed(branches[k], ops)
    outs = []
    for k, branch in enumerate(branches):
        with _inside(w, f"cond branch {k}"):
            got = w.run_closed(branch, ops)
        _no_view_out(w, got, "cond")
        outs.append(got)
    chosen = jnp.clip(jnp.asarray(index.value).astype(jnp.int32), 0, len(branches) - 1)
    return [Val.plain(lax.select_n(chosen, *(o[j].value for o in outs)) if len(outs) > 1 else outs[0][j].value)
            for j in range(len(outs[0]))]


def _slice(v: Val, i: int) -> Val:
    value = v.value[i]
    if v.view is not None:
        return Val(value, "view", View(v.view.leaf, v.view.index[i]))
    if v.status == "const":
        with jax.ensure_compile_time_eval():
            return Val(jnp.asarray(v.value)[i], "const")
    return Val(value, v.status)


def _scan(w: Walking, eqn: Any, vals: list[Val]) -> list[Val]:
    p = eqn.params
    n_consts, n_carry, length = p["num_consts"], p["num_carry"], int(p["length"])
    consts, carry, xs = vals[:n_consts], vals[n_consts:n_consts + n_carry], vals[n_consts + n_carry:]
    steps = range(length - 1, -1, -1) if p["reverse"] else range(length)
    ys: list[list[Val]] = []
    for i in steps:
        with _inside(w, f"scan step {i}"):
            outs = w.run_closed(p["jaxpr"], [*consts, *carry, *(_slice(x, i) for x in xs)])
        carry, y = outs[:n_carry], outs[n_carry:]
        _no_view_out(w, y, "scan")
        ys.append(y)
    if p["reverse"]:
        ys.reverse()
    stacked = []
    for j, aval in enumerate(v.aval for v in eqn.outvars[n_carry:]):
        if length == 0:
            stacked.append(Val(jnp.zeros(aval.shape, aval.dtype), "const"))
            continue
        parts = [y[j] for y in ys]
        status: Status = "const" if all(x.status == "const" for x in parts) else "plain"
        stacked.append(Val(jnp.stack([x.value for x in parts]), status))
    return [*carry, *stacked]


def _while(w: Walking, eqn: Any, vals: list[Val]) -> list[Val]:
    """A parameter inside `lax.while_loop` is refused: reverse-mode differentiation does not run
    through a while loop (`jax.grad`, and so `clipped_grad`, raise on it), so the program's own
    per-example gradients, which the trace must hold, do not exist. `fori_loop` with static
    bounds is a `scan`, followed above."""
    view = next(v.view for v in vals if v.view is not None)
    raise refuse(w.name(view.leaf), "while", w.where("while"),
                 "a parameter inside lax.while_loop, which jax.grad (and so clipped_grad) cannot differentiate in "
                 "reverse mode; write the loop as lax.scan or lax.fori_loop with static bounds (a scan)")
