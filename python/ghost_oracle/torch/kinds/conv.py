"""`nn.Conv1d`, `nn.Conv2d`, `nn.Conv3d`: a convolution is a linear map of each output position's
input patch, so it is a **linear** site over unfolded patches: one row per output position,
columns C_in/groups · ∏k in the weight's layout (C_out × C_in/groups × k…), and a bias site
on the same rows.

Groups: output channels of group j read only input channels of group j. Each row is then an
(output position, group) pair whose activations are that group's patch and whose backprops
are the output's gradient at that position with the other groups' channels zeroed, so that
Σ over rows of backprops ⊗ activations is the grouped weight's gradient, entry for entry.
Stride, padding (numbers, "same", "valid", and the non-zero padding modes), dilation and groups
are all read from the module.

Its functional form: `F.conv1d/2d/3d(x, w, b, stride, padding, dilation, groups)`, the geometry
read from the call's arguments."""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F

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


def _padded(geo: Geometry, x: torch.Tensor) -> torch.Tensor:
    """`x` padded as the convolution pads it."""
    n = x.dim() - 2
    if geo.padding_mode != "zeros":
        # `of_module` sets `pre_pad` for every padding mode but zeros.
        return F.pad(x, cast(Sequence[int], geo.pre_pad), mode=geo.padding_mode)
    if isinstance(geo.padding, str):
        if geo.padding == "valid":
            return x
        pads: list[int] = []  # "same": the total padding split as PyTorch splits it, the odd one at the end
        for d in reversed(range(n)):
            total = geo.dilation[d] * (geo.kernel[d] - 1)
            pads += [total // 2, total - total // 2]
        return F.pad(x, pads)
    pads = []
    for d in reversed(range(n)):
        pads += [geo.padding[d], geo.padding[d]]
    return F.pad(x, pads)


def patches(geo: Geometry, x: torch.Tensor) -> torch.Tensor:
    """B×P×C_in×∏k: every output position's input patch, positions row-major."""
    x = _padded(geo, x)
    n = x.dim() - 2
    for d in range(n):
        span = geo.dilation[d] * (geo.kernel[d] - 1) + 1
        x = x.unfold(2 + d, span, geo.stride[d])[..., ::geo.dilation[d]]
    # B×C×O_1…O_n×k_1…k_n → B×O_1…O_n×C×k_1…k_n
    b, c = x.shape[:2]
    positions = math.prod(x.shape[2:2 + n])
    x = x.permute(0, *range(2, 2 + n), 1, *range(2 + n, 2 + 2 * n))
    return x.reshape(b, positions, c, -1)


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
        groups = geo.groups
        x = patches(geo, x_in.to(use.dtype))  # B×P×C_in×∏k
        p = x.shape[1]
        if x.shape[1] != g.shape[1]:
            raise use.error(f"its input unfolds to {x.shape[1]} positions but its output has {g.shape[1]}")
        cin_g, cout_g = x.shape[2] // groups, c_out // groups
        # rows: (position, group) pairs
        acts = x.reshape(b, p, groups, cin_g * x.shape[3]).reshape(b, p * groups, -1)
        mask = torch.zeros(groups, c_out, dtype=g.dtype, device=g.device)
        for j in range(groups):
            mask[j, j * cout_g:(j + 1) * cout_g] = 1
        bps = (g.unsqueeze(2) * mask).reshape(b, p * groups, c_out)
        yield use.site("weight", "linear", {"activations": acts.to(use.store), "backprops": bps.to(use.store)})
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
