"""The self-check of a PyTorch trace: nothing is written unless every trainable parameter that
received a gradient is accounted for by its sites (`coverage.py`), and the batch gradient
rebuilt from their factors (as stored) equals autograd's `p.grad` to rounding, each site at its
own precision. The rebuild, its blocks and sketch, and the tolerance are the check both
exporters share (`ghost_oracle._trace.check`); this hands it each parameter's sites and
gradient as numpy arrays, one parameter at a time."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .._trace.check import Against, check_parameter
from .coverage import covered_parameters
from .errors import TraceExportError
from .kinds.base import Site, numpy_site
from .precision import DTYPE_NAMES

AUTOGRAD = Against("autograd", "The module's forward is not what the exporter models (a subclass that changes "
                               "forward, a scale or cast inside it, a class declared with register_module that "
                               "does not compute what its kind computes)")


def self_check(model: torch.nn.Module, sites: Sequence[Site[torch.Tensor]], names: Mapping[int, str],
               owners: Mapping[int, list[tuple[str, str]]], store_dtype: torch.dtype | None,
               progress: Any = None) -> None:
    """Raises unless every trainable parameter that received a gradient has a site
    (`coverage.py`) and its sites' factors rebuild autograd's gradient to rounding, each site at
    its own precision (`store_dtype` None: each site stored in its own)."""
    by_param: dict[str, list[Site[torch.Tensor]]] = {}
    for site in sites:
        by_param.setdefault(site.param, []).append(site)
    params = covered_parameters(model, by_param, names, owners)
    store = None if store_dtype is None else DTYPE_NAMES[store_dtype]
    for n, p in enumerate(params):
        if progress is not None:
            progress.step("self-check against autograd, parameters", n, len(params))
        assert p.grad is not None  # covered_parameters keeps the parameters that received a gradient
        name = names[id(p)]
        mods = ", ".join(f"`{m}` ({c})" for m, c in owners.get(id(p), []))
        parameter = f"parameter `{name}` (module {mods})"
        precision = DTYPE_NAMES.get(p.dtype)
        if precision is None:
            raise TraceExportError(f"{parameter} is {p.dtype}; traces record {list(DTYPE_NAMES)}")
        on_tile = None if progress is None else _tiles_of(progress, name, n, len(params))
        check_parameter(parameter, [numpy_site(s) for s in by_param[name]], host_array(p.grad), precision,
                        store, AUTOGRAD, on_tile=on_tile)


def _tiles_of(progress: Any, name: str, n: int, count: int) -> Callable[[int, int], None]:
    """The progress of one parameter's check a tile of examples at a time (a convolution stored
    as its input is rebuilt so: at a CNN's batch sizes one parameter takes seconds)."""
    def on_tile(done: int, total: int) -> None:
        progress.step(f"self-check against autograd, parameter {n + 1}/{count} `{name}`, tiles of examples", done,
                      total)
    return on_tile


def host_array(t: torch.Tensor) -> np.ndarray:
    """`t` flattened as a numpy array on the host, in its own dtype (a view where it already is
    on the host; a tensor on an accelerator copied once, not widened): a bfloat16 tensor as its
    raw bits in uint16, as `_trace` holds bfloat16."""
    t = t.detach().reshape(-1).cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()

