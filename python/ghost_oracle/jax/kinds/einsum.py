"""Einsum layers, `nn.Einsum` and `nn.DenseGeneral` (and the `gemma` package's `Einsum`): a
kernel with N-D weights is a linear map from the input's contracted axes to the output's new
ones, so it is one `conv1d` site (in×out) once the kernel's contracted axes are taken first and
its output axes after them, each group flattened. `to_trace_layout` applies that permutation to
the kernel-shaped step tensors and to the self-check's batch gradient."""
from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._trace.format import TraceExportError
from ..sites import Call, Site, grad_of, precision_of


@dataclass(frozen=True)
class EinsumLayout:
    """How `x` (lhs), the kernel (rhs) and `y` (out) of one equation line up: the rows (the
    input's axes the kernel does not touch, batch first), the contracted axes and the output
    axes, each as letters."""

    lhs: str
    rhs: str
    out: str
    row_letters: str
    in_letters: str
    out_letters: str

    def kernel_permutation(self) -> list[int]:
        return [self.rhs.index(c) for c in self.in_letters + self.out_letters]

    def batch_axis(self) -> int:
        """The output's axis of the input's first (the examples'): the sites take the rows from
        the letters, wherever the equation puts them (gemma's kv einsum: `CBSKH`, axis 1)."""
        return self.out.index(self.lhs[0])


def _expand_ellipsis(eqn: str, x_ndim: int, where: str) -> str:
    if "..." not in eqn:
        return eqn
    lhs = eqn.split("->")[0].split(",")[0]
    used = set(eqn.replace("...", ""))
    free = [c for c in string.ascii_letters if c not in used]
    n = x_ndim - (len(lhs) - 3)
    if n < 0 or len(free) < n:
        raise TraceExportError(f"{where}: cannot read the equation {eqn!r} for an input of rank {x_ndim}")
    return eqn.replace("...", "".join(free[:n]))


def parse(eqn: str, x_ndim: int, where: str) -> EinsumLayout:
    eqn = _expand_ellipsis(eqn.replace(" ", ""), x_ndim, where)
    if "->" not in eqn or eqn.count(",") != 1:
        raise TraceExportError(f"{where}: einsum {eqn!r} is not of the form 'x,kernel->y' with an explicit output")
    ins, out = eqn.split("->")
    lhs, rhs = ins.split(",")
    if len(lhs) != x_ndim or len(set(lhs)) != len(lhs) or len(set(rhs)) != len(rhs):
        raise TraceExportError(f"{where}: einsum {eqn!r} does not match an input of rank {x_ndim} (or repeats a "
                               "letter within an operand)")
    shared = [c for c in rhs if c in lhs and c in out]
    if shared:
        raise TraceExportError(
            f"{where}: einsum {eqn!r} keeps the kernel's axis {shared[0]!r} in both the input and the output (a "
            "block-diagonal kernel, one matrix per index): that is not one linear map, and the exporter refuses it "
            "rather than write a wrong site")
    summed = [c for c in rhs if c not in lhs and c not in out]
    if summed:
        raise TraceExportError(f"{where}: einsum {eqn!r} sums over the kernel's own axis {summed[0]!r}")
    row_letters = "".join(c for c in lhs if c not in rhs)
    if not row_letters or row_letters[0] != lhs[0]:
        raise TraceExportError(f"{where}: einsum {eqn!r} contracts the input's first axis, where the examples lie")
    dropped = [c for c in row_letters if c not in out]
    if dropped:
        raise TraceExportError(f"{where}: einsum {eqn!r} sums the input's axis {dropped[0]!r} away")
    in_letters = "".join(c for c in rhs if c in lhs)
    out_letters = "".join(c for c in rhs if c in out)
    if sorted(out) != sorted(row_letters + out_letters):
        raise TraceExportError(f"{where}: einsum {eqn!r}: the output's axes are not the input's rows and the "
                               "kernel's output axes")
    return EinsumLayout(lhs, rhs, out, row_letters, in_letters, out_letters)


def _flat(a: np.ndarray, axes: str, row_letters: str, feature_letters: str) -> np.ndarray:
    order = [axes.index(c) for c in row_letters + feature_letters]
    t = np.transpose(a, order)
    b = t.shape[0]
    width = int(np.prod([a.shape[axes.index(c)] for c in feature_letters], dtype=np.int64))
    return t.reshape(b, -1, width)


def einsum_sites(call: Call, layout: EinsumLayout, x: np.ndarray, kernel_name: str,
                 bias_name: str | None) -> list[Site]:
    dy = grad_of(call)
    precision = precision_of(call.out_dtype, call.where)
    x = x.astype(call.out_dtype)
    perm = layout.kernel_permutation()
    kernel_shape = call.params[kernel_name].shape

    def to_layout(a: np.ndarray, perm: list[int] = perm, shape: tuple[int, ...] = kernel_shape) -> np.ndarray:
        return np.transpose(a.reshape(shape), perm).reshape(-1)

    identity = perm == sorted(perm)
    out = [Site("conv1d", call.param(kernel_name),
                {"activations": _flat(x, layout.lhs, layout.row_letters, layout.in_letters),
                 "backprops": _flat(dy, layout.out, layout.row_letters, layout.out_letters)},
                precision, call, to_trace_layout=to_layout, layout_name=f"{layout.rhs}->{layout.in_letters}|"
                                                                           f"{layout.out_letters}"
                if not identity else "identity")]
    if bias_name is not None and bias_name in call.params:
        # the bias's axes are the output's kernel axes in the output's order
        bias_letters = "".join(c for c in layout.out if c in layout.out_letters)
        out.append(Site("bias", call.param(bias_name),
                        {"backprops": _flat(dy, layout.out, layout.row_letters, bias_letters)}, precision, call))
    return out


class FlaxEinsum:
    """`nn.Einsum(shape, einsum_str)`: the equation is an attribute, or the call's argument."""

    def record(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        x = args[0] if args else kwargs["inputs"]
        eqn = args[1] if len(args) > 1 else kwargs.get("einsum_str")
        return (x, eqn)

    def sites(self, call: Call, batch: int) -> Sequence[Site]:
        x = np.asarray(call.args[0])
        eqn = call.args[1] if call.args[1] is not None else call.module.einsum_str
        return einsum_sites(call, parse(eqn, x.ndim, call.where), x, "kernel", "bias")

    def output_batch_axis(self, call: Call) -> int:
        eqn = call.args[1] if call.args[1] is not None else call.module.einsum_str
        return parse(eqn, np.ndim(call.args[0]), call.where).batch_axis()


class DenseGeneral:
    """`nn.DenseGeneral(features, axis)`: the contracted axes of the input, then the features."""

    def record(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        return (args[0] if args else kwargs["inputs"],)

    def sites(self, call: Call, batch: int) -> Sequence[Site]:
        m = call.module
        x = np.asarray(call.args[0])
        if tuple(getattr(m, "batch_dims", ())):
            raise TraceExportError(f"{call.where}: DenseGeneral with batch_dims (a kernel per index of those axes) "
                                   "is not one linear map; the exporter refuses it")
        axis = m.axis if isinstance(m.axis, (tuple, list)) else (m.axis,)
        axis = tuple(a % x.ndim for a in axis)
        features = m.features if isinstance(m.features, (tuple, list)) else (m.features,)
        letters = string.ascii_letters
        lhs = letters[:x.ndim]
        contracted = "".join(lhs[a] for a in axis)
        feats = letters[x.ndim:x.ndim + len(features)]
        rest = "".join(c for c in lhs if c not in contracted)
        eqn = f"{lhs},{contracted}{feats}->{rest}{feats}"
        return einsum_sites(call, parse(eqn, x.ndim, call.where), x, "kernel", "bias")


class GemmaEinsum:
    """The `gemma` package's `Einsum`: called as `layer(eqn, x)`, its weight named by
    `weight_name`."""

    def record(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        eqn = args[0] if args else kwargs["eqn"]
        x = args[1] if len(args) > 1 else kwargs["x"]
        return (x, eqn)

    def sites(self, call: Call, batch: int) -> Sequence[Site]:
        x = np.asarray(call.args[0])
        return einsum_sites(call, parse(call.args[1], x.ndim, call.where), x, call.module.weight_name, None)

    def output_batch_axis(self, call: Call) -> int:
        return parse(call.args[1], np.ndim(call.args[0]), call.where).batch_axis()

