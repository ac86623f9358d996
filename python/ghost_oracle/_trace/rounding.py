"""The framework-neutral part of the model's rounding (the trace's `model.rounding`): how a
replay's factors are turned into a per-example distance from the traced ones, and what both
exporters' replays share (the header's method names, the memory budget, the warning where the
rounding is not measured). numpy only; each front-end (`ghost_oracle.torch.rounding`,
`ghost_oracle.jax.rounding`) runs its own replay and hands its factors here as numpy arrays.
"""
from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import conv

#: How the header's `model_rounding` says the rounding was measured.
REPLAY_FLOAT64 = "replay-float64"
REPLAY_FLOAT32_SCALED = "replay-float32-scaled"

#: The replay runs only where its copy of the model and its factors (in f64, on the host) take
#: at most this fraction of the memory available where each lives.
REPLAY_MEMORY_FRACTION = 0.5

#: A replayed f64 model's difference (f32's rounding) times u64/u32 = 2⁻²⁹ estimates f64's own.
F32_TO_F64 = 2.0**-53 / 2.0**-24


class RoundingNotMeasured(Exception):
    """The replay cannot measure the rounding: the reason, for the warning."""


def warn_not_measured(reason: RoundingNotMeasured, stacklevel: int) -> None:
    """The warning that the trace goes without `model.rounding`, and why. `stacklevel` counts
    from the caller (1: the caller's own line)."""
    warnings.warn(f"the model's own rounding is not measured (no `model.rounding` in the trace; the judge's bound "
                  f"covers the clipper's arithmetic on the traced factors only): {reason}", stacklevel=stacklevel + 1)


def available_host_memory() -> int | None:
    """Bytes of host memory available (None: unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


#: A site: its header entry (name, param, kind, vocab) and its factors (any floating numpy dtype,
#: or bfloat16 as raw bits in `uint16`; read in f64, ids in int64, one parameter at a time).
SiteFactors = tuple[Mapping[str, Any], Mapping[str, np.ndarray]]
_Use = tuple[Mapping[str, Any], Mapping[str, np.ndarray], Mapping[str, np.ndarray]]


def difference_norms(sites: Sequence[SiteFactors], replayed: Mapping[str, Mapping[str, np.ndarray]],
                     b: int) -> np.ndarray:
    """‖g_i(traced) − g_i(replayed)‖₂ over every parameter, per example, in f64 (B).

    The difference is formed factor by factor, never as the difference of two gradients (which
    would cancel to nothing in f64): for a linear site Σ_t g_t a_tᵀ − g'_t a'_tᵀ =
    Σ_t (g_t − g'_t) a_tᵀ + g'_t (a_t − a'_t)ᵀ, two terms whose factors are the small
    differences. A parameter's squared norm is then either the Gram identity over its terms'
    rows (Σ_{s,t} (l_s·l_t)(r_s·r_t), where rows are fewer than the parameter's entries) or the
    example's difference materialized, whichever is cheaper. A convolution stored as its input
    (a `conv` entry) is the same two terms, G(δ − δ', x) + G(δ', x − x'), each example's
    materialized from its input a tile of examples at a time. `RoundingNotMeasured` where the
    replay's factors do not match the trace's (shape, ids, layout) or the difference is not
    finite."""
    by_param: dict[str, list[_Use]] = {}
    for spec, ts in sites:
        again = replayed[spec["name"]]
        for k, v in ts.items():
            if again[k].shape != v.shape:
                raise RoundingNotMeasured(f"the replay's `{spec['name']}.{k}` has shape {list(again[k].shape)}, the "
                                          f"trace's {list(v.shape)}")
        if "ids" in ts and not np.array_equal(np.asarray(ts["ids"], np.int64), np.asarray(again["ids"], np.int64)):
            raise RoundingNotMeasured(f"the replay's `{spec['name']}` looked up other ids")
        by_param.setdefault(spec["param"], []).append((spec, ts, again))
    total = np.zeros(b)
    for param, uses in by_param.items():
        kinds = {spec["kind"] for spec, _, _ in uses}
        convs = sum("conv" in spec for spec, _, _ in uses)
        if convs and convs < len(uses):
            raise RoundingNotMeasured(f"parameter `{param}` is used as a convolution and otherwise together")
        if convs:
            total += _conv_difference(uses, b)
        elif kinds <= {"bias", "layernorm"}:
            total += (_vector_difference(uses) ** 2).sum(1)
        elif kinds <= {"linear", "conv1d", "embedding"}:
            total += _matrix_difference(uses, b)
        else:
            raise RoundingNotMeasured(f"parameter `{param}` has sites of kinds {sorted(kinds)} together")
    return np.sqrt(np.maximum(total, 0.0))


def _f64(a: np.ndarray) -> np.ndarray:
    """A factor in f64; a `uint16` one is bfloat16 held as its raw bits (`Site`'s contract):
    its value is the float32 whose upper half those bits are."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.asarray(a, dtype=np.float64)


def _vector_difference(uses: Sequence[_Use]) -> np.ndarray:
    """B × entries: a bias's or a norm's per-example difference."""
    diff: np.ndarray | None = None
    for spec, ts, again in uses:
        g, g2 = _f64(ts["backprops"]), _f64(again["backprops"])
        if spec["kind"] == "bias":
            d = (g - g2).sum(1)
        else:
            a, a2 = _f64(ts["activations"]), _f64(again["activations"])
            d = ((g - g2) * a + g2 * (a - a2)).sum(1)
        diff = d if diff is None else diff + d
    assert diff is not None  # a parameter has sites
    return diff


#: One term of a parameter's per-example difference Σ_t l_t r_tᵀ: (l, r), l B×R×rows or the
#: ids B×R of a lookup (one-hot rows), r B×R×cols.
_Term = tuple[np.ndarray, np.ndarray]


def _terms(spec: Mapping[str, Any], ts: Mapping[str, np.ndarray], again: Mapping[str, np.ndarray]) -> list[_Term]:
    g, g2 = _f64(ts["backprops"]), _f64(again["backprops"])
    if spec["kind"] == "embedding":
        return [(np.asarray(ts["ids"], np.int64), g - g2)]
    a, a2 = _f64(ts["activations"]), _f64(again["activations"])
    if spec["kind"] == "linear":  # rows: the output features
        return [(g - g2, a), (g2, a - a2)]
    return [(a - a2, g), (a2, g - g2)]  # conv1d: rows the input features


def _conv_difference(uses: Sequence[_Use], b: int) -> np.ndarray:
    """Σ of the squared per-example differences of a convolution's weight over its conv-input
    sites, B: G(δ − δ', x) + G(δ', x − x') materialized a tile of examples at a time."""
    out = np.zeros(b)
    geos = [conv.ConvGeometry.of_spec(spec["conv"]) for spec, _, _ in uses]
    spec0, ts0, _ = uses[0]
    for t0, t1 in conv.example_tiles(geos[0], ts0["inputs"].shape, ts0["backprops"].shape):
        diff: np.ndarray | None = None
        for geo, (spec, ts, again) in zip(geos, uses, strict=True):
            x, x2 = conv.f64(ts["inputs"][t0:t1]), conv.f64(again["inputs"][t0:t1])
            g, g2 = conv.f64(ts["backprops"][t0:t1]), conv.f64(again["backprops"][t0:t1])
            d = conv.per_example(x, g - g2, geo, 0, t1 - t0) + conv.per_example(x - x2, g2, geo, 0, t1 - t0)
            if diff is not None and d.shape != diff.shape:
                raise RoundingNotMeasured(f"parameter `{spec['param']}`'s sites lay it out with different shapes")
            diff = d if diff is None else diff + d
        assert diff is not None  # a parameter has sites
        out[t0:t1] = (diff ** 2).sum((1, 2))
    if not all(math.isfinite(float(v)) for v in out):
        raise RoundingNotMeasured(f"parameter `{spec0['param']}`'s difference is not finite")
    return out


def _lhs_gram(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """l_s·l_t for the rows of two left factors of one example (dense R×rows or ids R)."""
    if x.ndim == 1 and y.ndim == 1:
        return np.asarray(x[:, None] == y[None, :], dtype=np.float64)
    if x.ndim == 1:
        return np.asarray(y[:, x].T)
    if y.ndim == 1:
        return np.asarray(x[:, y])
    return np.asarray(x @ y.T)


def _matrix_difference(uses: Sequence[_Use], b: int) -> np.ndarray:
    """Σ of the squared per-example differences of a matrix parameter (linear, conv1d,
    embedding sites), B."""
    terms = [t for spec, ts, again in uses for t in _terms(spec, ts, again)]
    first = uses[0][0]
    cols = terms[0][1].shape[-1]
    rows = int(first["vocab"]) if first["kind"] == "embedding" else next(
        (t[0].shape[-1] for t in terms if t[0].ndim == 3), 0)
    if any(r.shape[-1] != cols for _, r in terms) or any(lhs.ndim == 3 and lhs.shape[-1] != rows for lhs, _ in terms):
        raise RoundingNotMeasured(f"parameter `{first['param']}`'s sites lay it out with different shapes")
    n_rows = sum(r.shape[1] for _, r in terms)
    gram = n_rows * (rows + cols) < rows * cols
    out = np.zeros(b)
    for i in range(b):
        if gram:
            s = 0.0
            for x, (l1, r1) in enumerate(terms):
                for y in range(x, len(terms)):
                    l2, r2 = terms[y]
                    v = float((_lhs_gram(l1[i], l2[i]) * (r1[i] @ r2[i].T)).sum())
                    s += v if x == y else 2.0 * v
            out[i] = max(s, 0.0)
        else:
            d = np.zeros((rows, cols))
            for lhs, r in terms:
                if lhs.ndim == 2:
                    np.add.at(d, lhs[i], r[i])
                else:
                    d += lhs[i].T @ r[i]
            out[i] = float((d ** 2).sum())
    if not all(math.isfinite(float(v)) for v in out):
        raise RoundingNotMeasured(f"parameter `{first['param']}`'s difference is not finite")
    return out
