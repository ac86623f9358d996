"""`nn.Conv1d`, `nn.Conv2d`, `nn.Conv3d`: a convolution is a linear map of each output position's
input patch, so its weight is a **linear** site, stored as the layer's input and the geometry
that unfolds it (format `ghost-oracle-trace/2`, `_trace/conv.py`): `inputs` B×C_in×S… as the
layer read it, `backprops` the output's gradient B×P×C_out (positions row-major), and the
kernel, stride, dilation, zero padding as (lo, hi) per axis, and groups. Each input value is
stored once; the self-check and the judge unfold it a tile at a time. The bias is a bias site on
the same positions.

Padding: numbers pad both ends; "valid" none; "same" pads a total of d·(k − 1) per axis, half
at the start and the odd one at the end, as PyTorch pads it. A padding mode other than zeros
(reflect, replicate, circular) pads the input before the convolution: the site stores the input
so padded (`F.pad` with the module's own padding and mode) and no zero padding on top.
Stride, padding, dilation and groups are all read from the module.

Its functional form: `F.conv1d/2d/3d(x, w, b, stride, padding, dilation, groups)`, the geometry
read from the call's arguments.

Transposed convolutions (`nn.ConvTranspose1d/2d/3d`, `F.conv_transpose*`) are not modelled
(Opacus has no per-sample gradient of them either); a model using one with a trainable weight
is refused by name."""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F

from ..._trace.conv import ConvGeometry, conv_shape
from .base import FunctionHandler, Handler, Operands, Site, Use, arg, builtin, builtin_function

#: A size per spatial axis, or one for all of them.
_Size = int | tuple[int, ...] | list[int]


class Geometry:
    """How a convolution slides: stride, padding (numbers per spatial axis, "same" or "valid"),
    dilation, groups, kernel size, and a padding mode other than zeros with the padding it
    applies first (`pre_pad`, in `F.pad`'s order)."""

    def __init__(self, weight: torch.Tensor, stride: _Size, padding: str | _Size, dilation: _Size, groups: int,
                 padding_mode: str = "zeros", pre_pad: Sequence[int] | None = None) -> None:
        n = weight.dim() - 2

        def tup(v: _Size) -> tuple[int, ...]:
            return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n

        self.kernel = tuple(weight.shape[2:])
        self.stride, self.dilation, self.groups = tup(stride), tup(dilation), groups
        self.padding = padding if isinstance(padding, str) else tup(padding)
        self.padding_mode, self.pre_pad = padding_mode, pre_pad

    @classmethod
    def of_module(cls, m: Any) -> Geometry:
        return cls(m.weight, m.stride, m.padding, m.dilation, m.groups, m.padding_mode,
                   m._reversed_padding_repeated_twice)


def _zero_padding(geo: Geometry) -> tuple[tuple[int, int], ...]:
    """The zero padding (lo, hi) per spatial axis the convolution applies to its input as the
    site stores it (none where a padding mode other than zeros has padded it already)."""
    n = len(geo.kernel)
    if geo.padding_mode != "zeros":
        return ((0, 0),) * n
    if isinstance(geo.padding, str):
        if geo.padding == "valid":
            return ((0, 0),) * n
        # "same": the total padding split as PyTorch splits it, the odd one at the end
        totals = [geo.dilation[d] * (geo.kernel[d] - 1) for d in range(n)]
        return tuple((t // 2, t - t // 2) for t in totals)
    return tuple((p, p) for p in geo.padding)


def stored_input(geo: Geometry, x: torch.Tensor) -> torch.Tensor:
    """The input as the site stores it: padded by a padding mode other than zeros, as the module
    pads it before its convolution (`F.pad` in the mode, with the module's own padding)."""
    if geo.padding_mode == "zeros":
        return x
    # `of_module` sets `pre_pad` for every padding mode but zeros.
    return F.pad(x, cast(Sequence[int], geo.pre_pad), mode=geo.padding_mode)


def conv_geometry(geo: Geometry) -> ConvGeometry:
    """The trace's geometry of the convolution (its `conv` entry)."""
    return ConvGeometry(kernel=geo.kernel, stride=geo.stride, dilation=geo.dilation, padding=_zero_padding(geo),
                        groups=geo.groups)


class Conv(Handler):
    kind: str = "linear"

    def geometry(self, use: Use) -> Geometry:
        return Geometry.of_module(use.module)

    def sites(self, use: Use) -> Iterator[Site[torch.Tensor]]:
        geo = self.geometry(use)
        weight = use.weight("a convolution")
        if not use.reads_trainable("weight", "bias"):
            return  # frozen: nothing to trace
        x_in = use.input
        if x_in.dim() != len(geo.kernel) + 2:
            raise use.error(f"its input has shape {list(x_in.shape)}; the exporter models a batched convolution, "
                            f"examples × channels × {len(geo.kernel)} spatial axes (an unbatched input, "
                            "channels × positions, is not: pass a batch)")
        use.examples_first("output", "the first axis: a convolution mixes what lies along its other axes, so the "
                           "exporter models its input as examples × channels × positions")
        g = use.batch_first(use.grad)  # B×C_out×O…
        b, c_out = g.shape[:2]
        g = g.reshape(b, c_out, -1).transpose(1, 2)  # B×P×C_out
        if not use.trainable(weight):
            yield from use.bias_site(g)
            return
        x = stored_input(geo, x_in.to(use.dtype)).to(use.store)
        geometry = conv_geometry(geo)
        try:
            conv_shape(geometry, x.shape, g.shape)
        except ValueError as e:  # the geometry read does not give the output autograd saw
            raise use.error(f"as a convolution of geometry {geometry.spec()}: {e}") from e
        g = g.to(use.store).contiguous()
        site = use.site("weight", "linear", {"inputs": x.contiguous(), "backprops": g})
        site.conv = geometry
        yield site
        yield from use.bias_site(g)


class FnConv(FunctionHandler, Conv):
    """`F.conv1d/2d/3d(x, w, b, stride, padding, dilation, groups)`."""

    def operands(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Operands | None:
        w = arg(args, kwargs, 1, "weight")
        if not torch.is_tensor(w):
            return None
        return Operands(arg(args, kwargs, 0, "input"), {"weight": w, "bias": arg(args, kwargs, 2, "bias")})

    def geometry(self, use: Use) -> Geometry:
        call = use.call
        assert call is not None  # a use of a function handler is a call
        return Geometry(call.arg(1, "weight"), call.arg(3, "stride") or 1, call.arg(4, "padding") or 0,
                        call.arg(5, "dilation") or 1, call.arg(6, "groups") or 1)


_conv = Conv()
for _cls in (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d):
    builtin(_cls, _conv)
_fn_conv = FnConv()
for _name, _f in (("F.conv1d", F.conv1d), ("F.conv2d", F.conv2d), ("F.conv3d", F.conv3d)):
    builtin_function(_name, _f, _fn_conv)
