"""What the program's interpreter holds for each variable of the jaxpr (`Val`), what it knows of
a parameter seen through layout-only steps (`View`), and what one use of a parameter becomes
(`Use`: a site of the trace, in the parameter's own flattened layout)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from ..._trace.format import TraceExportError
from ..._trace.site import SiteKind

#: CONST: computed from literals and the program's constants alone (folded as it is met, so
#: that loop counters and indices stay concrete); VIEW: a parameter through layout-only steps;
#: PLAIN: anything else (the example's data and everything computed from it or from a use).
Status = Literal["const", "view", "plain"]


@dataclass
class View:
    """A parameter leaf seen through layout-only steps: `index` holds, for every element of the
    value, its flat position in the leaf (the same steps applied to `arange(leaf.size)`)."""

    leaf: int
    index: np.ndarray


@dataclass
class Val:
    value: Any
    status: Status
    view: View | None = None

    @staticmethod
    def plain(value: Any) -> Val:
        return Val(value, "plain")


@dataclass
class Use:
    """One use of a parameter: a site. `perm[j]` is the flat position, in the parameter (the
    leaf, or its layer `layer` when the leaf is stacked), of entry j of the site's layout
    (linear out×in, conv1d in×out, embedding V×d, layernorm/bias k) flattened; None where that
    is the parameter's own order. `rows_of`
    maps the per-example output gradients (B×out_shape) to the site's backprops B×R×out."""

    kind: SiteKind
    leaf: int
    layer: int | None
    perm: np.ndarray | None
    precision: str
    where: str
    rows_of: Callable[[np.ndarray], np.ndarray]
    out_shape: tuple[int, ...] = ()
    out_dtype: Any = None
    vocab: int | None = None
    clip_ids: bool = False  # the gather clamps its ids into the table (GatherScatterMode.CLIP)


def move_last(out_ndim: int, feature_axes: list[int]) -> tuple[int, ...]:
    """The axes of an output in the order rows first (every axis but the features, in order),
    then the features in the order given."""
    return tuple([a for a in range(out_ndim) if a not in feature_axes] + list(feature_axes))


def rows_mapper(axes: tuple[int, ...], width: int) -> Callable[[np.ndarray], np.ndarray]:
    """B×out → B×R×width, the output's axes taken in the order `axes` (rows, then features)."""
    def rows_of(a: np.ndarray) -> np.ndarray:
        moved = np.transpose(a, (0, *(1 + x for x in axes)))
        return np.ascontiguousarray(moved).reshape(a.shape[0], -1, width)
    return rows_of


def refuse(name: str, primitive: str, where: str, why: str) -> TraceExportError:
    return TraceExportError(f"parameter `{name}` is used by `{primitive}` ({where}): {why}; the program route models "
                            "a parameter used through layout-only steps (reshape, transpose, broadcast, convert, "
                            "slicing of a stacked axis) by dot_general, gather of rows of a 2-D table, an "
                            "elementwise scale or shift, or conv_general_dilated")


def bind(eqn: Any, values: Sequence[Any]) -> list[Any]:
    """`eqn`'s primitive applied to `values`, as `jax.core.eval_jaxpr` applies it."""
    got = eqn.primitive.get_bind_params(eqn.params)
    # older JAX returns (subfuns, params), newer the params alone
    subfuns, params = got if isinstance(got, tuple) else ((), got)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*subfuns, *values, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


class Walking(Protocol):
    """What a use's or a sub-program's handler reads of the walk it is part of (the
    interpreter's `Walker`; a protocol here so that the handlers and the interpreter that
    dispatches to them import nothing of each other)."""

    #: the sub-programs the walk is inside, outermost first (for messages)
    context: list[str]
    #: each parameter leaf's `arange(size)` in its shape, and its shape
    indices: list[np.ndarray]
    leaf_shapes: list[tuple[int, ...]]

    def where(self, primitive: str) -> str: ...

    def site(self, use: Use, out: Any, recorded: dict[str, Any]) -> Any: ...

    def run_closed(self, closed: Any, args: Sequence[Val]) -> list[Val]: ...

    def run(self, jaxpr: Any, consts: Sequence[Val], args: Sequence[Val]) -> list[Val]: ...

    def name(self, leaf: int) -> str: ...
