"""`nn.EmbeddingBag` (modes sum and mean, with or without `per_sample_weights`): each example's
output is a weighted sum of its bag's rows of the table, so it is an **embedding** site whose
rows are the bag's members: ids the members, backprops the output's gradient times each
member's weight (its per-sample weight, and 1/|bag| in mean mode). Members at `padding_idx`
are left out of the bag, as the module leaves them out (and out of the mean's count); bags
shorter than the longest are padded with rows of zero gradient."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .base import Handler, Site, Use, builtin


class EmbeddingBag(Handler):
    kind: str = "embedding"

    def input(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        names = ("input", "offsets", "per_sample_weights")
        vals = list(args) + [None] * (3 - len(args))
        return tuple(kwargs.get(n, vals[i]) for i, n in enumerate(names))

    def bags(self, use: Use) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, weights), each B×M: the members of every bag and the weight of each."""
        m = use.module
        ids, offsets, psw = use.input
        if ids.dim() == 2:
            w = psw if psw is not None else torch.ones(ids.shape, dtype=torch.float64)
            return ids, w.to(torch.float64)
        starts = offsets.tolist()
        ends = starts[1:] + [ids.shape[0]]
        if m.include_last_offset:
            starts, ends = starts[:-1], ends[:-1]
        width = max([e - s for s, e in zip(starts, ends, strict=True)] + [1])
        out_ids = torch.zeros(len(starts), width, dtype=torch.int64)
        out_w = torch.zeros(len(starts), width, dtype=torch.float64)
        for k, (s, e) in enumerate(zip(starts, ends, strict=True)):
            out_ids[k, :e - s] = ids[s:e]
            out_w[k, :e - s] = 1.0 if psw is None else psw[s:e].to(torch.float64)
        return out_ids, out_w

    def sites(self, use: Use) -> Iterator[Site]:
        m = use.module
        weight = use.weight("an embedding bag")
        if m.mode not in ("sum", "mean") or m.max_norm is not None or m.scale_grad_by_freq:
            raise use.error(f"mode {m.mode!r}, max_norm or scale_grad_by_freq are not modelled (sum and mean are)")
        if use.entry["layout"] != ("axis", 0):
            raise use.error("its output's examples are not along its first axis")
        ids, w = self.bags(use)
        ids = ids.to(torch.int64)
        if m.padding_idx is not None:
            w = w.masked_fill(ids == m.padding_idx, 0.0)
        if m.mode == "mean":
            count = (w != 0).sum(1, keepdim=True).clamp(min=1) if m.padding_idx is not None else torch.full(
                (ids.shape[0], 1), ids.shape[1])
            if use.input[0].dim() == 1:  # ragged bags: each its own length
                count = self.lengths(use).unsqueeze(1)
            w = w / count
        g = use.batch_first(use.grad)  # B×d
        bp = g.unsqueeze(1).to(torch.float64) * w.unsqueeze(2)
        if use.trainable(weight):
            yield use.spec("weight", self.kind, vocab=weight.shape[0]), {"ids": ids, "backprops": bp.to(use.store)}

    def lengths(self, use: Use) -> torch.Tensor:
        m = use.module
        ids, offsets, _ = use.input
        starts = offsets.tolist()
        ends = starts[1:] + [ids.shape[0]]
        if m.include_last_offset:
            starts, ends = starts[:-1], ends[:-1]
        n = []
        for s, e in zip(starts, ends, strict=True):
            members = ids[s:e]
            if m.padding_idx is not None:
                members = members[members != m.padding_idx]
            n.append(max(len(members), 1))
        return torch.tensor(n, dtype=torch.float64)


builtin(torch.nn.EmbeddingBag, EmbeddingBag())
