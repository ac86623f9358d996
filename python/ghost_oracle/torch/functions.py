"""The capture of functional calls on parameters, where no module handler models them.

A parameter used through a function rather than a modelled module (`nn.MultiheadAttention`'s
`in_proj_weight` and `out_proj`, which its forward passes to `F.linear`; a bare
`nn.Parameter` in `F.linear(x, self.w)` or `x @ self.w`; a module's weight passed to a function
by another module) is seen by a `TorchFunctionMode` during the forward: each call of a function
the registry has a function form of (`kinds/`: `F.linear`, `x @ w`, `F.embedding`,
`F.conv*`, the functional norms, a parameter repeated along the batch) with a trainable
parameter as its weight is a use of its own, with a site per parameter it reads. Inside a
module a handler models, calls are left to that handler. A parameter used any other way has no
site, and the self-check refuses it by name (`coverage.py`).

A call reads its trainable parameters only: one whose weight is frozen (or absent, a norm without
affine weight) has sites for the others, and one that reads none has none. A call with an
option no site kind models (`F.embedding` with `max_norm` or `scale_grad_by_freq`) on a
trainable parameter is refused there, by name and option."""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .errors import TraceExportError
from .kinds.base import FunctionCall, Unmodelled, Use, function_handler, is_function
from .precision import autocast_dtype


class Recorder(Protocol):
    """What the capture needs of the recorder (`record._Recorder`)."""

    trainable: set[int]

    def follow(self, func: Callable[..., Any], args: Any, kwargs: Mapping[str, Any], out: Any) -> None: ...

    def inside_modelled_module(self) -> bool: ...

    def innermost(self) -> tuple[str, torch.nn.Module] | None: ...

    def use_name(self, base: str) -> str: ...

    def add(self, use: Use, output: torch.Tensor) -> torch.Tensor: ...


# Python-level functionals (`F.multi_head_attention_forward`) dispatch to the mode as a whole, and
# the mode is off while it runs them: their own calls of `F.linear` would go unseen. They run
# with the mode on and their dispatch checks answering no, so that the calls inside reach it.
_DISPATCH_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


def _never(*args: object, **kwargs: object) -> bool:
    return False


def _detached(func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> FunctionCall:
    """The call with its arguments without their graph (a replay needs their values only)."""
    return FunctionCall(func, tuple(v.detach() if torch.is_tensor(v) else v for v in args),
                        {k: v.detach() if torch.is_tensor(v) else v for k, v in kwargs.items()})


def _dtype(weight: torch.Tensor, output: torch.Tensor) -> torch.dtype:
    """As `precision.site_dtype`, for a weight passed to a function."""
    ac = autocast_dtype(output.device.type)
    if ac is not None and ac != weight.dtype and output.dtype == ac:
        return ac
    return weight.dtype


class _Capture(TorchFunctionMode):
    def __init__(self, rec: Recorder, names: Mapping[int, str]) -> None:
        super().__init__()
        self.rec, self.names = rec, names

    def __torch_function__(self, func: Callable[..., Any], types: Sequence[type], args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if not is_function(func) and inspect.isfunction(func) and func.__module__ == F.__name__:
            out = self._inside(func, args, kwargs)
            self.rec.follow(func, args, kwargs, out)
            return out
        out = func(*args, **kwargs)
        self.rec.follow(func, args, kwargs, out)  # the batch's examples, followed through every call
        handler = function_handler(func)
        if handler is None or self.rec.inside_modelled_module() or not torch.is_tensor(out) or not out.requires_grad:
            return out
        owner = self.rec.innermost()
        where = owner[0] if owner and owner[0] else "the model"
        fname = getattr(func, "__name__", str(func))
        try:
            found = handler.operands(args, kwargs)
        except Unmodelled as e:
            read = [v for v in list(args) + list(kwargs.values())
                    if isinstance(v, torch.nn.Parameter) and id(v) in self.rec.trainable]
            if not read:
                return out  # no trainable parameter read: nothing to trace, nothing to refuse
            at = f"module `{owner[0]}` ({type(owner[1]).__name__})" if owner and owner[0] else "the model's forward"
            raise TraceExportError(f"{at}: a call of {fname} on parameter `{self.names[id(read[0])]}`: {e}") from None
        if found is None:
            return out
        x = found.input
        params = {k: p for k, p in found.params.items()
                  if isinstance(p, torch.nn.Parameter) and id(p) in self.rec.trainable}
        if not params or not torch.is_tensor(x):
            return out  # it reads no trainable parameter
        if handler.repeats() and out.numel() == x.numel():
            return out  # not repeated: the same tensor under another shape, which no site describes
        site_names = {}
        for attr, p in params.items():
            local = next((k for k, v in owner[1]._parameters.items() if v is p), None) if owner else None
            base = f"{owner[0]}.{local}" if owner is not None and local is not None and owner[0] else self.names[id(p)]
            site_names[attr] = self.rec.use_name(base)
        use = Use(handler=handler, name=f"{where}: {fname}", cls=f"a call of {fname}",
                  module=owner[1] if owner else None, input=x.detach(),
                  dtype=_dtype(params.get("weight", next(iter(params.values()))), out),
                  call=_detached(func, args, kwargs), params=params, site_names=site_names, out_dtype=out.dtype,
                  rows=found.rows, site_kind=found.site_kind)
        return self.rec.add(use, out)


    def _inside(self, func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        saved = {name: getattr(F, name) for name in _DISPATCH_CHECKS}
        try:
            for name in _DISPATCH_CHECKS:
                setattr(F, name, _never)
            with self:
                return func(*args, **kwargs)
        finally:
            for name, f in saved.items():
                setattr(F, name, f)


class _CaptureHandle:
    def __init__(self, mode: _Capture) -> None:
        # Entered through an ExitStack: torch's mode methods carry no annotations.
        self.mode: contextlib.ExitStack[bool | None] | None = contextlib.ExitStack()
        self.mode.enter_context(mode)

    def remove(self) -> None:
        if self.mode is not None:
            self.mode.close()
            self.mode = None


def function_capture(rec: Recorder, names: Mapping[int, str]) -> _CaptureHandle:
    """Starts capturing; the handle's `remove()` stops it (at most once)."""
    return _CaptureHandle(_Capture(rec, names))
