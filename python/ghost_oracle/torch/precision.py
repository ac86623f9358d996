"""Precision: the dtype each use really computed in, and the rounding each precision allows."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

DTYPE_NAMES = {torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}

# The finest precision first: the first in which a norm's product with its weight reproduces the
# module's output is the precision its weight's gradient is computed in.
PRECISIONS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def unit_roundoff(dt: torch.dtype) -> float:
    return torch.finfo(dt).eps / 2


def low_precision(dt: torch.dtype) -> bool:
    """bf16 and f16: kernels take their products and accumulate them in f32, and store the
    result rounded back."""
    return unit_roundoff(dt) > unit_roundoff(torch.float32)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """Autocast's dtype where autocast is enabled for `device_type` at this point of the forward,
    else None."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    except (TypeError, RuntimeError, AttributeError):  # torch < 2.4, or a device type autocast lacks
        if device_type == "cpu" and hasattr(torch, "is_autocast_cpu_enabled"):
            return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
        if device_type == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
        return None


def autocast_state(device_type: str) -> tuple[str, torch.dtype] | None:
    """(device type, dtype) of the autocast enabled at this point of the forward, else None: a
    norm's forward is replayed under it."""
    ac = autocast_dtype(device_type)
    return None if ac is None else (device_type, ac)


def site_dtype(module: torch.nn.Module, output: torch.Tensor) -> torch.dtype:
    """The dtype `module`'s use computed in: autocast's, where autocast lowered the op (enabled
    for the output's device type, and the output in autocast's dtype instead of the weight's),
    else the weight's."""
    weight = getattr(module, "weight", None)
    if not torch.is_tensor(weight):
        return output.dtype  # refused when its sites are built, naming the module
    w = weight.dtype
    ac = autocast_dtype(output.device.type)
    if ac is not None and ac != w and output.dtype == ac:
        return ac
    return w


def compute_dtype(model: torch.nn.Module, error: Callable[[str], Exception]) -> torch.dtype:
    """The precision the model computes in: its trainable parameters' dtype (the coarsest, if
    they differ)."""
    dts = {p.dtype for p in model.parameters() if p.requires_grad and p.is_floating_point()}
    if not dts:
        raise error("the model has no trainable floating-point parameter")
    return max(dts, key=unit_roundoff)


def reduction_tolerance(absum: torch.Tensor, site_dtype: torch.dtype, store_dtype: torch.dtype, n: int,
                        low_precision_rounds: torch.Tensor | float | None = None,
                        mass: torch.Tensor | float = 1.0) -> torch.Tensor:
    """How far autograd's batch gradient of one site may lie from the gradient rebuilt (in f64)
    from its stored factors, entry by entry; `absum` is Σ|terms|, n the number of terms per
    entry (B·rows).

    - f32 / f64 sites: autograd reduces the n terms in the site's precision, and an x̂
      recomputed here may differ from the forward's by a few ulps: 2·(n + 16)·u·Σ|terms|.
    - bf16 / f16 sites (a bf16 or f16 model, or a matmul under autocast): the factors are stored
      exactly as the kernel saw them; products are exact in f32 or rounded once to the low
      precision (an RMSNorm's δ ⊙ x̂), accumulated in f32 (up to log2 n partial sums rounded to
      the low precision, as split reductions do), and the result is rounded to the low precision:
      k·u·Σ|terms| plus the f32 accumulation, with k = 4 + log2 n unless the kind states its own
      (`low_precision_rounds`, per entry: an embedding's backward rounds once per occurrence of
      an id). Products and results that underflow lose up to half the smallest subnormal each.
    - factors stored in a coarser dtype than the site computed in: each of the two factors of a
      term rounded once, 3·u_store·Σ|terms|.
    A site that is wrong by a structural factor (a missing scale, a skipped use, a wrong
    position) is off by a fraction of Σ|terms| itself.

    For a sketched check (`absum` is Σ|terms|·|v|, entries of the gradient times a probe matrix
    v) the bound is the same sum of the entries' bounds: everything above is linear in Σ|terms|,
    and the one constant (the underflow) is scaled by `mass`, the column sums of |v|."""
    import math

    u = unit_roundoff(site_dtype)
    if low_precision(site_dtype):
        k = 4.0 + math.log2(max(n, 2)) if low_precision_rounds is None else low_precision_rounds
        sub = torch.finfo(site_dtype).smallest_normal * torch.finfo(site_dtype).eps  # smallest subnormal
        tol = k * u * absum + 2.0 * (n + 16) * unit_roundoff(torch.float32) * absum + (n + 4) * sub / 2 * mass
    else:
        tol = 2.0 * (n + 16) * u * absum
    us = unit_roundoff(store_dtype)
    if us > u:
        tol = tol + 3.0 * us * absum
    return tol


def with_islands(specs: list[dict[str, Any]], compute_dtype: torch.dtype, island: torch.dtype | None) -> torch.dtype:
    """The trace's precision once the forward's float32 islands are counted: a model that casts
    tensors on its gradient's path down to `island` (Hugging Face's Llama, Qwen3 and Gemma 3
    compute their RMSNorms and the eager softmax in float32 inside a float64 model) computes
    every example's gradient to `island`'s rounding, whatever its parameters' dtype, so every
    site, and the header, is at least that coarse: a clipper that reweights the backprops before
    the islands (Opacus's ghost second pass) is off from Σ c_i g_i by `island`'s rounding, not
    the parameters'. Sets the sites' own `compute_dtype` where they still differ; returns the
    header's."""
    if island is None or not unit_roundoff(island) > unit_roundoff(compute_dtype) and not any(
            "compute_dtype" in s for s in specs):
        return compute_dtype
    by_name = {v: k for k, v in DTYPE_NAMES.items()}
    header = max(compute_dtype, island, key=unit_roundoff)
    own = [max(by_name[s.get("compute_dtype", DTYPE_NAMES[compute_dtype])], island, key=unit_roundoff) for s in specs]
    for s, dt in zip(specs, own, strict=True):
        s.pop("compute_dtype", None)
        if len(set(own)) > 1:
            s["compute_dtype"] = DTYPE_NAMES[dt]
    return header
