"""The batch layout of each use, found rather than assumed, and each use's factors arranged as
B×rows×features.

A site's factors are per example only if its output's gradient splits into examples along a
known axis. That axis is found by backpropagating single examples' losses: the gradient of
example i's loss alone reaches example i's part of every output and nothing else, whatever
the layout (B×T×d, seq-first T×B×d, B·T flattened rows, T·B flattened rows). An output that
example i's loss reaches outside any one slice belongs to a model that mixes examples
(attention across the batch, batch statistics), for which a per-example gradient, and so
per-example clipping, is not defined.

One kind of use is neither: a use **shared by every example**, computed once for the batch
from no example's content (nanoGPT's `wpe(arange(T))`, T×d added to B×T×d; GPT-2's 1×T
position lookup; a learned constant through a layer). Every example's loss reaches all of its
output, as it would in a model that mixes examples, and its output may have any shape (an
axis of size B or 1 by coincidence of T). The two are told apart by what the output was
computed from, not by its shape: the recorder follows the batch's examples through every
operation of the forward (`record.py`), and a shared use is one whose output carries none of
them. Such an output is the same for any examples the batch holds, so example i's loss L_i
depends on the use's parameters through it as through any other parameter use, and the
chain rule gives example i's gradient exactly: Σ over the output of ∂L_i/∂out ⊗ ∂out/∂θ. Its
per-example factors are therefore the use's one input, repeated for every example (in the
trace's factors only: the model's forward is never changed), and the per-example output
gradients ∂L_i/∂out, one backward per example (batched by `is_grads_batched` where autograd
can, else one at a time). A use whose output was computed from the examples and splits along
no axis mixes them, and is refused, whatever its shape; nothing else is ever broadcast to the
batch.

A batch of `PackedSequence`s holds its examples in the packing, not along an axis
(`batch.Packing`): a recurrent layer run on one computes each time step on the first
`batch_sizes[t]` examples in sorted order, and a layer run on the packed data on every row. Such
an output's rows are candidates too, each row its example by the packing ("rows" layouts: the
packed data's rows, one time step's, which are also B rows in sorted order), and the probes
decide among them and the axes as among any candidates. Its factors are B × (rows of the
example) with zero rows where an example has fewer (a time step an example is not in, a
shorter sequence): a zero row contributes nothing to any gradient, so the padding is exact.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from .batch import Layout, Packing, batch_first, describe_layout
from .errors import TraceExportError
from .kinds.base import Use

# Examples probed: every one up to this batch size; above it, this many, a seeded choice, and
# more for a site that none of them reached.
PROBE_ALL_UP_TO = 8
PROBE_SEED = 20260612
#: Above PROBE_ALL_UP_TO: the examples each probe backpropagates together, and how many are
#: probed at least. One backward per group: at WRN-16-4's B = 256 a backward is a fifth of the
#: export, and four probes one at a time were a third of it.
PROBE_GROUP = 4
PROBE_AT_LEAST = 4
#: Units of the output's rounding a group's gradient may differ from its weights times the
#: batch's (`_hold_groups_to_batch`): 0 on kernels that add in one order for any values.
MIXED_SLACK = 64

def _implied_owners(layout: Layout, n: int, b: int) -> tuple[int, ...]:
    """The example of each of the `n` entries of the layout's axis."""
    form = layout[0]
    if form == "axis":
        return tuple(range(n))
    if form == "major":
        return tuple(r // (n // b) for r in range(n))
    if form == "minor":
        return tuple(r % b for r in range(n))
    return layout[2] if len(layout) == 3 else ()


def _layouts(shape: Sequence[int], b: int, packings: Sequence[Packing] = ()) -> list[Layout]:
    """The candidate batch layouts of an output of `shape`, as (form, axis): ("axis", a), the
    examples along axis a (its size B); ("major", a), axis a of B·k rows, example-major (each
    example's k rows together); ("minor", a), axis a of k·B rows, example-minor (rows i, i + B,
    ...); ("rows", a, owners), axis a of rows a packing of the batch says the examples of (its
    data's, or one time step's), where they differ from the others'. The last axis holds
    features and is never the batch, unless it is the only one."""
    last = len(shape) - 1 if len(shape) > 1 else len(shape)
    out: list[Layout] = []
    for a in range(last):
        n = shape[a]
        here: list[Layout] = []
        if n == b:
            here.append(("axis", a))
        elif b > 1 and n > b and n % b == 0:
            here += [("major", a), ("minor", a)]
        seen = {_implied_owners(lay, n, b) for lay in here} if packings else set()
        for packing in packings:
            owners = packing.row_owners(n) if packing.b == b else None
            if owners is not None and owners not in seen:
                seen.add(owners)
                here.append(("rows", a, owners))
        out += here
    return out


def _reached(g: torch.Tensor, layout: Layout, b: int, group: Sequence[int]) -> tuple[list[int], bool]:
    """Along `layout`, the examples outside the probed `group` that the group's output gradient
    `g` reaches, and whether it reaches any of the group's own parts."""
    return _split_reach(batch_first(g, layout, b), b, group)


def _split_reach(g: torch.Tensor, b: int, group: Sequence[int]) -> tuple[list[int], bool]:
    """For a gradient `g` with the examples on its first axis: the examples outside `group` it
    reaches, and whether it reaches any of the group's."""
    nz = g.ne(0).reshape(b, -1).any(1)
    inside = set(group)
    return [j for j in nz.nonzero().flatten().tolist() if j not in inside], bool(nz[list(group)].any())


def _probed(group: Sequence[int]) -> str:
    """A probed group as a message names its examples."""
    if len(group) == 1:
        return f"the loss of example {group[0]} alone"
    return (f"the losses of examples {', '.join(map(str, group))} alone (backpropagated together, each weighted "
            "by its own power of two)")


def _shown(examples: Sequence[int]) -> str:
    """Examples as a message lists them: the first six."""
    return ", ".join(map(str, examples[:6])) + (", ..." if len(examples) > 6 else "")


def _input_spill(t: torch.Tensor, g: torch.Tensor | None, group: Sequence[int], b: int, batch_axis: int,
                 owners: torch.Tensor | None = None) -> list[int] | None:
    """The examples outside the probed `group` whose part of the input `t` the group's losses
    reach (`g` its gradient), along `batch_axis`, or as `owners` splits its first axis where a
    handler says how (`Handler.input_examples`); None where `t` has no such axis."""
    if g is not None and owners is not None:
        hit = owners[g.ne(0).reshape(owners.shape[0], -1).any(1).to(owners.device)]
        return sorted({int(j) for j in hit.tolist()} - {*group, -1})
    if g is None or t.dim() <= batch_axis or t.shape[batch_axis] != b:
        return None
    return _split_reach(g.movedim(batch_axis, 0), b, group)[0]


def _refuse_spilled_input(name: str, group: Sequence[int], others: list[int], batch_axis: int,
                          apart: list[int]) -> None:
    """An input whose examples a probed group's losses reach beyond the group's own. `apart` are
    the other axes of B entries along which every probed group's losses reached its own slices
    and no other: where there is one, the examples lie there and the advice to pass it is one
    that works (given it, the same probes find every example confined); none is a model that
    mixes examples."""
    if len(apart) == 1:
        a = apart[0]
        raise TraceExportError(
            f"{name} were given with batch_axis={batch_axis}, but the loss of each example alone reaches them "
            f"along axis {a} only: the examples of these inputs lie along axis {a}. Pass batch_axis={a}"
            + (" (seq-first data: batch_first=False)" if a == 1 else ""))
    shown = _shown(others)
    raise TraceExportError(
        f"the model mixes examples: {_probed(group)} depend(s) on {name} of example(s) {shown} (along axis "
        f"{batch_axis}), so an example's gradient changes with the other examples of the batch (batch "
        "statistics, such as BatchNorm in training mode, or attention across the batch) and per-example "
        "clipping bounds nothing: no per-example norm is defined")


def _probe_order(b: int) -> list[int]:
    if b <= PROBE_ALL_UP_TO:
        return list(range(b))
    gen = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randperm(b, generator=gen).tolist()


def _probe_groups(b: int) -> list[list[int]]:
    """The examples each probe backpropagates together: each alone up to `PROBE_ALL_UP_TO`,
    above it `PROBE_GROUP` of the seeded order at a time."""
    order = _probe_order(b)
    size = 1 if b <= PROBE_ALL_UP_TO else PROBE_GROUP
    return [order[k:k + size] for k in range(0, len(order), size)]


@dataclass
class Probes:
    """What the probes saw (`probe_examples`), for `settle_layouts` once the batch's own backward
    has run. Per use (by id): `status`, each candidate layout's [every probed group stayed in
    its own examples' slices, some group reached them]; `spill`, the first probe that reached
    another example (group, examples, layout), for the message; `reached`, whether any probe
    reached the use; `kept`, per layout still confined, each probed group's (group, its slices
    along the layout), for the check of each group against the batch's gradient. Per input leaf:
    `input_spill` and `input_axes` (its other axes of B entries: [confined, reached])."""

    groups: list[list[int]] = field(default_factory=list)
    status: dict[int, dict[Layout, list[bool]]] = field(default_factory=dict)
    spill: dict[int, tuple[list[int], list[int], Layout] | None] = field(default_factory=dict)
    reached: dict[int, bool] = field(default_factory=dict)
    kept: dict[int, dict[Layout, list[tuple[list[int], torch.Tensor]]]] = field(default_factory=dict)
    input_spill: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    input_axes: dict[str, dict[int, list[bool]]] = field(default_factory=dict)

    @property
    def examples(self) -> int:
        """How many examples the probes backpropagated."""
        return sum(len(g) for g in self.groups)

    def may_be_shared(self, entries: Sequence[Use]) -> bool:
        """Whether a use computed from no example fits no layout: it may be shared by every
        example, and then its per-example output gradients need the graph after the batch's
        backward."""
        return any(e.batch_free and id(e) in self.status and not _fits(self.status[id(e)]) for e in entries)


def probe_examples(entries: Sequence[Use], losses: torch.Tensor, b: int, batch_axis: int,
                   leaves: Sequence[tuple[str, torch.Tensor]] = (), progress: Any = None,
                   packings: Sequence[Packing] = ()) -> Probes:
    """Backpropagates groups of single examples' losses (`_probe_groups`) to the output of every
    use and to the inputs, before the batch's own backward, with the graph kept: each use's
    candidate layouts are held to what they reach (see the module's docstring). Example k of a
    group is weighted by 2^k, so that each group's gradient at its own examples can be held to
    the batch's (`settle_layouts`): a power of two scales every rounding of a backward exactly.

    `leaves` are (name, tensor) pairs of floating-point inputs made to require gradients: a
    group's losses must not reach another example's inputs either (batch statistics taken of the
    inputs before any parameter is used show there and nowhere else). `packings` are those of
    the batch's `PackedSequence`s (`batch.Packing`): their rows are candidate layouts of every
    use, and their data's rows are held to their examples."""
    probes = Probes()
    live = [e for e in entries if e.output is not None and torch.is_tensor(e.output) and e.output.requires_grad]
    if b == 1 or (not live and not leaves):
        return probes
    probes.status = {id(e): {lay: [True, False] for lay in _layouts(tuple(e.out.shape), b, packings)} for e in live}
    probes.spill = {id(e): None for e in live}
    probes.reached = {id(e): False for e in live}
    probes.kept = {id(e): {} for e in live}
    reached_any = bool(live)  # with no use to reach, every example is probed for the inputs alone
    probes.input_axes = {name: {a: [True, False] for a in range(t.dim()) if a != batch_axis and t.shape[a] == b}
                         for name, t in leaves}
    # The inputs a use splits into examples otherwise than along the batch axis.
    declared = [pair for e in entries if e.output is not None for pair in e.handler.input_examples(e)]
    owners = {name: own for name, t in leaves for x, own in declared
              if x.shape == t.shape and x.data_ptr() == t.data_ptr()}
    owners.update(_packed_owners(leaves, packings))
    for name in owners:
        probes.input_axes[name] = {}
    groups = _probe_groups(b)
    for n, group in enumerate(groups):
        if (b > PROBE_ALL_UP_TO and probes.examples >= min(b, PROBE_AT_LEAST) and all(probes.reached.values())
                and reached_any):
            break
        if progress is not None:
            progress.step("per-example probes (one backward per group of examples)", n, len(groups))
        weights = torch.zeros(b, dtype=losses.dtype, device=losses.device)
        weights[group] = torch.tensor([2.0 ** k for k in range(len(group))], dtype=losses.dtype,
                                      device=losses.device)
        grads = torch.autograd.grad(losses, [e.out for e in live] + [t for _, t in leaves], grad_outputs=weights,
                                    retain_graph=True, allow_unused=True)
        probes.groups.append(group)
        for (name, t), g in zip(leaves, grads[len(live):], strict=True):
            others = _input_spill(t, g, group, b, batch_axis, owners.get(name))
            if others and name not in probes.input_spill:
                probes.input_spill[name] = (group, others)
            if g is not None:
                for a, st in probes.input_axes[name].items():
                    others, hit = _split_reach(g.movedim(a, 0), b, group)
                    st[0] = st[0] and not others
                    st[1] = st[1] or hit
        for e, g in zip(live, grads[:len(live)], strict=True):
            if g is None:
                continue
            if bool(g.ne(0).any()):
                probes.reached[id(e)] = True
            for lay, st in probes.status[id(e)].items():
                others, hit = _reached(g, lay, b, group)
                st[1] = st[1] or hit
                if others:
                    st[0] = False
                    if lay == ("axis", batch_axis) or probes.spill[id(e)] is None:
                        probes.spill[id(e)] = (group, others, lay)
                    probes.kept[id(e)].pop(lay, None)
                elif st[0] and len(group) > 1:  # the group's own slices, for the check against the batch's
                    probes.kept[id(e)].setdefault(lay, []).append(
                        (group, batch_first(g.detach(), lay, b)[group].clone()))
        del grads
    return probes


def settle_layouts(entries: Sequence[Use], probes: Probes, losses: torch.Tensor, b: int, batch_axis: int,
                   direct_inputs: Sequence[torch.Tensor], progress: Any = None) -> None:
    """Once the batch's own backward has run (the graph kept where `Probes.may_be_shared`): sets
    `use.layout` for every use whose output received a gradient, from what the probes saw. A use
    shared by every example (see the module's docstring) gets its per-example factors: its input
    repeated and its per-example output gradients, the examples first. Raises `TraceExportError`
    for a use no layout fits that is not shared (the model mixes examples), one several layouts
    fit alike, a use fed the inputs directly whose layout is not `batch_axis`, an input a group's
    losses reach beyond its examples, and a group whose gradient at its own examples is not
    each example's weight times the batch's there (another example's loss reaches them)."""
    live = [e for e in entries if e.output_grad is not None]
    if b == 1:  # one example: the batch is the example, any axis of size 1 holds it
        for e in live:
            dims = tuple(e.out.shape)
            fits = [lay for lay in [cast(Layout, ("axis", batch_axis))] + _layouts(dims, 1)
                    if lay[1] < len(dims) - 1 and dims[lay[1]] == 1]
            e.layout = fits[0] if fits else ("major", 0)
        return
    if not live and not probes.input_axes:
        return
    shared = [e for e in live if e.batch_free and not _fits(probes.status[id(e)]) and bool(e.grad.ne(0).any())]
    for e in shared:
        if e.read_into_python:
            raise TraceExportError(
                f"{e.where}: its output ({list(e.out.shape)}) has no axis of the "
                f"batch's {b} examples and is computed from no tensor of the batch, but the forward read values of "
                f"the batch into Python before it ({e.read_into_python}), where the exporter cannot follow "
                "them: whether this use is shared by every example or mixes them cannot be told. Compute it "
                "without reading the batch's values into Python, or give it a per-example input")
    grads = _gather_per_example_grads(shared, losses, b, progress) if shared else {}
    shared_ids = {id(e) for e in shared}
    for e in live:
        if id(e) in shared_ids:
            _share(e, grads.pop(id(e)), b)
            continue
        _settle_layout(e, probes.status[id(e)], probes.spill[id(e)], probes.reached[id(e)], probes.examples, b,
                       batch_axis, direct_inputs)
        if e.layout is not None and not e.layout_unprobed:
            _hold_groups_to_batch(e, probes.kept[id(e)].get(e.layout, []), b)
    for name, (group, others) in probes.input_spill.items():
        apart = [a for a, (confined, hit) in probes.input_axes[name].items() if confined and hit]
        _refuse_spilled_input(name, group, others, batch_axis, apart)


def _hold_groups_to_batch(e: Use, kept: Sequence[tuple[list[int], torch.Tensor]], b: int) -> None:
    """Each probed group's gradient at its own examples, along the use's layout, against the
    batch's: where no example's loss reaches another's part of the output, the group's part at
    its k-th example is 2^k times the batch's there, exactly (the same backward, its seed scaled
    by a power of two; `MIXED_SLACK` units of rounding allowed for kernels that add in an order
    of their own). More is another example's loss reaching that part: the group's own probe
    cannot see it (its gradient stays inside the group), the batch's can."""
    assert e.layout is not None
    if not kept:
        return
    batch = batch_first(e.grad, e.layout, b)
    u = torch.finfo(batch.dtype).eps / 2 if batch.dtype.is_floating_point else 0.0
    for group, slices in kept:
        for k, i in enumerate(group):
            want = batch[i].to(torch.float64) * 2.0 ** k
            got = slices[k].to(torch.float64)
            scale = float(want.abs().max()) if want.numel() else 0.0
            off = float((got - want).abs().max()) if want.numel() else 0.0
            if off > MIXED_SLACK * u * scale:
                raise TraceExportError(
                    f"the model mixes examples: the output of {e.where} ({list(e.out.shape)}) receives gradient at "
                    f"example {i} (along {describe_layout(e.layout)}) from the losses of other examples: "
                    f"{_probed(group)} give it {off / max(scale, 1e-300):.2e} of its size more or less than example "
                    f"{i}'s own share of the batch's gradient there. Example i's gradient then depends on the other "
                    "examples of the batch (attention or normalization across the batch, BatchNorm), so "
                    "per-example clipping bounds nothing and no per-example norm is defined")


def _packed_owners(leaves: Sequence[tuple[str, torch.Tensor]],
                   packings: Sequence[Packing]) -> dict[str, torch.Tensor]:
    """The example of each row of the inputs that are a packing's data, by the leaf's name."""
    return {name: packing.owners for name, t in leaves for packing in packings if t is packing.data}


def _fits(status: dict[Layout, list[bool]]) -> list[Layout]:
    """The layouts along which every probed example's gradient stayed at its own index and
    reached it."""
    return [lay for lay, (confined, hit) in status.items() if confined and hit]


def _gather_per_example_grads(shared: Sequence[Use], losses: torch.Tensor, b: int,
                              progress: Any) -> dict[int, dict[int, torch.Tensor | None]]:
    """Each shared use's (by id) ∂L_i/∂out of every example i: one batched backward
    (`is_grads_batched`, a row of the identity per example), else, where autograd cannot batch
    the graph's backward, one backward per example."""
    outs = [e.out for e in shared]
    if progress is not None:
        progress.step("per-example gradients of the uses shared by every example", 0, 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # vmap's fallback notes: slower, not different
            batched = torch.autograd.grad(losses, outs, grad_outputs=torch.eye(b, dtype=losses.dtype,
                                                                               device=losses.device),
                                          retain_graph=True, allow_unused=True, is_grads_batched=True)
        return {id(e): {i: None if g is None else g[i].detach() for i in range(b)}
                for e, g in zip(shared, batched, strict=True)}
    except (RuntimeError, NotImplementedError):  # an op without a batching rule for its backward
        grads: dict[int, dict[int, torch.Tensor | None]] = {id(e): {} for e in shared}
        for i in range(b):
            for e, g in zip(shared, torch.autograd.grad(losses[i], outs, retain_graph=True, allow_unused=True),
                            strict=True):
                grads[id(e)][i] = None if g is None else g.detach()
        return grads


def share_as_recorded(recorded: Sequence[Use], replayed: Sequence[Use], losses: torch.Tensor,
                      b: int) -> None:
    """For a replay of the recorded forward (the same uses in the same order, its backward run
    with the graph kept): the uses the recorded pass found shared by every example get their
    per-example factors in the replay too, from the replay's own per-example losses."""
    shared = [e for r, e in zip(recorded, replayed, strict=True) if r.shared and e.output_grad is not None]
    grads = _gather_per_example_grads(shared, losses, b, None) if shared else {}
    for e in shared:
        _share(e, grads[id(e)], b)


def _share(e: Use, grads: dict[int, torch.Tensor | None], b: int) -> None:
    """Makes a use shared by every example one whose examples lie along axis 0 of its factors:
    the output gradient becomes the per-example gradients ∂L_i/∂out, stacked, and the input
    (and a functional call's recorded input, which a replay reads) the one input repeated for
    every example, as a view. Where the output and every input tensor have a leading axis of 1
    (a 1×T lookup, a 1×C×L constant through a convolution), the examples take its place, so the
    use keeps the rank its handler models; otherwise they come first as a new axis."""
    out = e.out
    where = e.where
    zero = torch.zeros(out.shape, dtype=out.dtype, device=out.device)
    stacked = torch.stack([g if (g := grads.get(i)) is not None else zero for i in range(b)])
    x = e.input
    xs = [x] if torch.is_tensor(x) else [v for v in x if torch.is_tensor(v)] if isinstance(x, tuple) else []
    if out.dim() >= 1 and out.shape[0] == 1 and xs and all(t.dim() >= 1 and t.shape[0] == 1 for t in xs):
        stacked = stacked.squeeze(1)

        def repeat(t: torch.Tensor) -> torch.Tensor:
            return t.expand(b, *t.shape[1:])
    elif torch.is_tensor(x):
        def repeat(t: torch.Tensor) -> torch.Tensor:
            return t.unsqueeze(0).expand(b, *t.shape)
    else:
        raise TraceExportError(
            f"{where}: a use shared by every example (its output {list(out.shape)} is computed from no example of "
            "the batch) whose several input tensors do not all have a leading axis of 1; the exporter models "
            "a shared use of such a module only with a leading axis of 1 for the examples to take")
    e.output_grad = stacked
    e.input = repeat(x) if torch.is_tensor(x) else tuple(repeat(v) if torch.is_tensor(v) else v for v in x)
    call = e.call
    if call is not None:  # the recorded call of a function: its input is its first argument
        if call.args and torch.is_tensor(call.args[0]):
            call.args = (repeat(call.args[0]), *call.args[1:])
        elif torch.is_tensor(call.kwargs.get("input")):
            call.kwargs = {**call.kwargs, "input": repeat(call.kwargs["input"])}
    e.layout = ("axis", 0)
    e.shared = True


def _settle_layout(e: Use, status: dict[Layout, list[bool]],
                   spilled_at: tuple[list[int], list[int], Layout] | None, reached: bool, n_probed: int, b: int,
                   batch_axis: int, direct_inputs: Sequence[torch.Tensor]) -> None:
    """Sets one use's layout from what the probes saw: the one layout along which every probed
    example's gradient stayed at its own index and reached it. Raises naming the use where none
    or several fit, and where a use fed the inputs directly disagrees with `batch_axis`."""
    fits = _fits(status)
    where = e.where
    shape = list(e.out.shape)
    if not fits and spilled_at is None and not bool(e.grad.ne(0).any()):
        # A use whose gradient is exactly zero (autograd fills the unused part of a split
        # output with zeros): its sites add nothing to any example, in any layout. Not where a
        # probe reached another example: there the batch's zero is the examples' gradients
        # cancelling (two equal examples through a mean over the batch), and they mix.
        candidates = list(status)
        if candidates:
            e.layout = candidates[0]
            e.layout_unprobed = True  # any layout: no probe reached the use to say which
        else:
            e.output_grad = None
        return
    if not fits:
        if not reached:
            raise TraceExportError(
                f"{where}: its output ({shape}) receives a gradient from the batch but from none of the "
                f"{n_probed} examples' losses alone; the batch axis of this use cannot be found")
        if spilled_at is None and not e.followed:
            raise TraceExportError(
                f"{where}: its output ({shape}) has no axis of the batch's {b} examples (nor of {b}·k flattened "
                "rows), and the inputs hold an object the exporter cannot see into (not a tensor, list, tuple or "
                "dict), so it cannot tell whether this use is shared by every example or mixes them. Pass the "
                "batch as a tensor, a dict or a tuple of tensors")
        if spilled_at is None:
            raise TraceExportError(
                f"the model mixes examples: {where} computes its output ({shape}) from the batch's examples "
                f"together, with no axis of the batch's {b} examples (nor of {b}·k flattened rows) to keep them "
                "apart, and the examples' losses reach it (a mean or other reduction over the batch, an input "
                "of several examples). Per-example clipping bounds nothing where an example's gradient depends "
                "on the others: no per-example norm is defined")
        group, others, lay = spilled_at
        shown = _shown(others)
        raise TraceExportError(
            f"the model mixes examples: {_probed(group)} send(s) gradient into the output of "
            f"{where} ({shape}) at example(s) {shown} along {describe_layout(lay)}, and no axis of that output "
            "keeps the examples apart. Example i's gradient then depends on the other examples of the "
            "batch (attention or normalization across the batch: a seq-first attention fed batch-first "
            "data, BatchNorm), so per-example clipping bounds nothing and no per-example norm is "
            "defined. Give each example its own computation (batch_first=True, GroupNorm or LayerNorm "
            "for BatchNorm)")
    if len(fits) > 1:
        raise TraceExportError(
            f"{where}: its output ({shape}) is confined to one example along "
            f"{' and '.join(describe_layout(f) for f in fits)} alike in every probed example; the batch axis of "
            "this use is ambiguous (pass a batch whose examples differ at every position)")
    e.layout = fits[0]
    x = e.input
    # Fed the inputs directly: the very view the batch holds (a transpose of a square input
    # shares its shape and storage but not its strides, and is not).
    fed_inputs = torch.is_tensor(x) and any(
        t.shape == x.shape and t.stride() == x.stride() and t.data_ptr() == x.data_ptr() for t in direct_inputs)
    if fed_inputs and fits[0] != ("axis", batch_axis):
        raise TraceExportError(
            f"{where} is fed the inputs directly, and the loss of each example reaches its output along "
            f"{describe_layout(fits[0])}, but the inputs were given with batch_axis={batch_axis}: the examples of "
            f"these inputs lie along {describe_layout(fits[0])}. Pass batch_axis={fits[0][1]}"
            + (" (seq-first data: batch_first=False)" if fits[0][1] == 1 else "") if fits[0][0] == "axis" else
            f"{where} is fed the inputs directly, and the loss of each example reaches its output along "
            f"{describe_layout(fits[0])}, not along the inputs' batch_axis={batch_axis}")


def refuse_mixing_seen_finer(recorded: Sequence[Use], replayed: Sequence[Use],
                             losses: torch.Tensor, b: int, batch_axis: int,
                             leaves: Sequence[tuple[str, torch.Tensor]], precision: str,
                             packings: Sequence[Packing] = ()) -> None:
    """For a replay of the recorded forward at a finer precision (its graph kept): the same
    single-example probes again, along the layouts the recorded pass found. At the model's own
    precision a gradient that crosses examples can round to exactly zero (bf16 through a
    BatchNorm in training mode at a batch of two; a mean over the batch whose examples are
    equal), and the probes, which test for exact zeros, then see none; a model whose examples
    are kept apart has no path from one example's loss to another's part of any output, at any
    precision, so what the finer probes see is the model mixing examples, and it is refused as
    the recorded probes would have."""
    if b < 2:
        return
    uses = [(r, e) for r, e in zip(recorded, replayed, strict=True)
            if r.layout is not None and not r.shared and torch.is_tensor(e.output)
            and e.out.requires_grad]
    declared = [pair for _, e in uses for pair in e.handler.input_examples(e)]
    owners = {name: own for name, t in leaves for x, own in declared
              if x.shape == t.shape and x.data_ptr() == t.data_ptr()}
    owners.update(_packed_owners(leaves, packings))
    order = _probe_order(b)[:b if b <= PROBE_ALL_UP_TO else 4]  # as many as the recorded pass needs at least
    # A use no probe reached at the model's precision has a layout chosen for want of one: its
    # candidates are tried as the recorded pass tries them, and it mixes if none keeps every
    # probed example apart.
    unprobed = {id(e): {lay: [True, False] for lay in _layouts(tuple(e.out.shape), b, packings)}
                for r, e in uses if r.layout_unprobed}
    spills: dict[int, tuple[int, list[int], Layout]] = {}
    for i in order:
        grads = torch.autograd.grad(losses[i], [e.out for _, e in uses] + [t for _, t in leaves],
                                    retain_graph=True, allow_unused=True)
        for (r, e), g in zip(uses, grads[:len(uses)], strict=True):
            if g is None:
                continue
            if id(e) in unprobed:
                for lay, st in unprobed[id(e)].items():
                    others, hit = _reached(g, lay, b, [i])
                    if others:
                        st[0] = False
                        spills.setdefault(id(e), (i, others, lay))
                    st[1] = st[1] or hit
                continue
            assert r.layout is not None  # the uses kept have a layout
            others, _ = _reached(g, r.layout, b, [i])
            if others:
                shown = _shown(others)
                raise TraceExportError(
                    f"the model mixes examples: the loss of example {i} alone sends gradient into the output of "
                    f"{r.where} ({list(e.out.shape)}) at example(s) {shown} along "
                    f"{describe_layout(r['layout'])}, seen when the model is replayed at {precision} (at the model's "
                    "own precision that gradient rounds to zero). Example i's gradient then depends on the other "
                    "examples of the batch (normalization or attention across the batch, BatchNorm in training "
                    "mode), so per-example clipping bounds nothing and no per-example norm is defined")
        for (name, t), g in zip(leaves, grads[len(uses):], strict=True):
            spilled = _input_spill(t, g, [i], b, batch_axis, owners.get(name))
            if spilled:
                shown = _shown(spilled)
                raise TraceExportError(
                    f"the model mixes examples: the loss of example {i} alone depends on {name} of example(s) "
                    f"{shown} (along axis {batch_axis}), seen when the model is replayed at {precision} (at the "
                    "model's own precision that gradient rounds to zero), so example i's gradient changes with "
                    "the other examples of the batch and no per-example norm is defined")
    for r, e in uses:
        status = unprobed.get(id(e))
        if status is None or id(e) not in spills or _fits(status):
            continue
        i, others, lay = spills[id(e)]
        shown = _shown(others)
        raise TraceExportError(
            f"the model mixes examples: the loss of example {i} alone sends gradient into the output of module "
            f"`{r['name']}` ({r['cls']}) ({list(e.out.shape)}) at example(s) {shown} along {describe_layout(lay)}, "
            f"and along every other axis that could hold the examples, seen when the model is replayed at "
            f"{precision} (at the model's own precision that gradient rounds to zero). Example i's gradient then "
            "depends on the other examples of the batch (normalization or attention across the batch, BatchNorm "
            "in training mode), so per-example clipping bounds nothing and no per-example norm is defined")
