"""A site: one use of one parameter, as a trace holds it (docs/trace-format.md). Both
exporters hand their captures over as `Site`s; the self-check and the writer read nothing else.

The tensors are numpy arrays with the batch first and every axis between the batch and the
features a row (B×R×features; an embedding's `ids` B×R). A bfloat16 factor is held as its raw
bits in a `uint16` array (numpy has no bfloat16 of its own), with `precision` "bf16".

A convolution's weight may instead be a `linear` site that carries its geometry (`conv`): its
tensors are then `inputs` (B×C_in×S…, the layer's input) and `backprops` (B×P×C_out), the form
of format `ghost-oracle-trace/2` (`conv.py`).

A site whose backprops are another site's (a bias reads its layer's output gradient, as the
weight does) says so in `backprops_of`: its `backprops` is then that site's array itself, which
the self-check reads under both names and the writer writes once, under the other site's name
(format `ghost-oracle-trace/3`).

A front-end builds its sites over its own tensor type (`Site[torch.Tensor]` in the PyTorch
handlers) and hands them over as `Site[np.ndarray]` (`with_tensors`)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import numpy as np

from .conv import ConvGeometry

#: The kinds of site a trace holds; the reader in Rust knows the same five.
SiteKind = Literal["linear", "conv1d", "embedding", "layernorm", "bias"]
SITE_KINDS: tuple[SiteKind, ...] = ("linear", "conv1d", "embedding", "layernorm", "bias")

#: The precisions a trace records, finest first.
Precision = Literal["f64", "f32", "f16", "bf16"]
PRECISIONS: tuple[Precision, ...] = ("f64", "f32", "f16", "bf16")

T = TypeVar("T")
U = TypeVar("U")


@dataclass
class Site(Generic[T]):
    """One site: its name in the trace, the parameter it writes, its kind and factors, the
    precision its use computed in, and where it came from (for messages)."""

    name: str
    param: str
    kind: SiteKind
    tensors: dict[str, T]
    precision: Precision
    #: the module or call the site came from, as messages name it: "module `h.0.attn.c_attn` (Conv1D)"
    origin: str
    #: rows of an embedding's table (its layout's rows); None for every other kind
    vocab: int | None = None
    #: the rounding autograd's own backward adds where the site's factors are exact and autograd's
    #: are not (GroupNorm with one value a group), absolute, in the parameter's layout; None: none
    autograd_rounding: T | None = None
    #: a convolution stored as its input and geometry (a `linear` site only); None: unfolded or no conv
    conv: ConvGeometry | None = None
    #: the name of the site whose `backprops` this site's are (the same array, written once, under
    #: that site's name); None: its own. The named site holds its own backprops.
    backprops_of: str | None = None

    def spec(self) -> dict[str, Any]:
        """The site's entry in the trace header."""
        s: dict[str, Any] = {"name": self.name, "param": self.param, "kind": self.kind}
        if self.vocab is not None:
            s["vocab"] = self.vocab
        if self.conv is not None:
            s["conv"] = self.conv.spec()
        if self.backprops_of is not None:
            s["backprops_of"] = self.backprops_of
        return s

    def with_tensors(self, convert: Callable[[T], U]) -> Site[U]:
        """The same site over another tensor type (the handover to the self-check and writer).
        `convert` is called once a tensor: a shared backprops is converted by each site that
        reads it (`convert` of one tensor gives views of one memory, as `numpy_site` does, for the
        writer to see them shared)."""
        return Site(name=self.name, param=self.param, kind=self.kind,
                    tensors={k: convert(v) for k, v in self.tensors.items()}, precision=self.precision,
                    origin=self.origin, vocab=self.vocab,
                    autograd_rounding=None if self.autograd_rounding is None else convert(self.autograd_rounding),
                    conv=self.conv, backprops_of=self.backprops_of)


#: What makes two numpy arrays one array (`array_identity`).
ArrayIdentity = tuple[int, str, tuple[int, ...], tuple[int, ...]]


def array_identity(a: np.ndarray) -> ArrayIdentity:
    """What makes two numpy arrays one array: the same first byte, read as the same dtype, shape
    and strides. Meaningful only while both are held (a freed address is reused)."""
    return a.__array_interface__["data"][0], a.dtype.str, a.shape, a.strides


def share_backprops(sites: Sequence[Site[np.ndarray]]) -> list[Site[np.ndarray]]:
    """`sites`, each whose backprops are the very array an earlier site's are (the same memory,
    dtype, shape and strides: a bias's and its weight's, one output gradient reshaped alike)
    reading that site's (`backprops_of`), so that the writer writes the array once. All the
    arrays are held by `sites` while they are compared, so no address is another array's."""
    first: dict[ArrayIdentity, str] = {}
    for s in sites:
        a = s.tensors.get("backprops")
        if a is None or s.backprops_of is not None:
            continue
        key = array_identity(a)
        if key in first:
            s.backprops_of = first[key]
        else:
            first[key] = s.name
    return list(sites)
