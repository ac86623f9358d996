"""The kinds of site a trace holds (docs/trace-format.md), as the self-check needs them: the
batch gradient each rebuilds from its factors, and the rounding its backward adds.

A module handler (`kinds/`) writes sites of these kinds; the reader in Rust knows the same five.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .precision import low_precision

SITE_KINDS = ("linear", "conv1d", "embedding", "layernorm", "bias")


def rebuild(spec: Mapping[str, Any], ts: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ over examples and rows of the site's gradient, the same sum of |terms|), f64, in the
    parameter's layout flattened the way `p.reshape(-1)` is."""
    g = ts["backprops"].to(torch.float64)
    kind = spec["kind"]
    if kind == "bias":
        return g.sum((0, 1)), g.abs().sum((0, 1))
    if kind == "embedding":
        ids = ts["ids"].reshape(-1)
        d = g.shape[-1]
        v = spec["vocab"]
        full = torch.zeros(v, d, dtype=torch.float64).index_add_(0, ids, g.reshape(-1, d))
        absum = torch.zeros(v, d, dtype=torch.float64).index_add_(0, ids, g.abs().reshape(-1, d))
        return full.reshape(-1), absum.reshape(-1)
    a = ts["activations"].to(torch.float64)
    if kind == "layernorm":
        return (g * a).sum((0, 1)), (g * a).abs().sum((0, 1))
    if kind == "linear":
        return torch.einsum("bto,bti->oi", g, a).reshape(-1), torch.einsum("bto,bti->oi", g.abs(), a.abs()).reshape(-1)
    if kind == "conv1d":
        return torch.einsum("bti,bto->io", a, g).reshape(-1), torch.einsum("bti,bto->io", a.abs(), g.abs()).reshape(-1)
    raise ValueError(f"site `{spec['name']}`: unknown site kind {kind!r}; the kinds are {', '.join(SITE_KINDS)}")


def low_precision_rounds(spec: Mapping[str, Any], ts: Mapping[str, torch.Tensor],
                         site_dtype: torch.dtype) -> torch.Tensor | None:
    """The roundings per entry a low-precision backward of this kind adds, where the kind has its
    own count (None: the default of `precision.reduction_tolerance`). An embedding's backward
    adds each lookup's row into the table in the low precision, one rounding per occurrence of
    the id: count + 4 for that row."""
    if spec["kind"] != "embedding" or not low_precision(site_dtype):
        return None
    ids = ts["ids"].reshape(-1)
    count = torch.zeros(spec["vocab"], dtype=torch.float64).index_add_(
        0, ids, torch.ones(ids.numel(), dtype=torch.float64))
    return (count + 4.0).unsqueeze(1).expand(-1, ts["backprops"].shape[-1]).reshape(-1)
