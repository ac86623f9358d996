"""The batch as the user passes it: its examples' axis, its micro-batches, and per-example
values (claimed norms and coefficients)."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch


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
    tensors need not be per example: ids and offsets), for which the per-example loss says B."""
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
    """The tensors the batch holds, for telling which uses are fed them directly."""
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
    the batch is on a path to a gradient only through them)."""
    def leaf(t: Any) -> Any:
        return t.detach().requires_grad_(True) if torch.is_tensor(t) and t.is_floating_point() else t

    if torch.is_tensor(inputs):
        out = leaf(inputs)
        return out, [("the inputs", out)] if out is not inputs else []
    if isinstance(inputs, Mapping):
        out = {k: leaf(v) for k, v in inputs.items()}
        return out, [(f"input `{k}`", out[k]) for k in out if out[k] is not inputs[k]]
    if isinstance(inputs, tuple):
        out = tuple(leaf(v) for v in inputs)
        return out, [(f"input {k}", v) for k, v in enumerate(out) if v is not inputs[k]]
    return inputs, []
