"""The batch as the user passes it: its examples' axis, its micro-batches, its packings, and
per-example values (claimed norms and coefficients).

A `PackedSequence` holds its examples in the packing, not along an axis: its `data` is the rows
of every time step one after the other, and time step t holds the first `batch_sizes[t]`
examples in sorted order (`sorted_indices[k]` is the example at sorted position k; the
identity where it is None). It is kept whole wherever the batch is handled (a model's forward
tests `isinstance(x, PackedSequence)`), and `Packing` says which example each row is."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch.nn.utils.rnn import PackedSequence


@dataclass(frozen=True, eq=False)
class Packing:
    """The examples of one `PackedSequence`'s rows: B, the batch sizes of its time steps, the
    example at each sorted position (`order`), and the example of each row of its data
    (`owners`, one per row)."""

    data: torch.Tensor
    b: int
    batch_sizes: tuple[int, ...]
    order: tuple[int, ...]
    owners: torch.Tensor

    @staticmethod
    def of(packed: PackedSequence) -> Packing:
        sizes = tuple(int(n) for n in packed.batch_sizes.tolist())
        if not sizes or any(n <= 0 for n in sizes) or any(a < z for a, z in zip(sizes, sizes[1:], strict=False)):
            raise ValueError(f"a PackedSequence input has batch_sizes {list(sizes)}: a packing's batch sizes are "
                             "positive and non-increasing")
        b = sizes[0]
        order = tuple(range(b)) if packed.sorted_indices is None else \
            tuple(int(i) for i in packed.sorted_indices.tolist())
        if sorted(order) != list(range(b)):
            raise ValueError(f"a PackedSequence input's sorted_indices {list(order)} is not a permutation of its "
                             f"{b} examples")
        if packed.data.dim() < 1 or packed.data.shape[0] != sum(sizes):
            raise ValueError(f"a PackedSequence input's data has shape {list(packed.data.shape)}; its batch_sizes "
                             f"say {sum(sizes)} rows")
        owners = torch.tensor([order[k] for n in sizes for k in range(n)], dtype=torch.long)
        return Packing(packed.data, b, sizes, order, owners)

    def row_owners(self, n: int) -> tuple[int, ...] | None:
        """The example of each of `n` rows computed row by row from this packing: its data (every
        row), or one time step (the first n examples in sorted order); None for another n."""
        if n == len(self.owners):
            return tuple(int(i) for i in self.owners.tolist())
        if n in self.batch_sizes:
            return self.order[:n]
        return None


def nested(v: Any, depth: int, leaf: Callable[[Any], bool]) -> Iterator[Any]:
    """The values of `v` that are leaves (`leaf(x)`): itself, or those its lists, tuples and
    dicts hold, nested up to `depth` levels. A leaf is not looked into (a `PackedSequence` is a
    tuple)."""
    if leaf(v):
        yield v
    elif depth > 0 and isinstance(v, (tuple, list)):
        for x in v:
            yield from nested(x, depth - 1, leaf)
    elif depth > 0 and isinstance(v, Mapping):
        for x in v.values():
            yield from nested(x, depth - 1, leaf)


#: A batch layout: ("axis" | "major" | "minor", the axis), or ("rows", the axis, the example of
#: each of its rows) for rows a packing says the examples of.
Layout = tuple[str, int] | tuple[str, int, tuple[int, ...]]


def unpacked(t: torch.Tensor, a: int, owners: tuple[int, ...], b: int) -> torch.Tensor:
    """`t`'s axis `a` of rows, each its example's by `owners`, as B × (most rows of an example),
    each example's rows in their order and zero rows after them."""
    rows = t.movedim(a, 0)
    example = torch.tensor(owners, dtype=torch.long, device=t.device)
    rank = [0] * len(owners)
    count = [0] * b
    for r, i in enumerate(owners):
        rank[r] = count[i]
        count[i] += 1
    out = rows.new_zeros(b, max(count), *rows.shape[1:])
    out[example, torch.tensor(rank, dtype=torch.long, device=t.device)] = rows
    return out


def batch_first(t: torch.Tensor, layout: Layout, b: int) -> torch.Tensor:
    """`t` with the examples on a leading axis of size B."""
    form, a = layout[0], layout[1]
    if a >= t.dim():
        return t
    if form == "rows":
        owners = layout[2] if len(layout) == 3 else ()
        return unpacked(t, a, owners, b) if t.shape[a] == len(owners) else t
    if form == "axis":
        return t.movedim(a, 0)
    if t.shape[a] % b != 0:  # a per-batch input of a flattened use: left for the shape checks
        return t
    if form == "major":
        return cast(torch.Tensor, t.unflatten(a, (b, t.shape[a] // b))).movedim(a, 0)
    return cast(torch.Tensor, t.unflatten(a, (t.shape[a] // b, b))).movedim(a + 1, 0)


def describe_layout(layout: Layout) -> str:
    """A layout as a message names it."""
    form, a = layout[0], layout[1]
    if form == "rows":
        return f"axis {a} (the rows of a packed sequence, {len(layout[2]) if len(layout) == 3 else 0} rows)"
    return {"axis": f"axis {a}", "major": f"axis {a} (example-major flattened rows)",
            "minor": f"axis {a} (example-minor flattened rows)"}[form]


def packed_sequences(inputs: Any, depth: int = 3) -> Iterator[PackedSequence]:
    """The `PackedSequence`s the batch holds: itself, or those in its tuple, list or dict."""
    return nested(inputs, depth, lambda v: isinstance(v, PackedSequence))


def packings(inputs: Any) -> list[Packing]:
    """The packing of every `PackedSequence` of the batch (see the module's docstring)."""
    return [Packing.of(p) for p in packed_sequences(inputs)]


def _packed_batch_size(inputs: Any) -> int | None:
    """B of a batch holding `PackedSequence`s (all of one B, else a ValueError); None where it
    holds none."""
    found = {int(p.batch_sizes[0]) if len(p.batch_sizes) else 0 for p in packed_sequences(inputs)}
    if len(found) > 1:
        raise ValueError(f"inputs hold PackedSequences of different batch sizes {sorted(found)}: one batch's "
                         "examples are in every one of them")
    return found.pop() if found else None


def _batch_shape(inputs: object, batch_axis: int = 0) -> tuple[int, int]:
    """(B, T) of a batch: a tensor of ids (B×T, or T×B with `batch_axis=1`), or a dict with
    `input_ids` (else its first tensor of two axes or more), read along `batch_axis`."""
    def shape(t: torch.Tensor) -> tuple[int, int]:
        return t.shape[batch_axis], t.shape[1 - batch_axis]

    if torch.is_tensor(inputs):
        if inputs.dim() < 2:
            raise ValueError(f"inputs has shape {list(inputs.shape)}; expected batch × sequence (token ids), or "
                             "sequence × batch with batch_axis=1")
        return shape(inputs)
    if isinstance(inputs, Mapping):
        t = inputs.get("input_ids")
        if not (torch.is_tensor(t) and t.dim() >= 2):
            t = next((v for v in inputs.values() if torch.is_tensor(v) and v.dim() >= 2), None)
        if t is None:
            raise ValueError(f"inputs is a dict with keys {sorted(inputs)} but no `input_ids` or other batch × "
                             "sequence tensor: the exporter needs B and T")
        return shape(t)
    raise TypeError(f"inputs must be a tensor of token ids (batch × sequence) or a dict of tensors, "
                    f"got {type(inputs).__name__}")


def _batch_size(inputs: object, batch_axis: int = 0) -> int | None:
    """B as the inputs show it: the size of `batch_axis` of the tensor (of a dict's `input_ids`,
    else of its first tensor with that axis); None for other inputs (a tuple of arguments, whose
    tensors need not be per example: ids and offsets), for which the per-example loss says B. A
    `PackedSequence` (alone or in a tuple, list or dict) says B by its packing: its first time
    step's batch size, whatever `batch_axis`."""
    packed = _packed_batch_size(inputs)
    if packed is not None:
        return packed
    if torch.is_tensor(inputs):
        return inputs.shape[batch_axis] if inputs.dim() > batch_axis else None
    if isinstance(inputs, Mapping):
        t = inputs.get("input_ids")
        values = ([t] if torch.is_tensor(t) else []) + list(inputs.values())
    else:
        return None
    t = next((v for v in values if torch.is_tensor(v) and v.dim() > batch_axis), None)
    return None if t is None else t.shape[batch_axis]


def _input_tensors(inputs: object) -> list[torch.Tensor]:
    """The tensors the batch holds, for telling which uses are fed them directly (a
    `PackedSequence`'s rows are not along an axis: none of its own)."""
    if isinstance(inputs, PackedSequence):
        return []
    if torch.is_tensor(inputs):
        return [inputs]
    if isinstance(inputs, Mapping):
        return [v for v in inputs.values() if torch.is_tensor(v)]
    if isinstance(inputs, tuple):
        return [v for v in inputs if torch.is_tensor(v)]
    return []


def _check_batch_axis(batch_axis: object) -> int:
    if type(batch_axis) is not int or batch_axis not in (0, 1):
        raise ValueError(f"batch_axis must be 0 (batch × sequence, the default) or 1 (sequence × batch: "
                         f"batch_first=False), got {batch_axis!r}")
    return int(batch_axis)


def _per_example(values: Any, b: int, what: str) -> torch.Tensor:
    """`values` (a tensor, array, list or number per example) as a float64 CPU tensor of B."""
    if torch.is_tensor(values):
        if values.is_meta:
            raise ValueError(f"{what} is on the meta device: it holds no values")
        if values.is_complex():
            raise TypeError(f"{what} is complex ({values.dtype}): norms and coefficients are real numbers")
        values = values.detach().cpu()
    try:
        # numpy first: a list of Python floats stays float64 (torch.as_tensor would round it to
        # the default float32)
        raw = values if torch.is_tensor(values) else torch.from_numpy(np.asarray(values))
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{what} must be a tensor, array or list of {b} numbers, got {type(values).__name__}") from e
    if raw.is_complex():  # a cast to float64 would drop the imaginary part with only a warning
        raise TypeError(f"{what} is complex ({raw.dtype}): norms and coefficients are real numbers")
    if raw.dtype == torch.bool:
        raise TypeError(f"{what} is boolean: give the {b} numbers")
    t = raw.to(torch.float64).reshape(-1)
    if t.numel() != b:
        raise ValueError(f"{what} has {t.numel()} values; the batch has {b} examples")
    return t.contiguous()


def _concat_micro_batches(batches: Iterable[Any], batch_axis: int = 0) -> Any:
    """The logical batch of a list of micro-batches: their concatenation along the batch axis.
    Tensors of ids are concatenated; dicts need the same keys, and each tensor value whose
    leading axis is the micro-batch's B is concatenated, while any other value (a shared 1×T
    tensor, a flag) must be the same in every micro-batch and is kept once. All micro-batches
    need one T."""
    batches = list(batches)
    if not batches:
        raise ValueError("inputs is an empty list: pass the batch, or the list of its micro-batches")
    shapes: list[tuple[int, int]] = []
    for k, mb in enumerate(batches):
        try:
            shapes.append(_batch_shape(mb, batch_axis))
        except (TypeError, ValueError) as e:
            raise type(e)(f"micro-batch {k}: {e}") from e
    t0 = shapes[0][1]
    for k, (_, tk) in enumerate(shapes):
        if tk != t0:
            raise ValueError(
                f"micro-batch {k} has sequence length T = {tk} but micro-batch 0 has T = {t0}: the trace "
                "of a logical batch needs one T for all its micro-batches (pad them to one length)")
    if len(batches) == 1:
        return batches[0]
    if all(torch.is_tensor(mb) for mb in batches):
        return torch.cat(batches, dim=batch_axis)
    if not all(isinstance(mb, Mapping) for mb in batches):
        kinds = sorted({type(mb).__name__ for mb in batches})
        raise TypeError(f"micro-batches must all be tensors of ids or all dicts, got {kinds}")
    keys = list(batches[0])
    out: dict[str, Any] = {}
    for k, mb in enumerate(batches):
        if sorted(mb) != sorted(keys):
            raise ValueError(f"micro-batch {k} has keys {sorted(mb)} but micro-batch 0 has {sorted(keys)}")
    for key in keys:
        values = [mb[key] for mb in batches]
        if all(torch.is_tensor(v) for v in values):
            if all(v.dim() > batch_axis and v.shape[batch_axis] == bk
                   for v, (bk, _) in zip(values, shapes, strict=True)):
                out[key] = torch.cat(values, dim=batch_axis)  # one slice per example
                continue
            if all(v.shape == values[0].shape and torch.equal(v, values[0]) for v in values[1:]):
                out[key] = values[0]  # shared by every micro-batch (a 1×T position_ids)
                continue
            k, (v, (bk, _)) = next((k, x) for k, x in enumerate(zip(values, shapes, strict=True))
                                   if x[0].dim() <= batch_axis or x[0].shape[batch_axis] != x[1][0])
            raise ValueError(f"micro-batch {k}: `{key}` has shape {list(v.shape)}; to be concatenated its axis "
                             f"{batch_axis} (batch_axis) must be the micro-batch's {bk} examples (or it must be the "
                             "same tensor in every micro-batch)")
        if any(torch.is_tensor(v) for v in values) or any(v != values[0] for v in values[1:]):
            raise ValueError(f"`{key}` differs between micro-batches and is not a tensor of examples")
        out[key] = values[0]
    return out


def input_leaves(inputs: Any) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    """(the inputs with every floating-point tensor replaced by a detached copy that requires
    gradients, [(name, leaf)]): what the recorded forward and its replay run on, so that the
    probes see each example's inputs and both capture the same uses (a parameter-free norm on
    the batch is on a path to a gradient only through them). A `PackedSequence`, alone or an
    element of the tuple or dict, stays one, its data the leaf."""
    def leaf(t: Any) -> Any:
        if isinstance(t, PackedSequence):
            return PackedSequence(leaf(t.data), t.batch_sizes, t.sorted_indices, t.unsorted_indices)
        return t.detach().requires_grad_(True) if torch.is_tensor(t) and t.is_floating_point() else t

    def named(name: str, old: Any, new: Any) -> list[tuple[str, torch.Tensor]]:
        if isinstance(new, PackedSequence):
            return [(f"{name} (packed data)", new.data)] if new.data is not old.data else []
        return [(name, new)] if new is not old else []

    if isinstance(inputs, PackedSequence):
        out = leaf(inputs)
        return out, named("the inputs", inputs, out)
    if torch.is_tensor(inputs):
        out = leaf(inputs)
        return out, [("the inputs", out)] if out is not inputs else []
    if isinstance(inputs, Mapping):
        out = {k: leaf(v) for k, v in inputs.items()}
        return out, [pair for k in out for pair in named(f"input `{k}`", inputs[k], out[k])]
    if isinstance(inputs, tuple):
        out = tuple(leaf(v) for v in inputs)
        return out, [pair for k, v in enumerate(out) for pair in named(f"input {k}", inputs[k], v)]
    return inputs, []
