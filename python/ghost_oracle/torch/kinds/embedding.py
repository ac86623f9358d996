"""Embeddings: y = W[ids]. An embedding site: the ids and the gradient of the lookup.

- `nn.Embedding` and the classes declared `"embedding"`;
- scaled embeddings, whose forward is the lookup times `embed_scale` (class name ending in
  `ScaledWordEmbedding`, e.g. `GemmaTextScaledWordEmbedding`): the lookup's gradient is the
  output's gradient times the scale;
- OPT's learned positions (`OPTLearnedPositionalEmbedding`: ids = positions + 2).

Rows at `padding_idx` receive no gradient from a lookup, so their backprops are zero.

Its functional form: `F.embedding(ids, w, padding_idx)`; a call with `max_norm` or
`scale_grad_by_freq` on a trainable table is refused, by name and option."""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from . import base
from .base import FunctionHandler, Handler, Operands, Site, Unmodelled, Use, arg


def unmodelled_options(max_norm: Any, scale_grad_by_freq: Any) -> str | None:
    """Why a lookup with these options has no embedding site, or None where it has one."""
    if max_norm is not None:
        return (f"max_norm={max_norm} is not modelled: the forward renormalizes, in place, the rows of the table "
                "it looks up, so it changes the parameter it reads")
    if scale_grad_by_freq:
        return ("scale_grad_by_freq=True divides each row's gradient by the number of times its id occurs in the "
                "whole batch, so one example's gradient depends on the other examples' ids: no per-example "
                "gradient is defined")
    return None


class Embedding(Handler):
    kind: str = "embedding"

    def lookup_grad(self, use: Use, g: torch.Tensor) -> torch.Tensor:
        """The gradient of the lookup, from the output's."""
        return g

    def padding_idx(self, use: Use) -> int | None:
        return getattr(use.module, "padding_idx", None)

    def check_options(self, use: Use) -> None:
        m = use.module
        why = unmodelled_options(getattr(m, "max_norm", None), getattr(m, "scale_grad_by_freq", False))
        if why is not None:
            raise use.error(why)

    def sites(self, use: Use) -> Iterator[Site[torch.Tensor]]:
        weight = use.weight("embedding")
        if not use.trainable(weight):
            return  # frozen: nothing to trace
        assert weight is not None  # a trainable weight is a parameter
        g = use.per_example(use.grad, "output gradient")
        self.check_options(use)
        ids = use.per_example(use.input.to(torch.int64), "ids", features=False)
        g = self.lookup_grad(use, g)
        padding_idx = self.padding_idx(use)
        if padding_idx is not None:  # the padding row receives no gradient from a lookup
            g = g.masked_fill((ids == padding_idx).unsqueeze(-1), 0)
        yield use.site("weight", "embedding", {"ids": ids, "backprops": g.to(use.store)}, vocab=weight.shape[0])


class ScaledEmbedding(Embedding):
    def lookup_grad(self, use: Use, g: torch.Tensor) -> torch.Tensor:
        s = use.module.embed_scale  # a buffer cast to the weight's dtype in Hugging Face's classes
        s = s.to(use.module.weight.dtype) if torch.is_tensor(s) else float(s)
        return g * s


class OptPositions(Embedding):
    def input(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        """The ids OPT's learned-position table is indexed with (its forward, replayed)."""
        pos = kwargs.get("position_ids", args[2] if len(args) > 2 else None)
        if pos is None:
            mask = kwargs.get("attention_mask", args[0] if args else None)
            cache = kwargs.get("cache_length", args[1] if len(args) > 1 else 0)
            pos = (torch.cumsum(mask, dim=1) * mask - 1).long()[:, cache:]
        return pos + module.offset


class FnEmbedding(FunctionHandler, Embedding):
    """`F.embedding(ids, w, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)`."""

    def operands(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Operands | None:
        why = unmodelled_options(arg(args, kwargs, 3, "max_norm"), arg(args, kwargs, 5, "scale_grad_by_freq"))
        if why is not None:
            raise Unmodelled(why)
        return Operands(arg(args, kwargs, 0, "input"), {"weight": arg(args, kwargs, 1, "weight")})

    def padding_idx(self, use: Use) -> int | None:
        assert use.call is not None  # a use of a function handler is a call
        p = use.call.arg(2, "padding_idx")
        return None if p is None else int(p) % use.param("weight").shape[0]  # a negative index counts from the end

    def check_options(self, use: Use) -> None:
        pass  # `operands` refuses the calls with options it does not model


base.builtin(torch.nn.Embedding, base.declarable(Embedding()))
base.builtin_test("scaled embeddings (a torch.nn.Embedding whose class name ends in ScaledWordEmbedding, with an "
             "embed_scale)",
             lambda m: isinstance(m, torch.nn.Embedding) and type(m).__name__.endswith("ScaledWordEmbedding")
             and hasattr(m, "embed_scale"), ScaledEmbedding())
base.builtin_test("OPT's learned positions (OPTLearnedPositionalEmbedding)",
             lambda m: isinstance(m, torch.nn.Embedding) and type(m).__name__ == "OPTLearnedPositionalEmbedding"
             and hasattr(m, "offset"), OptPositions())
base.builtin_function("F.embedding", F.embedding, FnEmbedding())
