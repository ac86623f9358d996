"""Hugging Face's `Conv1D` (GPT-2) and the classes declared `"conv1d"`: y = x W (+ b), W in×out,
the transpose of a Linear's layout. A conv1d site and a bias site."""
from .base import builtin, declarable
from .linear import Linear

try:  # Hugging Face's Conv1D; optional
    from transformers.pytorch_utils import Conv1D
except Exception:  # pragma: no cover
    Conv1D = None


class HFConv1D(Linear):
    kind = "conv1d"


_handler = declarable(HFConv1D())
if Conv1D is not None:
    builtin(Conv1D, _handler)
