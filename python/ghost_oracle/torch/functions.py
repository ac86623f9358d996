"""Functional calls on parameters, captured where no module handler models them.

A parameter used through a function rather than a modelled module (`nn.MultiheadAttention`'s
`in_proj_weight` and `out_proj`, which its forward passes to `F.linear`; a bare
`nn.Parameter` in `F.linear(x, self.w)` or `x @ self.w`; a module's weight passed to a function
by another module) is seen by a `TorchFunctionMode` during the forward: each call of a
function below with a trainable parameter as its weight is a use of its own, with a site per
parameter it reads. Inside a module a handler models (`kinds/`), calls are left to that
handler. A parameter used any other way has no site, and the self-check refuses it by name.

- `F.linear(x, w, b)`: a linear site (w out×in) and a bias site; w and b may be blocks of a
  parameter's rows (`nn.MultiheadAttention`'s query, key and value rows of `in_proj_weight`);
- `x @ w`, `torch.matmul(x, w)` with w a 2-D parameter on the right: a conv1d site (w in×out);
- `F.embedding(ids, w, padding_idx)`: an embedding site;
- `F.conv1d/2d/3d`: a linear site over unfolded patches (`kinds/conv.py`);
- `F.layer_norm`, `F.rms_norm`, `F.group_norm`, `F.instance_norm`: a layernorm site, x̂ the same
  call without its weight and bias;
- `p.repeat(...)`, `p.expand(...)`, `p.expand_as(t)`, `p.tile(...)`, `torch.tile(p, ...)` of a
  parameter along the batch (`nn.MultiheadAttention`'s `bias_k` and `bias_v`, appended to every
  example's keys and values as `bias_k.repeat(1, B, 1)`; a class token `cls.expand(B, -1, -1)`):
  each example reads the parameter as is, so its gradient is the sum of its copies' output
  gradients: a bias site, one row per copy in the example's slice.

A call reads its trainable parameters only: one whose weight is frozen (or absent, a norm without
affine weight) has sites for the others, and one that reads none has none. A call with an
option no site kind models (`F.embedding` with `max_norm` or `scale_grad_by_freq`) on a
trainable parameter is refused there, by name and option."""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .errors import TraceExportError
from .kinds.base import Handler, Site, Use
from .kinds.channel_norm import ChannelNorm
from .kinds.conv import Conv, Geometry
from .kinds.embedding import Embedding
from .kinds.linear import Linear
from .kinds.norm import Norm
from .layout import _describe
from .precision import autocast_dtype

if TYPE_CHECKING:
    from .record import _Recorder

#: What a call reads: (its input, {"weight"/"bias": tensor}[, fields for its use's entry]).
Operands = tuple[Any, dict[str, Any]] | tuple[Any, dict[str, Any], dict[str, Any]]


def _arg(args: Sequence[Any], kwargs: Mapping[str, Any], i: int, name: str) -> Any:
    return args[i] if len(args) > i else kwargs.get(name)


class Unmodelled(Exception):
    """Raised by `operands` for a call with an option no site kind models; the capture refuses the
    call with this reason where it reads a trainable parameter."""


class FunctionHandler(Handler):
    """A handler for a function: `operands` picks the input and the parameters a call reads."""

    def operands(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Operands | None:
        """(input, {attr: tensor}[, entry fields]) of a call, attrs "weight" and "bias"; None to
        leave it."""
        raise NotImplementedError


def _row_block(t: Any) -> tuple[Any, tuple[int, int] | None]:
    """(the parameter, its rows [r0, r1)) where `t` is a block of whole rows of a parameter (a
    `chunk`, `split` or `narrow` along its first axis: `nn.MultiheadAttention` splits
    `in_proj_weight` and `in_proj_bias` into the query's, key's and value's rows unless the three
    inputs are one tensor); (t, None) otherwise."""
    base = getattr(t, "_base", None) if torch.is_tensor(t) and not isinstance(t, torch.nn.Parameter) else None
    if not isinstance(base, torch.nn.Parameter) or base.dim() != t.dim() or t.dim() == 0 or \
            tuple(t.shape[1:]) != tuple(base.shape[1:]) or t.stride() != base.stride() or base.stride(0) == 0:
        return t, None
    offset = t.storage_offset() - base.storage_offset()
    if offset % base.stride(0) != 0:
        return t, None
    r0 = offset // base.stride(0)
    if r0 < 0 or r0 + t.shape[0] > base.shape[0]:
        return t, None
    return base, (r0, r0 + t.shape[0])


class FnLinear(FunctionHandler, Linear):
    """`F.linear(x, w, b)`, w and b parameters or blocks of their rows: a block's site is the
    whole parameter's, its backprops 0 outside the block's rows (exact: those rows receive no
    gradient from this call)."""

    def operands(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Operands | None:
        params: dict[str, Any] = {}
        rows: dict[str, tuple[int, int]] = {}
        for attr, k in (("weight", 1), ("bias", 2)):
            params[attr], block = _row_block(_arg(args, kwargs, k, attr))
            if block is not None:
                rows[attr] = block
        return _arg(args, kwargs, 0, "input"), params, {"rows": rows}

    def sites(self, use: Use) -> Iterator[Site]:
        rows: dict[str, tuple[int, int]] = use.entry.get("rows") or {}
        if not rows:
            yield from super().sites(use)
            return
        if not use.reads_trainable("weight", "bias"):
            return
        g = use.per_example(use.grad, "output gradient")

        def backprops(attr: str) -> torch.Tensor:
            block = rows.get(attr)
            if block is None:
                return g
            full = g.new_zeros(*g.shape[:-1], use.param(attr).shape[0])
            full[..., block[0]:block[1]] = g
            return full

        if use.trainable(use.weight(self.kind)):
            x = use.per_example(use.input, "input").to(use.dtype)
            yield use.spec("weight", self.site_kind(use)), {"activations": x.to(use.store),
                                                             "backprops": backprops("weight").to(use.store)}
        if use.trainable(use.param("bias")):
            yield from use.bias_site(backprops("bias"))


class FnMatmul(FunctionHandler, Linear):
    """`x @ w` is a conv1d site (w in×out); `x @ w.T`, w's transpose (a tied head written as
    `h @ embedding.weight.T`), a linear site of w (out×in)."""

    def operands(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Operands | None:
        x, w = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "other")
        if not torch.is_tensor(w) or w.dim() != 2:
            return None
        if isinstance(w, torch.nn.Parameter):
            return x, {"weight": w}, {"site_kind": "conv1d"}
        base = w._base
        if (isinstance(base, torch.nn.Parameter) and base.dim() == 2 and w.shape == base.shape[::-1]
                and w.stride() == base.stride()[::-1] and w.data_ptr() == base.data_ptr()):
            return x, {"weight": base}, {"site_kind": "linear"}
        return None

    def site_kind(self, use: Use) -> str:
        return cast(str, use.entry["site_kind"])


class FnEmbedding(FunctionHandler, Embedding):
    def operands(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Operands | None:
        max_norm = _arg(args, kwargs, 3, "max_norm")
        if max_norm is not None:
            raise Unmodelled(f"max_norm={max_norm} is not modelled: the call renormalizes, in place, the rows of the "
                             "table it looks up, so it changes the parameter it reads")
        if _arg(args, kwargs, 5, "scale_grad_by_freq"):
            raise Unmodelled("scale_grad_by_freq=True divides each row's gradient by the number of times its id "
                             "occurs in the whole batch, so one example's gradient depends on the other examples' "
                             "ids: no per-example gradient is defined")
        return _arg(args, kwargs, 0, "input"), {"weight": _arg(args, kwargs, 1, "weight")}

    def padding_idx(self, use: Use) -> int | None:
        p = use.entry["padding_idx"]
        return None if p is None else p % use.param("weight").shape[0]  # a negative index counts from the end

    def check_options(self, use: Use) -> None:
        pass  # `operands` refuses the calls with options it does not model


class FnConv(FunctionHandler, Conv):
    """`F.conv1d/2d/3d(x, w, b, stride, padding, dilation, groups)`."""

    def operands(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Operands | None:
        w = _arg(args, kwargs, 1, "weight")
        if not torch.is_tensor(w):
            return None
        geo = Geometry(w, _arg(args, kwargs, 3, "stride") or 1, _arg(args, kwargs, 4, "padding") or 0,
                       _arg(args, kwargs, 5, "dilation") or 1, _arg(args, kwargs, 6, "groups") or 1)
        return _arg(args, kwargs, 0, "input"), {"weight": w, "bias": _arg(args, kwargs, 2, "bias")}, {"geometry": geo}

    def geometry(self, use: Use) -> Geometry:
        return cast(Geometry, use.entry["geometry"])


class FnRepeat(FunctionHandler):
    """A parameter repeated or broadcast along new or size-1 axes (`repeat`, `expand`,
    `expand_as`, `tile`): the output is tiles of the parameter, tile-major along every axis, and
    the parameter's gradient is the sum of its tiles' output gradients. Each example's tiles are
    its slice along its batch axis (which the parameter must not vary along): a bias site whose
    rows are the example's tiles and whose features are the parameter's entries, row-major."""

    kind: str = "bias"

    def operands(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Operands | None:
        p = _arg(args, kwargs, 0, "input")
        return (p, {"bias": p}) if isinstance(p, torch.nn.Parameter) else None

    def sites(self, use: Use) -> Iterator[Site]:
        p = use.param("bias")
        if not use.trainable(p):
            return
        g = use.grad
        n = g.dim()
        if p.dim() > n:
            raise use.error(f"its output has shape {list(g.shape)}, fewer axes than the parameter's {list(p.shape)}")
        size = (1,) * (n - p.dim()) + tuple(p.shape)  # the parameter's tile, aligned on the output's axes
        if any(o % s_k for o, s_k in zip(g.shape, size, strict=True)):
            raise use.error(f"its output {list(g.shape)} is not whole tiles of the parameter {list(p.shape)}")
        reps = [o // s_k for o, s_k in zip(g.shape, size, strict=True)]
        layout = use.entry["layout"]
        a = layout[1]
        if layout[0] != "axis" or size[a] != 1:
            raise use.error(f"its output {list(g.shape)} holds the examples along {_describe(layout)}, where the "
                            f"parameter {list(p.shape)} is not repeated: each example reads its own part of the "
                            "parameter, which a bias site (each example reads all of it) does not describe")
        # (r_0, s_0, r_1, s_1, …): each axis split into its tiles and the tile's entries
        tiled = g.reshape([d for r, s_k in zip(reps, size, strict=True) for d in (r, s_k)])
        rep_axes = [2 * k for k in range(n) if k != a]
        tiled = tiled.permute([2 * a] + rep_axes + [2 * k + 1 for k in range(n)])
        yield use.spec("bias", "bias"), {"backprops": tiled.reshape(use.b, -1, p.numel()).to(use.store)}


def _without_affine(use: Use | _Replay, position: int) -> torch.Tensor:
    """The recorded call again, its weight and bias (from argument `position` on) left out: x̂,
    in the precision the call computed in."""
    func, args, kwargs = use.entry["call"]
    args = list(args)
    for k in range(position, min(len(args), position + 2)):
        args[k] = None
    kwargs = {k: (None if k in ("weight", "bias") else v) for k, v in kwargs.items()}
    with torch.no_grad():
        xhat: torch.Tensor = func(*args, **kwargs)
    return xhat


class FnLayerNorm(FunctionHandler, Norm):
    """`F.layer_norm(x, shape, w, b, eps)` and `F.rms_norm(x, shape, w, eps)`: x̂ is the same
    call without its weight and bias, and the product with the weight runs in the output's
    precision."""

    def operands(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Operands | None:
        return _arg(args, kwargs, 0, "input"), {"weight": _arg(args, kwargs, 2, "weight"),
                                                 "bias": _arg(args, kwargs, 3, "bias")}

    def normalized(self, use: Use) -> tuple[torch.Tensor, torch.dtype]:
        return _without_affine(use, 2), use.entry["out_dtype"]

    def centred(self, use: Use) -> float | None:
        _, args, kwargs = use.entry["call"]
        eps = _arg(args, kwargs, 4, "eps")
        return 1e-5 if eps is None else float(eps)


class FnRmsNorm(FnLayerNorm):
    def centred(self, use: Use) -> float | None:
        return None  # x / rms(x) is ±1 on a row of equal values, not 0

    def operands(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Operands | None:
        return _arg(args, kwargs, 0, "input"), {"weight": _arg(args, kwargs, 2, "weight")}


class FnGroupNorm(FunctionHandler, ChannelNorm):
    """`F.group_norm(x, groups, w, b, eps)`."""

    def operands(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Operands | None:
        return _arg(args, kwargs, 0, "input"), {"weight": _arg(args, kwargs, 2, "weight"),
                                                 "bias": _arg(args, kwargs, 3, "bias")}

    def normalized(self, use: Use) -> torch.Tensor:
        return _without_affine(use, 2)

    def groups(self, use: Use) -> tuple[int, float] | None:
        _, args, kwargs = use.entry["call"]
        eps = _arg(args, kwargs, 4, "eps")
        return int(_arg(args, kwargs, 1, "num_groups")), 1e-5 if eps is None else float(eps)


class FnInstanceNorm(FunctionHandler, ChannelNorm):
    """`F.instance_norm(x, running_mean, running_var, w, b, use_input_stats, momentum, eps)`:
    replayed without weight and bias, on copies of the running statistics."""

    def operands(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Operands | None:
        return _arg(args, kwargs, 0, "input"), {"weight": _arg(args, kwargs, 3, "weight"),
                                                 "bias": _arg(args, kwargs, 4, "bias")}

    def normalized(self, use: Use) -> torch.Tensor:
        func, args, kwargs = use.entry["call"]
        args = [a.clone() if k in (1, 2) and torch.is_tensor(a) else a for k, a in enumerate(args)]
        kwargs = {k: (v.clone() if k in ("running_mean", "running_var") and torch.is_tensor(v) else v)
                  for k, v in kwargs.items()}
        return _without_affine(_Replay(func, args, kwargs), 3)

    def groups(self, use: Use) -> tuple[int, float] | None:
        _, args, kwargs = use.entry["call"]
        use_input_stats = _arg(args, kwargs, 5, "use_input_stats")
        if use_input_stats is False:
            return None  # normalized by the running statistics
        eps = _arg(args, kwargs, 7, "eps")
        return use.input.shape[1], 1e-5 if eps is None else float(eps)


class _Replay:
    """A stand-in use for `_without_affine`: just the call."""

    def __init__(self, func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        self.entry = {"call": (func, args, kwargs)}


# `x @ w` reaches the mode as the tensor method `matmul`, `torch.matmul(x, w)` as the function.
FUNCTIONS = {F.linear: FnLinear(), torch.matmul: FnMatmul(), torch.Tensor.matmul: FnMatmul(),
             torch.Tensor.__matmul__: FnMatmul(), F.embedding: FnEmbedding(), F.conv1d: FnConv(),
             F.conv2d: FnConv(), F.conv3d: FnConv(), F.layer_norm: FnLayerNorm(), F.group_norm: FnGroupNorm(),
             F.instance_norm: FnInstanceNorm()}
if hasattr(F, "rms_norm"):
    FUNCTIONS[F.rms_norm] = FnRmsNorm()
_repeat = FnRepeat()
for _f in (torch.Tensor.repeat, torch.Tensor.expand, torch.Tensor.expand_as, torch.Tensor.tile, torch.tile):
    FUNCTIONS[_f] = _repeat

# Python-level functionals (`F.multi_head_attention_forward`) dispatch to the mode as a whole, and
# the mode is off while it runs them: their own calls of `F.linear` would go unseen. They run
# with the mode on and their dispatch checks answering no, so that the calls inside reach it.
_DISPATCH_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


def _never(*args: object, **kwargs: object) -> bool:
    return False


def _detached(values: Mapping[str, Any] | Sequence[Any]) -> dict[str, Any] | tuple[Any, ...]:
    """The call's arguments without their graph (a replay needs their values only)."""
    if isinstance(values, dict):
        return {k: v.detach() if torch.is_tensor(v) else v for k, v in values.items()}
    return tuple(v.detach() if torch.is_tensor(v) else v for v in values)


def _dtype(weight: torch.Tensor, output: torch.Tensor) -> torch.dtype:
    """As `precision.site_dtype`, for a weight passed to a function."""
    ac = autocast_dtype(output.device.type)
    if ac is not None and ac != weight.dtype and output.dtype == ac:
        return ac
    return weight.dtype


class _Capture(TorchFunctionMode):
    def __init__(self, rec: _Recorder, names: Mapping[int, str]) -> None:
        super().__init__()
        self.rec, self.names = rec, names

    def __torch_function__(self, func: Callable[..., Any], types: Sequence[type], args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in FUNCTIONS and inspect.isfunction(func) and func.__module__ == F.__name__:
            out = self._inside(func, args, kwargs)
            self.rec.follow(func, args, kwargs, out)
            return out
        out = func(*args, **kwargs)
        self.rec.follow(func, args, kwargs, out)  # the batch's examples, followed through every call
        handler = FUNCTIONS.get(func)
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
        x, params = found[0], found[1]
        extra = found[2] if len(found) > 2 else {}
        params = {k: p for k, p in params.items()
                  if isinstance(p, torch.nn.Parameter) and id(p) in self.rec.trainable}
        if not params or not torch.is_tensor(x):
            return out  # it reads no trainable parameter
        if handler is _repeat and out.numel() == x.numel():
            return out  # not repeated: the same tensor under another shape, which no site describes
        site_names = {}
        for attr, p in params.items():
            local = next((k for k, v in owner[1]._parameters.items() if v is p), None) if owner else None
            base = f"{owner[0]}.{local}" if owner is not None and local is not None and owner[0] else self.names[id(p)]
            site_names[attr] = self.rec.use_name(base)
        entry = {"module": owner[1] if owner else None, "name": f"{where}: {fname}", "cls": f"a call of {fname}",
                 "handler": handler, "input": x.detach(), "params": params, "site_names": site_names,
                 "dtype": _dtype(params.get("weight", next(iter(params.values()))), out), "out_dtype": out.dtype,
                 "call": (func, _detached(args), _detached(kwargs)),
                 **extra}
        if isinstance(handler, FnEmbedding):
            entry["padding_idx"] = _arg(args, kwargs, 2, "padding_idx")
        return self.rec.add(entry, out)


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


def function_capture(rec: _Recorder, names: Mapping[int, str]) -> _CaptureHandle:
    """Starts capturing; the handle's `remove()` stops it (at most once)."""
    return _CaptureHandle(_Capture(rec, names))
