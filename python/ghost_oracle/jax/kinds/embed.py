"""`nn.Embed`: a lookup is an `embedding` site, `attend` (the tied head, y = x Eᵀ) a `linear`
site of the same parameter (V×d, out×in). The `gemma` package's `Embedder` is the same pair,
`encode` scaled by √d (the lookup's gradient is √d times the output's) and `decode`."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..._trace.format import TraceExportError
from ..sites import Call, Site, grad_of, precision_of, rows


def _lookup(call: Call, batch: int, table: str, scale: float) -> list[Site]:
    ids = np.asarray(call.args[0])
    if not np.issubdtype(ids.dtype, np.integer):
        raise TraceExportError(f"{call.where}: looked up with {ids.dtype} values, not integer ids")
    v, d = call.params[table].shape
    dy = grad_of(call).astype(np.float64) * scale
    if ids.shape[0] != batch:
        raise TraceExportError(f"{call.where}: ids of shape {list(ids.shape)} for a batch of {batch}")
    back = rows(dy, batch, d, "output gradient", call).astype(call.out_dtype)
    return [Site("embedding", call.param(table), {"ids": ids.reshape(batch, -1).astype(np.int64), "backprops": back},
                 precision_of(call.out_dtype, call.where), call, vocab=int(v))]


def _head(call: Call, batch: int, table: str) -> list[Site]:
    v, d = call.params[table].shape
    x = np.asarray(call.args[0]).astype(call.out_dtype)
    return [Site("linear", call.param(table), {"activations": rows(x, batch, d, "input", call),
                                               "backprops": rows(grad_of(call), batch, v, "output gradient", call)},
                 precision_of(call.out_dtype, call.where), call)]


class EmbedLookup:
    def record(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        return (args[0] if args else kwargs["inputs"],)

    def sites(self, call: Call, batch: int) -> Sequence[Site]:
        return _lookup(call, batch, "embedding", 1.0)


class EmbedAttend:
    def record(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        return (args[0] if args else kwargs["query"],)

    def sites(self, call: Call, batch: int) -> Sequence[Site]:
        return _head(call, batch, "embedding")


class GemmaEncode:
    def record(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        return (args[0] if args else kwargs["x"],)

    def sites(self, call: Call, batch: int) -> Sequence[Site]:
        # the module multiplies the looked-up rows by √d rounded to their dtype
        scale = float(np.sqrt(np.float64(call.module.embed_dim)).astype(call.out_dtype))
        return _lookup(call, batch, "input_embedding", scale)


class GemmaDecode:
    def record(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        return (args[0] if args else kwargs["x"],)

    def sites(self, call: Call, batch: int) -> Sequence[Site]:
        return _head(call, batch, "input_embedding")
