"""`nn.GroupNorm`, `nn.InstanceNorm1d/2d/3d` (affine) and `nn.BatchNorm1d/2d/3d` in eval mode:
y = x̂ ⊙ w[c] + b[c] with one weight and bias per channel, x̂ normalized over a group of
channels and the positions (GroupNorm), over each channel's positions (InstanceNorm), or by
the running statistics (BatchNorm in eval mode; in training mode it normalizes by the batch's
statistics, which mixes examples, and the layout probes refuse the model). A **layernorm** site with the channels last:
one row per position, so that Σ over rows of δ ⊙ x̂ is the weight's gradient; a bias site on
the same rows. x̂ is the module's own forward with w = 1 and b = 0 (its running statistics, if
any, used as its forward uses them, and left untouched)."""
from __future__ import annotations

from collections.abc import Iterator

import torch

from .base import Handler, Site, Use, builtin


def _channels_last(use: Use, t: torch.Tensor) -> torch.Tensor:
    """B×C×positions… → B×P×C."""
    t = use.batch_first(t)
    return t.reshape(t.shape[0], t.shape[1], -1).transpose(1, 2)


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

    def sites(self, use: Use) -> Iterator[Site]:
        weight = use.weight("a channel norm")
        if use.entry["layout"] != ("axis", 0) or use.input.dim() < 2:
            raise use.error(f"its input has shape {list(use.input.shape)}; the exporter models a batched "
                            "norm, examples × channels × positions")
        g = _channels_last(use, use.grad)
        if use.trainable(weight):
            xhat = _channels_last(use, self.normalized(use))
            yield use.spec("weight", self.kind), {"activations": xhat.to(use.store), "backprops": g.to(use.store)}
        yield from use.bias_site(g)


_norm = ChannelNorm()
for _cls in (torch.nn.GroupNorm, torch.nn.InstanceNorm1d, torch.nn.InstanceNorm2d, torch.nn.InstanceNorm3d,
             torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d):
    builtin(_cls, _norm)
