"""A parameter added to a batched tensor by broadcasting (`x + p`, `p + x`, `torch.add(x, p)`,
`x.add(p)`): a vision transformer's learned positions `x + pos_embed` (pos_embed 1×N×D, x
B×N×D), a bias kept as a bare parameter (`x + b`, b of D entries). Each example reads the whole
parameter, broadcast along the axes where it has one entry, so its gradient is the sum of the
output's gradient over those axes in the example's slice: the same bias site as a parameter
repeated with `expand` (repeat.py), whose tiles here are the broadcast copies. A function form
only: no module computes it."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .base import Operands, arg, builtin_function
from .repeat import FnRepeat


class FnBroadcastAdd(FnRepeat):
    """`x + p` with `p` a parameter and `x` a tensor that is not one: the output is `p`'s
    broadcast copies shifted by `x`, and `p`'s gradient the sum of the copies' output
    gradients (FnRepeat's site, the copies as rows). `torch.add(..., alpha=a)` scales one
    operand: left to the refusal of an unmodelled use, since the scale is not a bias's."""

    def operands(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Operands | None:
        if arg(args, kwargs, 2, "alpha") not in (None, 1):
            return None
        a, b = arg(args, kwargs, 0, "input"), arg(args, kwargs, 1, "other")
        a_param, b_param = isinstance(a, torch.nn.Parameter), isinstance(b, torch.nn.Parameter)
        if a_param == b_param or not (torch.is_tensor(a) and torch.is_tensor(b)):
            return None  # two parameters, or a number added: not a parameter broadcast over the batch
        p, x = (a, b) if a_param else (b, a)
        return Operands(x, {"bias": p})

    def repeats(self) -> bool:
        return False  # the output is never the parameter under another shape: x varies along the batch


_broadcast_add = FnBroadcastAdd()
for _name, _f in (("Tensor.__add__", torch.Tensor.__add__), ("Tensor.__radd__", torch.Tensor.__radd__),
                  ("Tensor.add", torch.Tensor.add), ("torch.add", torch.add)):
    builtin_function(_name, _f, _broadcast_add)
