"""Tied ghost clipping under FSDP2 (`grad_sample_mode="ghost_fsdp"`).

`shard_tied(model, blocks)` shards each block in its own `fully_shard` group and the rest of the
model (where the embedding and the head tied to it live) in the root group: the tied modules in
one group, as torch asks of a shared parameter. Each rank then computes its own examples' norms
from its own activations and output gradients: the per-example norm needs no communication, so
every rank's norms are exact for its examples.

Opacus's FSDP ghost class keeps the norms on the modules (`module.norm_sample`) instead of the
parameters; this class reads those for the modules Opacus handles and the tied parameters' norms
from their uses, and checks the tied gradients against the sum of the uses seen on all ranks.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping_fsdp import (
    GradSampleModuleFastGradientClippingFSDP,
)
from torch import nn
from torch.distributed.fsdp import fully_shard

from .capture import accumulation_dtype, find_tied_parameters
from .plugin import TiedGhostClipping

__all__ = ["TiedGradSampleModuleFSDP", "shard_tied"]


def shard_tied(model: nn.Module, blocks: Iterable[nn.Module], **fsdp_kwargs: Any) -> nn.Module:
    """`fully_shard` each of `blocks` (e.g. the transformer layers), then the model itself: the
    tied embedding and head stay in the root group together. Raises `ValueError`, naming the
    parameter, if a block holds some but not all of a tied parameter's modules (torch would
    refuse the split, or shard one parameter twice)."""
    blocks = list(blocks)
    for holders in find_tied_parameters(model).values():
        for block in blocks:
            inside = [name for name, m in holders if any(m is sub for sub in block.modules())]
            if inside and len(inside) != len(holders):
                raise ValueError(f"tied parameter `{holders[0][0]}`: block {type(block).__name__} holds "
                                 f"{', '.join(inside)} but not {', '.join(n for n, _ in holders if n not in inside)}; "
                                 "shard the tied modules in one group")
    for block in blocks:
        fully_shard(block, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


class TiedGradSampleModuleFSDP(TiedGhostClipping, GradSampleModuleFastGradientClippingFSDP):  # type: ignore[misc]
    """`GradSampleModuleFastGradientClippingFSDP` with exact tied norms."""

    def __init__(self, m: nn.Module, **kwargs: Any) -> None:
        super().__init__(m, **kwargs)
        self._setup_tied()

    def get_norm_sample(self) -> torch.Tensor:
        per_module: list[torch.Tensor] = []
        for module in self.iterate_submodules(self._module):
            if module in self._tied_modules:
                bias = getattr(module, "bias", None)
                if isinstance(bias, nn.Parameter) and bias.requires_grad:
                    per_module.append(bias._norm_sample)  # type: ignore[attr-defined]
                continue
            per_module.extend(getattr(module, "norm_sample", []))
        for state in self._tied.values():
            norm = getattr(state.param, "_norm_sample", None)
            if norm is None:
                raise RuntimeError(f"tied parameter `{state.name}` has no per-sample norm after the backward pass: "
                                   "not every use reached it")
            per_module.append(norm)
        wide = torch.float64 if any(n.dtype == torch.float64 for n in per_module) else torch.float32
        device = per_module[0].device
        norms: torch.Tensor = torch.stack([n.reshape(-1).to(device=device, dtype=wide) for n in per_module],
                                          dim=0).norm(2, dim=0)
        self.per_sample_gradient_norms = norms
        return norms

    def check_tied_gradients(self) -> None:
        """The batch gradient FSDP leaves is the mean over ranks of each rank's sum of uses: the uses
        seen here are summed over the ranks before the comparison."""
        if not self._check_next_backward:
            return
        self._check_next_backward = False
        world = dist.get_world_size() if dist.is_initialized() else 1
        for state in self._tied.values():
            grad = state.param.grad
            if grad is None:
                state.seen_grad = None
                continue
            full = _local(grad.detach())
            if state.seen_grad is not None and world > 1:
                seen = state.seen_grad.to(accumulation_dtype(state.param.dtype))
                dist.all_reduce(seen)
                state.seen_grad = seen / world
            state.check_batch_gradient(full, state.low_precision)
