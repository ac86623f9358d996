"""`nn.Linear` and the classes declared `"linear"`: y = x Wᵀ (+ b), W out×in. A linear site
(activations: the input as the matmul saw it, under autocast cast to autocast's dtype;
backprops: the output's gradient) and a bias site, each where its parameter is trainable.

Its functional forms:
- `F.linear(x, w, b)`, w and b parameters or blocks of their rows (`nn.MultiheadAttention`'s
  query, key and value rows of `in_proj_weight`): a block's site is the whole parameter's, its
  backprops 0 outside the block's rows (exact: those rows receive no gradient from this call);
- `x @ w`, `torch.matmul(x, w)` with w a 2-D parameter on the right: a conv1d site (w in×out);
  `x @ w.T`, w's transpose (a tied head written as `h @ embedding.weight.T`), a linear site of w."""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F

from ..._trace.site import SiteKind
from .base import FunctionHandler, Handler, Operands, Site, Use, arg, builtin, builtin_function, declarable


class Linear(Handler):
    kind: str = "linear"

    def site_kind(self, use: Use) -> SiteKind:
        """The trace's kind of the weight's site: the weight's layout (out×in, or in×out)."""
        return use.site_kind if use.site_kind is not None else cast(SiteKind, self.kind)

    def sites(self, use: Use) -> Iterator[Site[torch.Tensor]]:
        weight = use.weight(self.kind or "linear")
        if not use.reads_trainable("weight", "bias"):
            return  # frozen: nothing to trace
        # stored once: the weight's and the bias's backprops are one tensor, written once
        g = use.per_example(use.grad, "output gradient").to(use.store)

        def backprops(attr: str) -> torch.Tensor:
            """The output's gradient, placed at the rows of the parameter the call read where it
            read a block of them."""
            block = use.rows.get(attr)
            if block is None:
                return g
            full = g.new_zeros(*g.shape[:-1], use.param(attr).shape[0])
            full[..., block[0]:block[1]] = g
            return full

        if use.trainable(weight):
            x = use.per_example(use.input, "input").to(use.dtype)
            yield use.site("weight", self.site_kind(use), {"activations": x.to(use.store),
                                                           "backprops": backprops("weight")})
        if use.trainable(use.param("bias")):
            yield from use.bias_site(backprops("bias"))


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
    """`F.linear(x, w, b)`."""

    def operands(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Operands | None:
        params: dict[str, Any] = {}
        rows: dict[str, tuple[int, int]] = {}
        for attr, k in (("weight", 1), ("bias", 2)):
            params[attr], block = _row_block(arg(args, kwargs, k, attr))
            if block is not None:
                rows[attr] = block
        return Operands(arg(args, kwargs, 0, "input"), params, rows=rows)


class FnMatmul(FunctionHandler, Linear):
    """`x @ w` is a conv1d site (w in×out); `x @ w.T`, w's transpose, a linear site of w (out×in)."""

    def operands(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Operands | None:
        x, w = arg(args, kwargs, 0, "input"), arg(args, kwargs, 1, "other")
        if not torch.is_tensor(w) or w.dim() != 2:
            return None
        if isinstance(w, torch.nn.Parameter):
            return Operands(x, {"weight": w}, site_kind="conv1d")
        base = w._base
        if (isinstance(base, torch.nn.Parameter) and base.dim() == 2 and w.shape == base.shape[::-1]
                and w.stride() == base.stride()[::-1] and w.data_ptr() == base.data_ptr()):
            return Operands(x, {"weight": base}, site_kind="linear")
        return None


builtin(torch.nn.Linear, declarable(Linear()))
builtin_function("F.linear", F.linear, FnLinear())
# `x @ w` reaches the capture mode as the tensor method `__matmul__` or `matmul`,
# `torch.matmul(x, w)` as the function.
_matmul = FnMatmul()
for _name, _f in (("torch.matmul", torch.matmul), ("Tensor.matmul", torch.Tensor.matmul),
                  ("`x @ w`", torch.Tensor.__matmul__)):
    builtin_function(_name, _f, _matmul)
