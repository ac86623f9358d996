"""The rounding each precision allows, by the name a trace gives it ("f64", "f32", "f16",
"bf16"), and the tolerance of the self-check (`check.py`) that follows from it. Both exporters
map their own dtypes to these names; the numbers live here once."""
from __future__ import annotations

import math

import numpy as np

from .site import PRECISIONS, Precision

#: (machine epsilon, smallest normal) of each precision.
LIMITS: dict[Precision, tuple[float, float]] = {
    "f64": (2.0**-52, 2.0**-1022), "f32": (2.0**-23, 2.0**-126), "f16": (2.0**-10, 2.0**-14),
    "bf16": (2.0**-7, 2.0**-126)}
assert set(LIMITS) == set(PRECISIONS)  # a precision the trace records without limits is a bug here


def unit_roundoff(precision: Precision) -> float:
    """Half the machine epsilon: the relative error of one rounding to nearest."""
    return LIMITS[precision][0] / 2


def smallest_normal(precision: Precision) -> float:
    return LIMITS[precision][1]


def smallest_subnormal(precision: Precision) -> float:
    eps, normal = LIMITS[precision]
    return normal * eps


def low_precision(precision: Precision) -> bool:
    """bf16 and f16: kernels take their products and accumulate them in f32, and store the
    result rounded back."""
    return unit_roundoff(precision) > unit_roundoff("f32")


def coarsest(precisions: list[Precision]) -> Precision:
    """The precision with the largest rounding among `precisions` (not empty)."""
    return max(precisions, key=unit_roundoff)


def reduction_tolerance(absum: np.ndarray, site: Precision, store: Precision, n: int,
                        low_precision_rounds: np.ndarray | float | None = None,
                        mass: np.ndarray | float = 1.0) -> np.ndarray:
    """How far the framework's batch gradient of one site may lie from the gradient rebuilt (in
    f64) from its stored factors, entry by entry; `absum` is Σ|terms|, n the number of terms per
    entry (B·rows).

    - f32 / f64 sites: the framework reduces the n terms in the site's precision, and an x̂
      recomputed here may differ from the forward's by a few ulps: 2·(n + 16)·u·Σ|terms|.
    - bf16 / f16 sites (a bf16 or f16 model, or a matmul under autocast): the factors are stored
      exactly as the kernel saw them; products are exact in f32 or rounded once to the low
      precision (an RMSNorm's δ ⊙ x̂), accumulated in f32 (up to log2 n partial sums rounded to
      the low precision, as split reductions do), and the result is rounded to the low precision:
      k·u·Σ|terms| plus the f32 accumulation, with k = 4 + log2 n unless the kind states its own
      (`low_precision_rounds`, per entry: an embedding's backward rounds once per occurrence of
      an id). Products and results that underflow lose up to half the smallest subnormal each.
    - factors stored in a coarser precision than the site computed in: each of the two factors
      of a term rounded once, 3·u_store·Σ|terms|.
    A site that is wrong by a structural factor (a missing scale, a skipped use, a wrong
    position) is off by a fraction of Σ|terms| itself.

    For a sketched check (`absum` is Σ|terms|·|v|, entries of the gradient times a probe matrix
    v) the bound is the same sum of the entries' bounds: everything above is linear in Σ|terms|,
    and the one constant (the underflow) is scaled by `mass`, the column sums of |v|."""
    u = unit_roundoff(site)
    if low_precision(site):
        k = 4.0 + math.log2(max(n, 2)) if low_precision_rounds is None else low_precision_rounds
        tol = (k * u * absum + 2.0 * (n + 16) * unit_roundoff("f32") * absum
               + (n + 4) * smallest_subnormal(site) / 2 * mass)
    else:
        tol = 2.0 * (n + 16) * u * absum
    us = unit_roundoff(store)
    if us > u:
        tol = tol + 3.0 * us * absum
    return np.asarray(tol)
