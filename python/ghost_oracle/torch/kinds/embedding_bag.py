"""`nn.EmbeddingBag`, every mode: each example's output is computed from its bag's rows of the
table, so it is an **embedding** site whose rows are rows of the table the bag reads.

- sum and mean (with or without `per_sample_weights`): the output is a weighted sum of the
  bag's rows; the site's rows are the bag's members, ids the members and backprops the
  output's gradient times each member's weight (its per-sample weight, and 1/|bag| in mean
  mode). Members at `padding_idx` are left out of the bag, as the module leaves them out (and
  out of the mean's count).
- max: each feature f of the output is feature f of one member's row, the one whose value is
  the largest (the forward's own choice, ties included, read from its `max_indices`), and the
  gradient of that feature goes to that row alone. The site's rows are the distinct rows that
  won at least one feature, each with backprops the output's gradient on the features it won
  and 0 on the others: Σ_r e_{id_r} δ_rᵀ is the gradient, entry for entry. An empty bag (or one
  of padding only) outputs zeros and has no row.

Ids are 2-D (B bags of one length) or 1-D with `offsets` (ragged bags, each an example: bag k
is ids[offsets[k]:offsets[k+1]], per-sample weights alike). Bags shorter than the longest are
padded with rows of zero gradient."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .base import Handler, Site, Use, builtin
from .embedding import unmodelled_options

_MODES = {"sum": 0, "mean": 1, "max": 2}


def _flat(use: Use) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]:
    """(ids, offsets, per-sample weights, include_last_offset) as `F.embedding_bag` passes them
    to the kernel: 2-D ids flattened, with one bag of their width per row."""
    ids, offsets, psw = use.input
    if not torch.is_tensor(ids) or ids.is_nested or ids.dim() not in (1, 2):
        shape = list(ids.shape) if torch.is_tensor(ids) and not ids.is_nested else type(ids).__name__
        raise use.error(f"its ids are {shape}; the exporter models 2-D ids (a bag per row) or 1-D ids with offsets")
    if ids.dim() == 2:
        offsets = torch.arange(0, ids.numel(), max(ids.shape[1], 1), device=ids.device)
        return ids.reshape(-1), offsets, None if psw is None else psw.reshape(-1), False
    return ids, offsets, psw, bool(use.module.include_last_offset)


def _bounds(offsets: torch.Tensor, n: int, include_last_offset: bool) -> list[tuple[int, int]]:
    """(start, end) of every bag in the flat ids."""
    starts = [int(s) for s in offsets.tolist()]
    if include_last_offset:
        return list(zip(starts[:-1], starts[1:], strict=True))
    return list(zip(starts, starts[1:] + [n], strict=True))


class EmbeddingBag(Handler):
    kind: str = "embedding"

    def input(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        names = ("input", "offsets", "per_sample_weights")
        vals = list(args) + [None] * (3 - len(args))
        return tuple(kwargs.get(n, vals[i]) for i, n in enumerate(names))

    def input_examples(self, use: Use) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """1-D per-sample weights belong to the bags the offsets cut them into, each bag an example."""
        ids, offsets, psw = use.input
        if not (torch.is_tensor(psw) and torch.is_tensor(ids) and ids.dim() == 1 and torch.is_tensor(offsets)):
            return []
        owners = torch.full((psw.shape[0],), -1, dtype=torch.int64)
        for k, (s, e) in enumerate(_bounds(offsets, ids.shape[0], bool(use.module.include_last_offset))):
            owners[s:e] = k
        return [(psw, owners)]

    def bags(self, use: Use) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, weights), each bags×M: the members of every bag and the weight of each in the
        output (its per-sample weight, 1/|bag| in mean mode, 0 for padding)."""
        m = use.module
        ids, offsets, psw, last = _flat(use)
        bounds = _bounds(offsets, ids.shape[0], last)
        width = max([e - s for s, e in bounds] + [1])
        out_ids = torch.zeros(len(bounds), width, dtype=torch.int64)
        out_w = torch.zeros(len(bounds), width, dtype=torch.float64)
        for k, (s, e) in enumerate(bounds):
            members = ids[s:e].to(device="cpu", dtype=torch.int64)
            w = torch.ones(e - s, dtype=torch.float64) if psw is None else psw[s:e].to("cpu", torch.float64)
            if m.padding_idx is not None:
                w = w.masked_fill(members == m.padding_idx, 0.0)
            if m.mode == "mean":
                count = e - s if m.padding_idx is None else int((members != m.padding_idx).sum())
                w = w / max(count, 1)
            out_ids[k, :e - s] = members
            out_w[k, :e - s] = w
        return out_ids, out_w

    def winners(self, use: Use) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, backprops) of max mode: per bag, the distinct rows that won a feature, and the
        output's gradient on the features each won."""
        m = use.module
        ids, offsets, _, last = _flat(use)
        with torch.no_grad():  # the forward's own choice of row per (bag, feature)
            _, _, bag_size, max_indices = torch.embedding_bag(m.weight.detach(), ids, offsets, False, _MODES["max"],
                                                              False, None, last, m.padding_idx)
        g = use.batch_first(use.grad)  # bags×d
        won = max_indices.to("cpu", torch.int64)
        nonempty = bag_size.to("cpu") > 0
        rows = [torch.unique(won[k]) if bool(nonempty[k]) else won.new_zeros(0) for k in range(won.shape[0])]
        width = max([len(r) for r in rows] + [1])
        out_ids = torch.zeros(won.shape[0], width, dtype=torch.int64)
        out_bp = torch.zeros(won.shape[0], width, g.shape[-1], dtype=g.dtype, device=g.device)
        for k, r in enumerate(rows):
            out_ids[k, :len(r)] = r
            mask = (won[k].unsqueeze(0) == r.unsqueeze(1)).to(g.device)  # rows×d: the features each row won
            out_bp[k, :len(r)] = torch.where(mask, g[k].unsqueeze(0), torch.zeros((), dtype=g.dtype, device=g.device))
        return out_ids, out_bp

    def sites(self, use: Use) -> Iterator[Site[torch.Tensor]]:
        m = use.module
        weight = use.weight("an embedding bag")
        if not use.reads_trainable("weight"):
            return
        assert weight is not None  # a trainable weight is a parameter
        why = unmodelled_options(m.max_norm, m.scale_grad_by_freq)
        if why is not None:
            raise use.error(why)
        if m.mode not in _MODES:
            raise use.error(f"mode {m.mode!r} is not one of {', '.join(map(repr, _MODES))}")
        use.examples_first("output", "its bags: the exporter models one bag per example")
        if m.mode == "max":
            ids, bp = self.winners(use)
        else:
            ids, w = self.bags(use)
            g = use.batch_first(use.grad)  # bags×d
            bp = g.unsqueeze(1).to(torch.float64) * w.to(g.device).unsqueeze(2)
        yield use.site("weight", "embedding", {"ids": ids, "backprops": bp.to(use.store)}, vocab=weight.shape[0])


builtin(torch.nn.EmbeddingBag, EmbeddingBag())
