"""A parameter repeated or broadcast along the batch (`p.repeat(...)`, `p.expand(...)`,
`p.expand_as(t)`, `p.tile(...)`, `torch.tile(p, ...)`): `nn.MultiheadAttention`'s `bias_k` and
`bias_v`, appended to every example's keys and values as `bias_k.repeat(1, B, 1)`; a class token
`cls.expand(B, -1, -1)`. Each example reads the parameter as is, so its gradient is the sum of
its copies' output gradients: a bias site, one row per copy in the example's slice. A function
form only: no module computes it."""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ..batch import describe_layout
from .base import FunctionHandler, Operands, Site, Use, arg, builtin_function


class FnRepeat(FunctionHandler):
    """The output is tiles of the parameter, tile-major along every axis, and the parameter's
    gradient is the sum of its tiles' output gradients. Each example's tiles are its slice along
    its batch axis (which the parameter must not vary along): a bias site whose rows are the
    example's tiles and whose features are the parameter's entries, row-major."""

    kind: str = "bias"

    def operands(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Operands | None:
        p = arg(args, kwargs, 0, "input")
        return Operands(p, {"bias": p}) if isinstance(p, torch.nn.Parameter) else None

    def repeats(self) -> bool:
        return True

    def sites(self, use: Use) -> Iterator[Site[torch.Tensor]]:
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
        layout = use.layout
        if layout is None or layout[0] != "axis" or size[layout[1]] != 1:
            shown = "an unknown axis" if layout is None else describe_layout(layout)
            name = (use.site_names or {}).get("bias", "bias")
            raise use.error(f"its output {list(g.shape)} holds the examples along {shown}, where the parameter "
                            f"`{name}` {list(p.shape)} is not repeated: each example reads its own part of the "
                            "parameter, which a bias site (each example reads all of it) does not describe")
        a = layout[1]
        # (r_0, s_0, r_1, s_1, …): each axis split into its tiles and the tile's entries
        tiled = g.reshape([d for r, s_k in zip(reps, size, strict=True) for d in (r, s_k)])
        rep_axes = [2 * k for k in range(n) if k != a]
        tiled = tiled.permute([2 * a] + rep_axes + [2 * k + 1 for k in range(n)])
        yield use.site("bias", "bias", {"backprops": tiled.reshape(use.b, -1, p.numel()).to(use.store)})


_repeat = FnRepeat()
for _name, _f in (("Tensor.repeat", torch.Tensor.repeat), ("Tensor.expand", torch.Tensor.expand),
                  ("Tensor.expand_as", torch.Tensor.expand_as), ("Tensor.tile", torch.Tensor.tile),
                  ("torch.tile", torch.tile)):
    builtin_function(_name, _f, _repeat)
