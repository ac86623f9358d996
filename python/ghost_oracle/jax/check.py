"""The self-check: nothing is written unless every parameter that received a gradient is
accounted for by its sites, and the batch gradient rebuilt from their factors (as stored)
equals `jax.grad`'s to rounding, each site at its own precision. The tolerance is the PyTorch
exporter's (`ghost_oracle.torch.precision.reduction_tolerance`), the same arithmetic in numpy."""
from __future__ import annotations

import math
from collections.abc import Sequence

import ml_dtypes
import numpy as np

from .._trace.format import TraceExportError
from .sites import Site

STORAGE = {"f64": np.dtype(np.float64), "f32": np.dtype(np.float32), "f16": np.dtype(np.float16),
           "bf16": np.dtype(ml_dtypes.bfloat16)}


# (machine epsilon, smallest normal) of each precision
LIMITS = {"f64": (2.0**-52, 2.0**-1022), "f32": (2.0**-23, 2.0**-126), "f16": (2.0**-10, 2.0**-14),
          "bf16": (2.0**-7, 2.0**-126)}


def unit_roundoff(precision: str) -> float:
    return LIMITS[precision][0] / 2


def low_precision(precision: str) -> bool:
    return unit_roundoff(precision) > unit_roundoff("f32")


def rebuild(site: Site) -> tuple[np.ndarray, np.ndarray]:
    """(Σ over examples and rows of the site's gradient, the same sum of |terms|), f64, flat in
    the site's layout."""
    g = site.tensors["backprops"].astype(np.float64)
    if site.kind == "bias":
        return g.sum((0, 1)), np.abs(g).sum((0, 1))
    if site.kind == "embedding":
        assert site.vocab is not None
        d = g.shape[-1]
        ids = site.tensors["ids"].reshape(-1)
        full = np.zeros((site.vocab, d))
        absum = np.zeros((site.vocab, d))
        np.add.at(full, ids, g.reshape(-1, d))
        np.add.at(absum, ids, np.abs(g).reshape(-1, d))
        return full.reshape(-1), absum.reshape(-1)
    a = site.tensors["activations"].astype(np.float64)
    if site.kind == "layernorm":
        return (g * a).sum((0, 1)), np.abs(g * a).sum((0, 1))
    if site.kind == "linear":
        return (np.einsum("bto,bti->oi", g, a).reshape(-1),
                np.einsum("bto,bti->oi", np.abs(g), np.abs(a)).reshape(-1))
    if site.kind == "conv1d":
        return (np.einsum("bti,bto->io", a, g).reshape(-1),
                np.einsum("bti,bto->io", np.abs(a), np.abs(g)).reshape(-1))
    raise TraceExportError(f"site `{site.name}`: unknown kind {site.kind!r}")


def tolerance(site: Site, absum: np.ndarray, store: str) -> np.ndarray:
    n = site.tensors["backprops"].shape[0] * site.tensors["backprops"].shape[1]
    u = unit_roundoff(site.precision)
    if low_precision(site.precision):
        if site.kind == "embedding":
            assert site.vocab is not None
            count = np.bincount(site.tensors["ids"].reshape(-1), minlength=site.vocab).astype(np.float64)
            k: np.ndarray | float = np.repeat(count + 4.0, site.tensors["backprops"].shape[-1])
        else:
            k = 4.0 + math.log2(max(n, 2))
        eps, smallest_normal = LIMITS[site.precision]
        sub = smallest_normal * eps  # the smallest subnormal
        tol = k * u * absum + 2.0 * (n + 16) * unit_roundoff("f32") * absum + (n + 4) * sub / 2
    else:
        tol = 2.0 * (n + 16) * u * absum
    us = unit_roundoff(store)
    if us > u:
        tol = tol + 3.0 * us * absum
    return np.asarray(tol)


def self_check(sites: Sequence[Site], grads: dict[str, np.ndarray], store: str | None) -> list[str]:
    """Raises unless every parameter with a nonzero gradient has sites whose factors rebuild it.
    Returns the parameters left out (exactly zero gradient and no site: not used by the loss)."""
    by_param: dict[str, list[Site]] = {}
    for s in sites:
        by_param.setdefault(s.param, []).append(s)
    unused = []
    for name, grad in grads.items():
        g = np.asarray(grad, dtype=np.float64)
        uses = by_param.get(name)
        if not uses:
            if np.any(g != 0):
                raise TraceExportError(
                    f"parameter `{name}` received a gradient but has no site: the exporter models the module methods "
                    "its kinds know by exact class (Dense, DenseGeneral, Einsum, Embed and Embed.attend, LayerNorm, "
                    "RMSNorm, Conv, and the gemma package's Einsum, RMSNorm and Embedder.encode/decode); this "
                    "parameter was used some other way (read with self.param inside another module, a subclass)")
            unused.append(name)
            continue
        layouts = {s.layout_name for s in uses}
        if len(layouts) > 1:
            raise TraceExportError(f"parameter `{name}` is used by sites that flatten it differently "
                                   f"({', '.join(sorted(layouts))}); one parameter must have one layout")
        want = uses[0].to_trace_layout(g)
        rebuilt = np.zeros(g.size)
        absum = np.zeros(g.size)
        tol = np.zeros(g.size)
        for s in uses:
            r, a = rebuild(s)
            if r.size != g.size:
                raise TraceExportError(f"parameter `{name}`: site `{s.name}` ({s.kind}, {s.call.where}) rebuilds "
                                       f"{r.size} entries but the parameter has {g.size}")
            rebuilt += r
            absum += a
            tol += tolerance(s, a, s.precision if store is None else store)
        p_precision = {np.dtype(np.float64): "f64", np.dtype(np.float16): "f16",
                       np.dtype(ml_dtypes.bfloat16): "bf16"}.get(np.asarray(grad).dtype, "f32")
        tol += 2.0 * (len(uses) - 1) * unit_roundoff(p_precision) * absum + LIMITS[p_precision][1]
        err = np.abs(rebuilt - want)
        bad = err > tol
        if bad.any():
            k = int(np.argmax(err / tol))
            listed = ", ".join(f"`{s.name}` ({s.kind}, {s.call.where}, computed in {s.precision})" for s in uses)
            raise TraceExportError(
                f"parameter `{name}`: the gradient rebuilt from its sites {listed} differs from jax.grad's at "
                f"{int(bad.sum())} of {g.size} entries; worst entry {k}: rebuilt {rebuilt[k]:.6e}, jax.grad "
                f"{want[k]:.6e}, |error| {err[k]:.3e} > tolerance {tol[k]:.3e}. The module's method is not what the "
                "exporter models (a subclass, a scale or cast inside it)")
    return unused
