"""The batch layout of each use, found rather than assumed, and each use's factors arranged as
B×rows×features.

A site's factors are per example only if its output's gradient splits into examples along a
known axis. That axis is found by backpropagating single examples' losses: the gradient of
example i's loss alone reaches example i's part of every output and nothing else, whatever
the layout (B×T×d, seq-first T×B×d, B·T flattened rows, T·B flattened rows). An output that
example i's loss reaches outside any one slice belongs to a model that mixes examples
(attention across the batch, batch statistics), for which a per-example gradient, and so
per-example clipping, is not defined.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from .errors import TraceExportError

# Examples probed: every one up to this batch size; above it, this many, a seeded choice, and
# more for a site that none of them reached.
PROBE_ALL_UP_TO = 8
PROBE_SEED = 20260612

#: A batch layout: ("axis" | "major" | "minor", the axis).
Layout = tuple[str, int]


def _layouts(shape: Sequence[int], b: int) -> list[Layout]:
    """The candidate batch layouts of an output of `shape`, as (form, axis): ("axis", a), the
    examples along axis a (its size B); ("major", a), axis a of B·k rows, example-major (each
    example's k rows together); ("minor", a), axis a of k·B rows, example-minor (rows i, i + B,
    ...). The last axis holds features and is never the batch, unless it is the only one."""
    last = len(shape) - 1 if len(shape) > 1 else len(shape)
    out: list[Layout] = []
    for a in range(last):
        n = shape[a]
        if n == b:
            out.append(("axis", a))
        elif b > 1 and n > b and n % b == 0:
            out += [("major", a), ("minor", a)]
    return out


def _batch_first(t: torch.Tensor, layout: Layout, b: int) -> torch.Tensor:
    """`t` with the examples on a leading axis of size B (of size 1 for a per-batch input, which
    the caller expands)."""
    form, a = layout
    if a >= t.dim():
        return t
    if form == "axis":
        return t.movedim(a, 0)
    if t.shape[a] % b != 0:  # a per-batch input of a flattened use: left for the shape checks
        return t
    if form == "major":
        return cast(torch.Tensor, t.unflatten(a, (b, t.shape[a] // b))).movedim(a, 0)
    return cast(torch.Tensor, t.unflatten(a, (t.shape[a] // b, b))).movedim(a + 1, 0)


def _describe(layout: Layout) -> str:
    form, a = layout
    return {"axis": f"axis {a}", "major": f"axis {a} (example-major flattened rows)",
            "minor": f"axis {a} (example-minor flattened rows)"}[form]


def _input_spill(t: torch.Tensor, g: torch.Tensor | None, i: int, b: int, batch_axis: int) -> list[int] | None:
    """The examples other than i whose part of the input `t` example i's loss alone reaches
    (`g` its gradient), along `batch_axis`; None where `t` has no such axis."""
    if g is None or t.dim() <= batch_axis or t.shape[batch_axis] != b:
        return None
    nz = g.movedim(batch_axis, 0).ne(0).reshape(b, -1).any(1)
    return [j for j in nz.nonzero().flatten().tolist() if j != i]


def _refuse_spilled_input(name: str, t: torch.Tensor, g: torch.Tensor, i: int, others: list[int], b: int,
                          batch_axis: int) -> None:
    """An input whose examples example i's loss reaches beyond its own: another axis that keeps
    the examples apart is a layout mismatch, none is a model that mixes examples."""
    for a in range(t.dim()):
        if a != batch_axis and t.shape[a] == b and _input_spill(t, g, i, b, a) == [] and bool(
                g.movedim(a, 0)[i].ne(0).any()):
            raise TraceExportError(
                f"{name} were given with batch_axis={batch_axis}, but the loss of example {i} alone reaches them "
                f"along axis {a} only: the examples of these inputs lie along axis {a}. Pass batch_axis={a}"
                + (" (seq-first data: batch_first=False)" if a == 1 else ""))
    shown = ", ".join(map(str, others[:6])) + (", ..." if len(others) > 6 else "")
    raise TraceExportError(
        f"the model mixes examples: the loss of example {i} alone depends on {name} of example(s) {shown} (along "
        f"axis {batch_axis}), so example {i}'s gradient changes with the other examples of the batch (batch "
        "statistics, such as BatchNorm in training mode, or attention across the batch) and per-example "
        "clipping bounds nothing: no per-example norm is defined")


def _probe_order(b: int) -> list[int]:
    if b <= PROBE_ALL_UP_TO:
        return list(range(b))
    gen = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randperm(b, generator=gen).tolist()


def _find_layouts(entries: Sequence[dict[str, Any]], losses: torch.Tensor, b: int, batch_axis: int,
                  direct_inputs: Sequence[torch.Tensor], leaves: Sequence[tuple[str, torch.Tensor]] = (),
                  progress: Any = None) -> None:
    """Sets `entry["layout"]` for every use whose output received a gradient in the batch's
    backward, from the gradients of single examples' losses (the graph must still be alive).
    Raises `TraceExportError` for a use no layout fits (the model mixes examples), one several
    layouts fit alike, and a use fed the inputs directly whose layout is not `batch_axis`.

    `leaves` are (name, tensor) pairs of floating-point inputs made to require gradients: an
    example's loss must not reach another example's inputs either (batch statistics taken of
    the inputs before any parameter is used show there and nowhere else)."""
    live = [e for e in entries if e["grad"] is not None]
    if not live and not leaves:
        return
    if b == 1:  # one example: the batch is the example, any axis of size 1 holds it
        for e in live:
            dims = tuple(e["output"].shape)
            fits = [lay for lay in [("axis", batch_axis)] + _layouts(dims, 1)
                    if lay[1] < len(dims) - 1 and dims[lay[1]] == 1]
            e["layout"] = fits[0] if fits else ("major", 0)
        return
    status = {id(e): {lay: [True, False] for lay in _layouts(tuple(e["output"].shape), b)} for e in live}
    reached_any = bool(live)  # with no use to reach, every example is probed for the inputs alone
    # The first probe that reached another example, for the message.
    spill: dict[int, tuple[int, list[int], Layout] | None] = {id(e): None for e in live}
    input_spill: dict[str, tuple[torch.Tensor, torch.Tensor, int, list[int]]] = {}
    reached = {id(e): False for e in live}
    order = _probe_order(b)
    for n, i in enumerate(order):
        if n >= min(b, 4) and b > PROBE_ALL_UP_TO and all(reached.values()) and reached_any:
            break
        if progress is not None:
            progress.step("per-example probes (one backward each)", n, len(order))
        grads = torch.autograd.grad(losses[i], [e["output"] for e in live] + [t for _, t in leaves],
                                    retain_graph=True, allow_unused=True)
        for (name, t), g in zip(leaves, grads[len(live):], strict=True):
            others = _input_spill(t, g, i, b, batch_axis)
            if others and name not in input_spill:
                input_spill[name] = (t, g, i, others)
        for e, g in zip(live, grads[:len(live)], strict=True):
            if g is None:
                continue
            for lay, st in status[id(e)].items():
                nz = _batch_first(g, lay, b).ne(0).reshape(b, -1).any(1)
                others = [j for j in nz.nonzero().flatten().tolist() if j != i]
                if others:
                    st[0] = False
                    if lay == ("axis", batch_axis) or spill[id(e)] is None:
                        spill[id(e)] = (i, others, lay)
                if bool(nz[i]):
                    st[1] = True
                    reached[id(e)] = True
    for e in live:
        _settle_layout(e, status[id(e)], spill[id(e)], reached[id(e)], len(order), b, batch_axis, direct_inputs)
    for name, (t, g, i, others) in input_spill.items():
        _refuse_spilled_input(name, t, g, i, others, b, batch_axis)


def _settle_layout(e: dict[str, Any], status: dict[Layout, list[bool]],
                   spilled_at: tuple[int, list[int], Layout] | None, reached: bool, n_probed: int, b: int,
                   batch_axis: int, direct_inputs: Sequence[torch.Tensor]) -> None:
    """Sets one use's layout from what the probes saw: the one layout along which every probed
    example's gradient stayed at its own index and reached it. Raises naming the use where none
    or several fit, and where a use fed the inputs directly disagrees with `batch_axis`."""
    fits = [lay for lay, (confined, hit) in status.items() if confined and hit]
    where = f"module `{e['name']}` ({e['cls']})"
    shape = list(e["output"].shape)
    if not fits and not bool(e["grad"].ne(0).any()):
        # A use whose gradient is exactly zero (autograd fills the unused part of a split
        # output with zeros): its sites add nothing to any example, in any layout.
        candidates = list(status)
        if candidates:
            e["layout"] = candidates[0]
        else:
            e["grad"] = None
        return
    if not fits:
        if not reached:
            raise TraceExportError(
                f"{where}: its output ({shape}) receives a gradient from the batch but from none of the "
                f"{n_probed} examples' losses alone; the batch axis of this use cannot be found")
        if spilled_at is None:
            raise TraceExportError(
                f"{where}: its output has shape {shape}, with no axis of the batch's {b} examples (nor of "
                f"{b}·k flattened rows); the exporter cannot tell which part of it is which example's")
        i, others, lay = spilled_at
        shown = ", ".join(map(str, others[:6])) + (", ..." if len(others) > 6 else "")
        raise TraceExportError(
            f"the model mixes examples: the loss of example {i} alone sends gradient into the output of "
            f"{where} ({shape}) at example(s) {shown} along {_describe(lay)}, and no axis of that output "
            "keeps the examples apart. Example i's gradient then depends on the other examples of the "
            "batch (attention or normalization across the batch: a seq-first attention fed batch-first "
            "data, BatchNorm), so per-example clipping bounds nothing and no per-example norm is "
            "defined. Give each example its own computation (batch_first=True, GroupNorm or LayerNorm "
            "for BatchNorm)")
    if len(fits) > 1:
        raise TraceExportError(
            f"{where}: its output ({shape}) is confined to one example along "
            f"{' and '.join(_describe(f) for f in fits)} alike in every probed example; the batch axis of "
            "this use is ambiguous (pass a batch whose examples differ at every position)")
    e["layout"] = fits[0]
    x = e["input"]
    fed_inputs = torch.is_tensor(x) and any(t.shape == x.shape and t.data_ptr() == x.data_ptr()
                     for t in direct_inputs)
    if fed_inputs and fits[0] != ("axis", batch_axis):
        raise TraceExportError(
            f"{where} is fed the inputs directly, and the loss of each example reaches its output along "
            f"{_describe(fits[0])}, but the inputs were given with batch_axis={batch_axis}: the examples of "
            f"these inputs lie along {_describe(fits[0])}. Pass batch_axis={fits[0][1]} (seq-first data: "
            "batch_first=False)" if fits[0][0] == "axis" else
            f"{where} is fed the inputs directly, and the loss of each example reaches its output along "
            f"{_describe(fits[0])}, not along the inputs' batch_axis={batch_axis}")
