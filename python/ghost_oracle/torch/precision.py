"""Precision in PyTorch terms: the dtype each use really computed in (autocast, the model's
parameters, the forward's float32 islands), and the map between torch dtypes and the names a
trace gives precisions. The rounding each precision allows, and the self-check's tolerance, are
numbers of the precision alone (`ghost_oracle._trace.precision`)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._trace.precision import unit_roundoff as named_unit_roundoff
from .._trace.site import Precision

DTYPE_NAMES: dict[torch.dtype, Precision] = {torch.float64: "f64", torch.float32: "f32", torch.float16: "f16",
                                             torch.bfloat16: "bf16"}

# The finest precision first: the first in which a norm's product with its weight reproduces the
# module's output is the precision its weight's gradient is computed in.
PRECISIONS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def unit_roundoff(dt: torch.dtype) -> float:
    """`dt`'s unit roundoff: a trace's precisions by name (`_trace.precision`), any other
    floating dtype (one a model may hold, which the exporter then refuses by name) from torch."""
    name = DTYPE_NAMES.get(dt)
    return named_unit_roundoff(name) if name is not None else torch.finfo(dt).eps / 2


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
