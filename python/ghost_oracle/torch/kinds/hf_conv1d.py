"""Hugging Face's `Conv1D` (GPT-2) and the classes declared `"conv1d"`: y = x W (+ b), W in×out,
the transpose of a Linear's layout. A conv1d site and a bias site."""
from __future__ import annotations

import torch

from .base import builtin, declarable
from .linear import Linear


def _hf_conv1d() -> type[torch.nn.Module] | None:
    """Hugging Face's Conv1D, where transformers is installed (it is optional)."""
    try:
        from transformers.pytorch_utils import Conv1D
    except Exception:  # pragma: no cover
        return None
    return Conv1D


Conv1D = _hf_conv1d()


class HFConv1D(Linear):
    kind: str = "conv1d"


_handler = declarable(HFConv1D())
if Conv1D is not None:
    builtin(Conv1D, _handler)
