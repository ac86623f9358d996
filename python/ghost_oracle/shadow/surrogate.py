"""The surrogate per-example loss: for a module whose examples do not mix, example i's gradient
is J_iᵀ ∂L/∂out_i whatever the loss L was, and L_i = s·⟨out_i, stopgrad(∂L/∂out_i)⟩ has exactly
that gradient (times s). s is what the library scales its per-example gradients by: Opacus
multiplies the backprops by the batch size under loss_reduction="mean" (`rearrange_grad_samples`;
torch's ExpandedWeights likewise), 1 under "sum". The module, its inputs and the gradient at its
output are all observable from outside the library, so the truth needs none of its code.

An output that is a `PackedSequence` holds its examples in the packing, not along an axis: its
data's rows are summed per example (a segment sum by the example of each row,
`export.batch.Packing.owners`)."""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten


class SurrogateLoss:
    """`loss(model, inputs) -> Tensor[B]`, the exporter's per-example loss: runs `model` on the
    captured arguments (under the autocast the library's forward ran under) and returns
    s·Σ_k ⟨out_k[i], G_k[i]⟩ over the output tensors k that received a gradient G_k, each
    summed over every axis but its batch axis; for a leaf in `segments` (a packed output's data:
    index -> (the example of each row, B)), over the rows of each example."""

    def __init__(self, grads: list[tuple[int, torch.Tensor, int]], scale: float, kwargs: Mapping[str, Any],
                 autocast: list[tuple[str, torch.dtype]],
                 segments: Mapping[int, tuple[torch.Tensor, int]] | None = None) -> None:
        self.grads = grads  # (index of the output leaf, its gradient, its batch axis)
        self.scale = float(scale)
        self.kwargs = dict(kwargs)
        self.autocast = autocast
        self.segments = dict(segments or {})

    def __call__(self, model: torch.nn.Module, inputs: Any) -> torch.Tensor:
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        with contextlib.ExitStack() as stack:
            for device, dtype in self.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            out = model(*args, **self.kwargs)
        leaves, _ = tree_flatten(out)
        total: torch.Tensor | None = None
        for idx, g, axis in self.grads:
            y = leaves[idx]
            if idx in self.segments:
                owners, b = self.segments[idx]
                rows = (y * g).reshape(y.shape[0], -1).sum(1)
                per = rows.new_zeros(b).index_add(0, owners.to(rows.device), rows)
            else:
                per = (y * g).movedim(axis, 0)
                per = per.reshape(per.shape[0], -1).sum(1)
            total = per if total is None else total + per
        if total is None:
            raise ValueError("no output of the module received a gradient")
        return total * self.scale
