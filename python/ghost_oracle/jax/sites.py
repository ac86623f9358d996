"""What a captured use of a parameter becomes: sites (docs/trace-format.md) with numpy factors,
and the map from the parameter's own array to the layout its sites write (`to_trace_layout`),
which the claimed step tensors and the self-check go through."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import ml_dtypes
import numpy as np

from .._trace import site as core
from .._trace.format import TraceExportError

# numpy dtype name -> the trace's precision name
PRECISION_OF = {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def precision_of(dtype: Any, where: str) -> str:
    name = np.dtype(dtype).name
    if name not in PRECISION_OF:
        raise TraceExportError(f"{where} computed in {name}; traces record float64, float32, float16 and bfloat16")
    return PRECISION_OF[name]


def identity_layout(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1)


@dataclass
class Call:
    """One call of a modelled module method: its path in the model, the arguments the handler
    reads (concrete arrays, and static values such as an einsum equation), its output's shape
    and dtype, the gradient of the summed loss with respect to that output (per example along
    axis 0: the probes found each example's loss reaching its own slice alone, `probes.py`),
    and the module's own parameters (under nn.scan, its layer's slice). A use shared by every
    example (`shared`) has its input repeated for every example and its per-example output
    gradients stacked instead."""

    path: tuple[str, ...]
    cls: str
    method: str
    index: int  # 0 for the module's first call of this method, k for the k-th after it
    args: tuple[Any, ...]
    out_dtype: Any
    out_shape: tuple[int, ...]
    module: Any  # an unbound clone of the module, for a replay
    params: dict[str, np.ndarray] = field(default_factory=dict)
    grad: np.ndarray | None = None
    # the layer of each nn.scan over layers the call is inside, outermost first: its parameters
    # are those layers' slices of the stacked ones
    layer: tuple[int, ...] = ()
    key: str = ""  # the name of the call's output perturbation
    shared: bool = False  # computed from no example of the batch, its factors repeated per example

    @property
    def where(self) -> str:
        name = ".".join(self.path) or "<root>"
        return f"module `{name}` ({self.cls}.{self.method}{''.join(f', layer {i}' for i in self.layer)})"

    def param(self, name: str) -> str:
        """The trace's name of the module's parameter `name`: the Flax path joined with '.', and
        under nn.scan the layer's slice of the stacked parameter, `layers.attn.q.kernel[l]`."""
        return ".".join((*self.path, name)) + "".join(f"[{i}]" for i in self.layer)


@dataclass
class Site:
    """One site of the trace: its header entry, its tensors (B×R leading), the parameter it
    writes, and how that parameter's own array maps to the layout the site writes."""

    kind: str
    param: str
    tensors: dict[str, np.ndarray]
    precision: str
    call: Call
    vocab: int | None = None
    to_trace_layout: Callable[[np.ndarray], np.ndarray] = identity_layout
    layout_name: str = "identity"
    name: str = ""

    def handover(self) -> core.Site[np.ndarray]:
        """The site as the shared core (`ghost_oracle._trace`) takes it: bfloat16 factors as
        their raw bits (a view, not a copy)."""
        if self.kind not in core.SITE_KINDS or self.precision not in core.PRECISIONS:
            raise TraceExportError(f"{self.call.where}: a site of kind {self.kind!r} in {self.precision!r}; traces "
                                   f"hold {list(core.SITE_KINDS)} in {list(core.PRECISIONS)}")
        return core.Site(name=self.name, param=self.param, kind=self.kind,
                         tensors={k: raw_bits(v) for k, v in self.tensors.items()},
                         precision=self.precision, origin=self.call.where, vocab=self.vocab)

    def spec(self) -> dict[str, Any]:
        return self.handover().spec()


def raw_bits(a: np.ndarray) -> np.ndarray:
    """`a` as the shared core holds it: a bfloat16 array as its raw bits in uint16 (numpy has no
    bfloat16 of its own), a view of the same memory; any other array as it is."""
    return a.view(np.uint16) if a.dtype == ml_dtypes.bfloat16 else a


class Handler(Protocol):
    """A module kind: which arguments of a call it records, and the sites a call becomes."""

    def record(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]: ...

    def sites(self, call: Call, batch: int) -> Sequence[Site]: ...


def rows(a: np.ndarray, batch: int, width: int, what: str, call: Call) -> np.ndarray:
    """`a` as B×R×width (every axis between the batch and the features is a row)."""
    if a.ndim < 2 or a.shape[0] != batch or width < 1 or a.size % (batch * width) != 0:
        raise TraceExportError(f"{call.where}: its {what} has shape {list(a.shape)}; expected the batch "
                               f"({batch}) on axis 0 and {width} features per row")
    return a.reshape(batch, -1, width)


def grad_of(call: Call) -> np.ndarray:
    if call.grad is None:
        raise TraceExportError(f"{call.where}: no output gradient was captured")
    return call.grad
