"""`nn.GroupNorm`, `nn.InstanceNorm1d/2d/3d` (affine) and `nn.BatchNorm1d/2d/3d` in eval mode:
y = x̂ ⊙ w[c] + b[c] with one weight and bias per channel, x̂ normalized over a group of
channels and the positions (GroupNorm), over each channel's positions (InstanceNorm), or by
the running statistics (BatchNorm in eval mode; in training mode it normalizes by the batch's
statistics, which mixes examples, and the layout probes refuse the model). A **layernorm** site with the channels last:
one row per position, so that Σ over rows of δ ⊙ x̂ is the weight's gradient; a bias site on
the same rows. x̂ is the module's own forward with w = 1 and b = 0 (its running statistics, if
any, used as its forward uses them, and left untouched).

A norm without affine parameters (`affine=False`), or with them frozen, reads no trainable
parameter and has no site. A group whose values are all equal (GroupNorm with one value a group:
as many groups as channels, one position; or a padded convolution's constant output) has
x̂ = x − mean = 0: its rows of the weight's site hold x̂ = 0 exactly, its bias's the output's
gradient.

Its functional forms: `F.group_norm(x, groups, w, b, eps)` and `F.instance_norm(x, running_mean,
running_var, w, b, use_input_stats, momentum, eps)`, x̂ the same call without its weight and bias
(on copies of the running statistics)."""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .base import FunctionCall, FunctionHandler, Handler, Operands, Site, Use, arg, builtin, builtin_function
from .norm import cancelled_rounding


def _channels_last(use: Use, t: torch.Tensor) -> torch.Tensor:
    """B×C×positions… → B×P×C."""
    t = use.batch_first(t)
    return t.reshape(t.shape[0], t.shape[1], -1).transpose(1, 2)


def statistics_rounding(use: Use, groups: int, eps: float) -> torch.Tensor:
    """The rounding autograd's backward adds to the weight's gradient of a norm by the input's own
    statistics, per channel, absolute. Its kernel forms Σ_b (Σ δ·x − mean·Σ δ)·rstd in the norm's
    precision: a cancellation whose rounding scales with Σ_b rstd·(Σ|δ·x| + |mean|·Σ|δ|), not
    with the site's own terms Σ|δ·x̂|, and is far larger where a group's mean dwarfs its spread
    (ResNet-18's last GroupNorms on 1×1 maps: 371× at one channel). Each sum over positions,
    the statistics over the group and the sum over examples round: (positions + group + B + 4)·u
    of that sum bounds it."""
    x_all = use.batch_first(use.input)
    b, c = x_all.shape[:2]
    x_all = x_all.reshape(b, c, -1)  # B×C×P, as the norm holds it: sums along contiguous rows
    g_all = use.batch_first(use.grad).reshape(b, c, -1)
    p = x_all.shape[-1]
    terms = torch.zeros(c, dtype=torch.float64, device=x_all.device)
    # a few examples at a time: a whole norm's f64 copies are fresh allocations the kernel zeroes
    # page by page, several times the arithmetic
    step = max(1, _CHUNK_BYTES // max(8 * p * c, 1))
    for i0 in range(0, b, step):
        x = x_all[i0:i0 + step].to(torch.float64)
        g = g_all[i0:i0 + step].to(torch.float64)
        var, mean = torch.var_mean(x.reshape(x.shape[0], groups, -1), -1, unbiased=False)
        rstd = (var + eps).rsqrt().repeat_interleave(c // groups, dim=1)  # examples × C
        mean = mean.repeat_interleave(c // groups, dim=1)
        terms += (rstd * ((g * x).abs().sum(-1) + mean.abs() * g.abs().sum(-1))).sum(0)
    u = torch.finfo(use.dtype).eps / 2
    return (p + p * (c // groups) + b + 4) * u * terms


#: Bytes of one f64 copy of a norm's input taken at a time by `statistics_rounding`.
_CHUNK_BYTES = 8 << 20


class ChannelNorm(Handler):
    kind: str = "layernorm"

    def normalized(self, use: Use) -> torch.Tensor:
        """x̂: the module's own forward with w = 1 and b = 0, on copies of its running statistics."""
        m = use.module
        params = {"weight": torch.ones_like(m.weight)}
        if m.bias is not None:
            params["bias"] = torch.zeros_like(m.bias)
        params.update({k: v.clone() for k, v in m.named_buffers(recurse=False) if v is not None})
        with torch.no_grad():
            xhat: torch.Tensor = torch.func.functional_call(m, params, (use.input,))
            return xhat

    def groups(self, use: Use) -> tuple[int, float] | None:
        """(groups, ε) of a norm by its input's own statistics, over groups of channels and their
        positions: GroupNorm's groups, InstanceNorm's channels (where it uses the input's
        statistics); None for a norm by running statistics (BatchNorm in eval mode)."""
        m = use.module
        if isinstance(m, torch.nn.GroupNorm):
            return m.num_groups, m.eps
        if isinstance(m, torch.nn.modules.instancenorm._InstanceNorm) and (m.training or not m.track_running_stats):
            return use.input.shape[1], m.eps
        return None

    def constant_groups(self, use: Use) -> tuple[torch.Tensor, int, float] | None:
        """Where a group of some example holds one value however many times (one value a group:
        as many groups as channels and one position; or positions all equal, a padded
        convolution's constant output): (B×C mask of the channels of such groups, the values per
        group, ε). There x − mean is 0, so x̂ is 0 exactly and adds nothing to the weight's
        gradient. None where no group is constant."""
        found = self.groups(use)
        x = use.input
        if found is None:
            return None
        groups, eps = found
        xg = x.detach().reshape(x.shape[0], groups, -1)
        const = xg.amax(-1) == xg.amin(-1)  # B×G, exact: equal values, whatever their rounding
        if not bool(const.any()):
            return None
        return const.repeat_interleave(x.shape[1] // groups, dim=1), xg.shape[-1], eps

    def sites(self, use: Use) -> Iterator[Site[torch.Tensor]]:
        weight = use.weight("a channel norm")
        if not use.reads_trainable("weight", "bias"):
            return  # affine=False, or frozen affine parameters: nothing to trace
        x = use.input
        if x.dim() < 2:
            raise use.error(f"its input has shape {list(x.shape)}; a channel norm's input is examples × channels "
                            "(× positions)")
        use.examples_first("input", "the first axis: a channel norm normalizes over axes 1 and on, so the "
                           "exporter models its input as examples × channels × positions")
        g = _channels_last(use, use.grad)
        rounding: torch.Tensor | None = None
        if use.trainable(weight):
            assert weight is not None  # a trainable weight is a parameter
            xhat = _channels_last(use, self.normalized(use))
            found = self.constant_groups(use)
            if found is not None:
                const, n, eps = found
                rows = const.unsqueeze(1).to(xhat.device)  # B×1×C: the channels of constant groups
                xhat = xhat.masked_fill(rows, 0)
                # The self-check accepts autograd's rounding around the exact 0, on those
                # channels only.
                terms = (g.abs().to(torch.float64) * _channels_last(use, x).abs().to(torch.float64)
                         * rows.to(torch.float64)).sum((0, 1))
                rounding = cancelled_rounding(n, use.dtype, eps, terms)
            by_input = self.groups(use)
            if by_input is not None:
                general = statistics_rounding(use, *by_input)
                rounding = general if rounding is None else rounding + general
            g = g.to(use.store)  # the weight's and the bias's backprops: one tensor, written once
            yield use.site("weight", "layernorm", {"activations": xhat.to(use.store), "backprops": g},
                           autograd_rounding=rounding)
        yield from use.bias_site(g)


_norm = ChannelNorm()
for _cls in (torch.nn.GroupNorm, torch.nn.InstanceNorm1d, torch.nn.InstanceNorm2d, torch.nn.InstanceNorm3d,
             torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d):
    builtin(_cls, _norm)


class FnGroupNorm(FunctionHandler, ChannelNorm):
    """`F.group_norm(x, groups, w, b, eps)`."""

    def operands(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Operands | None:
        return Operands(arg(args, kwargs, 0, "input"), {"weight": arg(args, kwargs, 2, "weight"),
                                                         "bias": arg(args, kwargs, 3, "bias")})

    def normalized(self, use: Use) -> torch.Tensor:
        assert use.call is not None  # a use of a function handler is a call
        return use.call.without_affine(2)

    def groups(self, use: Use) -> tuple[int, float] | None:
        assert use.call is not None
        eps = use.call.arg(4, "eps")
        return int(use.call.arg(1, "num_groups")), 1e-5 if eps is None else float(eps)


class FnInstanceNorm(FunctionHandler, ChannelNorm):
    """`F.instance_norm(x, running_mean, running_var, w, b, use_input_stats, momentum, eps)`:
    replayed without weight and bias, on copies of the running statistics."""

    def operands(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Operands | None:
        return Operands(arg(args, kwargs, 0, "input"), {"weight": arg(args, kwargs, 3, "weight"),
                                                         "bias": arg(args, kwargs, 4, "bias")})

    def normalized(self, use: Use) -> torch.Tensor:
        call = use.call
        assert call is not None
        args = tuple(a.clone() if k in (1, 2) and torch.is_tensor(a) else a for k, a in enumerate(call.args))
        kwargs = {k: (v.clone() if k in ("running_mean", "running_var") and torch.is_tensor(v) else v)
                  for k, v in call.kwargs.items()}
        return FunctionCall(call.func, args, kwargs).without_affine(3)

    def groups(self, use: Use) -> tuple[int, float] | None:
        assert use.call is not None
        if use.call.arg(5, "use_input_stats") is False:
            return None  # normalized by the running statistics
        eps = use.call.arg(7, "eps")
        return use.input.shape[1], 1e-5 if eps is None else float(eps)


builtin_function("F.group_norm", F.group_norm, FnGroupNorm())
builtin_function("F.instance_norm", F.instance_norm, FnInstanceNorm())
