"""The module kinds the JAX exporter models, one file each, matched by exact class and method
(a subclass may change what its method computes). The `gemma` package's layers are included
when it is installed."""
from __future__ import annotations

from typing import Any

import flax.linen as nn

from ..sites import Handler
from .conv import Conv
from .dense import Dense
from .einsum import DenseGeneral, FlaxEinsum, GemmaEinsum
from .embed import EmbedAttend, EmbedLookup, GemmaDecode, GemmaEncode
from .norm import LastAxisNorm

HANDLERS: dict[tuple[type, str], Handler] = {
    (nn.Dense, "__call__"): Dense(),
    (nn.DenseGeneral, "__call__"): DenseGeneral(),
    (nn.Einsum, "__call__"): FlaxEinsum(),
    (nn.Embed, "__call__"): EmbedLookup(),
    (nn.Embed, "attend"): EmbedAttend(),
    (nn.LayerNorm, "__call__"): LastAxisNorm(),
    (nn.RMSNorm, "__call__"): LastAxisNorm(),
    (nn.Conv, "__call__"): Conv(),
}

# The `gemma` package's layers, by their qualified names: importing gemma (it brings TensorFlow)
# costs seconds, and a model built from them has imported it already.
GEMMA_HANDLERS: dict[tuple[str, str], Handler] = {
    ("gemma.gm.nn._layers.Einsum", "__call__"): GemmaEinsum(),
    ("gemma.gm.nn._layers.RMSNorm", "__call__"): LastAxisNorm(),
    ("gemma.gm.nn._modules.Embedder", "encode"): GemmaEncode(),
    ("gemma.gm.nn._modules.Embedder", "decode"): GemmaDecode(),
}


def handler_for(module: Any, method: str) -> Handler | None:
    cls = type(module)
    handler = HANDLERS.get((cls, method))
    if handler is None and cls.__module__.startswith("gemma."):
        handler = GEMMA_HANDLERS.get((f"{cls.__module__}.{cls.__qualname__}", method))
    return handler


def modelled_classes() -> str:
    names = {f"{cls.__name__}.{m}" if m != "__call__" else cls.__name__ for cls, m in HANDLERS}
    names |= {f"gemma's {q.rsplit('.', 1)[1]}" + (f".{m}" if m != "__call__" else "") for q, m in GEMMA_HANDLERS}
    return ", ".join(sorted(names))
