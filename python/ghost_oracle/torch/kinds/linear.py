"""`nn.Linear` and the classes declared `"linear"`: y = x Wᵀ (+ b), W out×in. A linear site
(activations: the input as the matmul saw it, under autocast cast to autocast's dtype;
backprops: the output's gradient) and a bias site, each where its parameter is trainable."""
from __future__ import annotations

from collections.abc import Iterator

import torch

from .base import Handler, Site, Use, builtin, declarable


class Linear(Handler):
    kind: str = "linear"

    def site_kind(self, use: Use) -> str:
        """The trace's kind of the weight's site: the weight's layout (out×in, or in×out)."""
        return self.kind

    def sites(self, use: Use) -> Iterator[Site]:
        weight = use.weight(self.kind)
        if not use.reads_trainable("weight", "bias"):
            return  # frozen: nothing to trace
        g = use.per_example(use.grad, "output gradient")
        if use.trainable(weight):
            x = use.per_example(use.input, "input").to(use.dtype)
            yield use.spec("weight", self.site_kind(use)), {"activations": x.to(use.store),
                                                             "backprops": g.to(use.store)}
        yield from use.bias_site(g)


builtin(torch.nn.Linear, declarable(Linear()))
