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


def layout(spec: Mapping[str, Any], ts: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """(rows, cols) of the parameter's gradient as the site writes it: `p.reshape(-1)` is rows
    blocks of cols entries (an embedding's or a head's rows are the vocabulary)."""
    kind = spec["kind"]
    out = ts["backprops"].shape[-1]
    if kind == "embedding":
        return spec["vocab"], out
    if kind in ("bias", "layernorm"):
        return out, 1
    if kind == "linear":
        return out, ts["activations"].shape[-1]
    if kind == "conv1d":
        return ts["activations"].shape[-1], out
    raise ValueError(f"site `{spec['name']}`: unknown site kind {kind!r}; the kinds are {', '.join(SITE_KINDS)}")


def rebuild(spec: Mapping[str, Any], ts: Mapping[str, torch.Tensor],
            rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ over examples and rows of the site's gradient, the same sum of |terms|), f64, in the
    parameter's layout flattened the way `p.reshape(-1)` is; `rows` (start, stop): only those
    rows of the layout (`layout`), so that a large table is rebuilt a block at a time."""
    kind = spec["kind"]
    n_rows, _ = layout(spec, ts)
    start, stop = (0, n_rows) if rows is None else rows
    if kind == "embedding":
        g = ts["backprops"]
        d = g.shape[-1]
        ids = ts["ids"].reshape(-1)
        keep = (ids >= start) & (ids < stop)
        at = ids[keep] - start
        g = g.reshape(-1, d)[keep].to(torch.float64)
        full = torch.zeros(stop - start, d, dtype=torch.float64).index_add_(0, at, g)
        absum = torch.zeros(stop - start, d, dtype=torch.float64).index_add_(0, at, g.abs())
        return full.reshape(-1), absum.reshape(-1)
    if kind in ("bias", "linear"):
        g = ts["backprops"][..., start:stop].to(torch.float64)
    else:
        g = ts["backprops"].to(torch.float64)
    if kind == "bias":
        return g.sum((0, 1)), g.abs().sum((0, 1))
    if kind == "conv1d":
        a = ts["activations"][..., start:stop].to(torch.float64)
    else:
        a = ts["activations"].to(torch.float64)
    if kind == "layernorm":
        prod = (g * a)[..., start:stop]
        return prod.sum((0, 1)), prod.abs().sum((0, 1))
    if kind == "linear":
        return torch.einsum("bto,bti->oi", g, a).reshape(-1), torch.einsum("bto,bti->oi", g.abs(), a.abs()).reshape(-1)
    return torch.einsum("bti,bto->io", a, g).reshape(-1), torch.einsum("bti,bto->io", a.abs(), g.abs()).reshape(-1)


def sketch(spec: Mapping[str, Any], ts: Mapping[str, torch.Tensor], rows: tuple[int, int],
           v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rebuild`'s two sums for rows (start, stop) of the layout, each multiplied on the right
    by `v` (cols × k, f64), without forming them: (G·v, |terms|·|v|), each (stop - start) × k.
    A linear site's G is Σ gᵀa, so G·v = gᵀ(a·v): B·T·(in + out)·k products where the rebuild
    takes B·T·in·out. Only the kinds with a matrix layout (linear, conv1d, embedding)."""
    kind = spec["kind"]
    start, stop = rows
    av = v.abs()
    if kind == "embedding":
        g = ts["backprops"]
        ids = ts["ids"].reshape(-1)
        keep = (ids >= start) & (ids < stop)
        at = ids[keep] - start
        g = g.reshape(-1, g.shape[-1])[keep].to(torch.float64)
        k = v.shape[1]
        full = torch.zeros(stop - start, k, dtype=torch.float64).index_add_(0, at, g @ v)
        absum = torch.zeros(stop - start, k, dtype=torch.float64).index_add_(0, at, g.abs() @ av)
        return full, absum
    if kind == "linear":  # G = gᵀ a, rows of G are the output features
        g = ts["backprops"][..., start:stop].to(torch.float64).flatten(0, -2)
        a = ts["activations"].to(torch.float64).flatten(0, -2)
    elif kind == "conv1d":  # G = aᵀ g, rows of G are the input features
        g = ts["activations"][..., start:stop].to(torch.float64).flatten(0, -2)
        a = ts["backprops"].to(torch.float64).flatten(0, -2)
    else:
        raise ValueError(f"site `{spec['name']}`: a {kind} site has one column; it is rebuilt, not sketched")
    return g.T @ (a @ v), g.abs().T @ (a.abs() @ av)


def low_precision_rounds(spec: Mapping[str, Any], ts: Mapping[str, torch.Tensor], site_dtype: torch.dtype,
                         rows: tuple[int, int] | None = None) -> torch.Tensor | None:
    """The roundings per entry a low-precision backward of this kind adds, where the kind has its
    own count (None: the default of `precision.reduction_tolerance`). An embedding's backward
    adds each lookup's row into the table in the low precision, one rounding per occurrence of
    the id: count + 4 for that row. `rows` (start, stop): those rows of the layout only."""
    if spec["kind"] != "embedding" or not low_precision(site_dtype):
        return None
    start, stop = (0, spec["vocab"]) if rows is None else rows
    ids = ts["ids"].reshape(-1)
    ids = ids[(ids >= start) & (ids < stop)] - start
    count = torch.zeros(stop - start, dtype=torch.float64).index_add_(
        0, ids, torch.ones(ids.numel(), dtype=torch.float64))
    return (count + 4.0).unsqueeze(1).expand(-1, ts["backprops"].shape[-1]).reshape(-1)
