"""Opacus's `SequenceBias` (DPMultiheadAttention's `add_bias_kv`): appends its bias to every
example's sequence as one more position, so its gradient is the output's gradient at that last
position. A bias site with one row per example."""
from __future__ import annotations

from collections.abc import Iterator

import torch

from .base import Handler, Site, Use, builtin_test


class SequenceBias(Handler):
    kind: str = "bias"

    def sites(self, use: Use) -> Iterator[Site[torch.Tensor]]:
        g = use.batch_first(use.grad)  # B×(L+1)×E: the sequence follows the examples in either layout
        if g.dim() != 3 or g.shape[0] != use.b:
            raise use.error(f"its output has shape {list(use.grad.shape)}; expected sequence × batch × features "
                            "or batch × sequence × features")
        yield from use.bias_site(g[:, -1:, :])


builtin_test("Opacus's SequenceBias",
             lambda m: type(m).__name__ == "SequenceBias" and isinstance(getattr(m, "bias", None), torch.nn.Parameter)
             and hasattr(m, "batch_first"), SequenceBias())
