"""The claimed step: the library's clipped sum and update per parameter, checked against the
model before they are written."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from .precision import DTYPE_NAMES

STEP_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _resolve_step(model: torch.nn.Module, what: str, tensors: object,
                  names: Mapping[int, str]) -> dict[str, tuple[torch.nn.Parameter, torch.Tensor]]:
    """`tensors` (a mapping from parameter names to the library's tensors) keyed by each
    parameter's trace name (its `param`), checked against the model: every name is a trainable
    parameter (a tied one under any of its names, once), every value a floating-point tensor with
    the parameter's number of elements. Returns {param: (parameter, tensor)}."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"{what} must be a dict from parameter names to tensors, got {type(tensors).__name__}")
    by_name = dict(model.named_parameters(remove_duplicate=False))
    out: dict[str, tuple[torch.nn.Parameter, torch.Tensor]] = {}
    given_as: dict[str, str] = {}
    for key, t in tensors.items():
        p = by_name.get(key)
        if p is None:
            near = ", ".join(f"`{n}`" for n in list(dict.fromkeys(names.values()))[:6])
            raise ValueError(f"{what}: `{key}` is not a parameter of the model (its parameters are named like "
                             f"{near}, ...)")
        param = names[id(p)]
        if not p.requires_grad:
            raise ValueError(f"{what}: parameter `{key}` is not trainable (requires_grad=False): it is not part "
                             "of the step")
        if param in out:
            raise ValueError(f"{what}: parameter `{param}` is given twice, as `{given_as[param]}` and `{key}` "
                             "(one tied parameter): give it once")
        if not torch.is_tensor(t):
            raise ValueError(f"{what}: the value for parameter `{key}` is a {type(t).__name__}, not a tensor")
        if t.dtype not in STEP_DTYPES:
            raise ValueError(f"{what}: the tensor for parameter `{key}` has dtype {t.dtype}; the trace stores "
                             f"{', '.join(DTYPE_NAMES[d] for d in STEP_DTYPES)}")
        if t.numel() != p.numel():
            raise ValueError(f"{what}: the tensor for parameter `{key}` has shape {list(t.shape)} ({t.numel()} "
                             f"elements); the parameter has shape {list(p.shape)} ({p.numel()} elements)")
        out[param] = (p, t)
        given_as[param] = key
    return out
