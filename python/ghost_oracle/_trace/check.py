"""The self-check, written once for both exporters: nothing is written unless the batch gradient
rebuilt from a parameter's sites (their factors as stored) equals the framework's own batch
gradient (autograd's `p.grad`, `jax.grad`'s) to rounding, at a tolerance that follows each
site's precision (`precision.py`). Which parameters must have sites is the front-end's to say
(`torch/coverage.py`, `jax/check.py`); this holds one parameter's sites to its gradient.

It holds one parameter at a time, a block of rows at a time (a tied embedding and head in blocks
of vocabulary rows): its memory is a few hundred MiB above the factors, not a second copy of
every gradient. A parameter whose rebuild would cost more than `FULL_CHECK_PRODUCTS` products is
checked through a ±1 probe matrix (`_probe_matrix`).

The factors are numpy arrays as `Site` holds them (a bfloat16 factor as its raw bits in
uint16); the gradient too, in the parameter's layout as its sites write it, flattened.

A convolution stored as its input and geometry (`conv.py`) is rebuilt in tiles of examples, one
kernel offset at a time, and sketched the same way: its batch is never unfolded whole."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from . import conv
from .format import TraceExportError
from .precision import low_precision as is_low_precision
from .precision import reduction_tolerance, smallest_normal, unit_roundoff
from .site import SITE_KINDS, Precision, Site

#: Entries of one parameter rebuilt at a time: six f64 arrays of this many are 192 MiB.
_BLOCK_ENTRIES = 4 << 20

#: A parameter is checked entry by entry while rebuilding it costs at most this many products
#: (B·T·rows·cols over its linear and conv1d sites; 2²⁶ is a few hundredths of a second here).
#: Past it the check is sketched: at 1B-class sizes the entry-by-entry rebuild, two f64
#: products of every weight's size, took longer than the training step itself.
FULL_CHECK_PRODUCTS = 1 << 26
#: Columns of the sketch's ±1 probe matrix, and its seed.
SKETCH_COLUMNS = 4
_SKETCH_SEED = 0x5EED

#: The kinds whose layout is a matrix, which the sketch probes along its columns.
_MATRIX_KINDS = ("linear", "conv1d", "embedding")

Rows = tuple[int, int]


@dataclass(frozen=True)
class Against:
    """The framework whose batch gradient the sites are held to, as a refusal names it
    ("autograd", "jax.grad"), and the refusal's closing sentence: what it means there."""

    name: str
    hint: str


def widen(a: np.ndarray) -> np.ndarray:
    """`a` in float64: a uint16 array is bfloat16's raw bits (the upper half of a float32)."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64, copy=False)


def layout(site: Site[np.ndarray]) -> tuple[int, int]:
    """(rows, cols) of the parameter's gradient as the site writes it: the flattened parameter
    is rows blocks of cols entries (an embedding's or a head's rows are the vocabulary)."""
    out = site.tensors["backprops"].shape[-1]
    if site.conv is not None:
        return out, conv_cols(site)
    if site.kind == "embedding":
        if site.vocab is None:
            raise TraceExportError(f"site `{site.name}` ({site.origin}): an embedding site without its vocabulary")
        return site.vocab, out
    if site.kind in ("bias", "layernorm"):
        return out, 1
    if site.kind == "linear":
        return out, site.tensors["activations"].shape[-1]
    if site.kind == "conv1d":
        return site.tensors["activations"].shape[-1], out
    raise TraceExportError(f"site `{site.name}` ({site.origin}): unknown site kind {site.kind!r}; the kinds are "
                           f"{', '.join(SITE_KINDS)}")


def conv_cols(site: Site[np.ndarray]) -> int:
    """A conv-input site's columns, C_in/g · ∏k, once its tensors are held to its geometry
    (`conv.conv_shape`); a TraceExportError naming the site where they do not fit it."""
    geo = site.conv
    assert geo is not None
    if site.kind != "linear":
        raise TraceExportError(f"site `{site.name}` ({site.origin}): a convolution's geometry on a {site.kind} site; "
                               "only a linear site (a convolution's weight) carries one")
    missing = [k for k in ("inputs", "backprops") if k not in site.tensors]
    extra = [k for k in site.tensors if k not in ("inputs", "backprops")]
    if missing or extra:
        raise TraceExportError(f"site `{site.name}` ({site.origin}): a conv-input site holds `inputs` and `backprops`"
                               f"; it has {sorted(site.tensors)}")
    try:
        shape = conv.conv_shape(geo, site.tensors["inputs"].shape, site.tensors["backprops"].shape)
    except ValueError as e:
        raise TraceExportError(f"site `{site.name}` ({site.origin}): {e}") from e
    return shape.c_in // geo.groups * geo.taps


def _flat(a: np.ndarray) -> np.ndarray:
    """B×R×features as (B·R)×features, a view where the array allows one."""
    return a.reshape(-1, a.shape[-1])


@dataclass
class _Lookups:
    """An embedding site's ids in sorted order, so that a block of vocabulary rows is one
    contiguous run of them: `order` the permutation of the B·R lookups, `ids` the sorted ids."""

    order: np.ndarray
    ids: np.ndarray

    @staticmethod
    def of(site: Site[np.ndarray]) -> _Lookups:
        ids = site.tensors["ids"].reshape(-1).astype(np.int64, copy=False)
        order = np.argsort(ids, kind="stable")
        return _Lookups(order=order, ids=ids[order])

    def run(self, rows: Rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The lookups whose id lies in rows (start, stop): (their positions among the B·R, the
        block's row each adds into, the start of each row's run among them)."""
        lo, hi = np.searchsorted(self.ids, rows, side="left")
        ids = self.ids[lo:hi]
        starts = np.flatnonzero(np.diff(ids, prepend=-1)) if hi > lo else np.zeros(0, dtype=np.int64)
        return self.order[lo:hi], ids[starts] - rows[0], starts


def _scatter_rows(values: np.ndarray, at: np.ndarray, starts: np.ndarray, n_rows: int) -> np.ndarray:
    """n_rows × k: the rows of `values` (m × k, grouped by their row, each group beginning at
    `starts`) summed into their rows `at`; the rows no lookup reaches 0. One reduceat, not a
    Python loop or an unbuffered scatter."""
    out = np.zeros((n_rows, values.shape[1]))
    if len(starts):
        out[at] = np.add.reduceat(values, starts, axis=0)
    return out


@dataclass
class _SiteCheck:
    """What the check of one parameter keeps of one of its sites between blocks of rows: the
    embedding's sorted lookups and the sketch's products with the probe matrix (B·R × k each),
    never a whole f64 copy of a factor."""

    site: Site[np.ndarray]
    lookups: _Lookups | None = None
    probed: tuple[np.ndarray, np.ndarray] | None = None
    #: told (tiles done, tiles in all) as a conv-input site's tiles of examples are checked
    on_tile: Callable[[int, int], None] | None = None

    def sorted_lookups(self) -> _Lookups:
        if self.lookups is None:
            self.lookups = _Lookups.of(self.site)
        return self.lookups


def rebuild(site: Site[np.ndarray], rows: Rows | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(Σ over examples and rows of the site's gradient, the same sum of |terms|), f64, in the
    parameter's layout flattened; `rows` (start, stop): only those rows of the layout
    (`layout`), so that a large table is rebuilt a block at a time."""
    return _rebuild(_SiteCheck(site), rows)


def _rebuild(sc: _SiteCheck, rows: Rows | None) -> tuple[np.ndarray, np.ndarray]:
    site, ts = sc.site, sc.site.tensors
    n_rows, _ = layout(site)
    start, stop = (0, n_rows) if rows is None else rows
    if site.conv is not None:
        return conv.rebuild(ts["inputs"], ts["backprops"], site.conv, (start, stop), sc.on_tile)
    if site.kind == "embedding":
        at_lookup, at_row, starts = sc.sorted_lookups().run((start, stop))
        g = widen(_flat(ts["backprops"])[at_lookup])
        full = _scatter_rows(g, at_row, starts, stop - start)
        absum = _scatter_rows(np.abs(g), at_row, starts, stop - start)
        return full.reshape(-1), absum.reshape(-1)
    g_all = _flat(ts["backprops"])
    if site.kind in ("bias", "linear", "layernorm"):
        g_all = g_all[:, start:stop]
    a_all = None
    if site.kind != "bias":
        a_all = _flat(ts["activations"])
        if site.kind in ("conv1d", "layernorm"):
            a_all = a_all[:, start:stop]
    sums: tuple[np.ndarray, np.ndarray] | None = None
    for r0, r1 in _row_chunks(g_all.shape[0], g_all.shape[1] + (0 if a_all is None else a_all.shape[1])):
        part, mag = _rows_sums(site.kind, widen(g_all[r0:r1]), None if a_all is None else widen(a_all[r0:r1]))
        sums = (part, mag) if sums is None else (sums[0] + part, sums[1] + mag)
    assert sums is not None  # one chunk at least
    return sums


#: Bytes of f64 rows a row-form site is widened and summed in at a time: a whole site's f64
#: temporaries (B·R rows: 128 MiB each for one GroupNorm of WRN-16-4 at B = 256) are fresh
#: allocations the kernel zeroes page by page, which took up to 25 times the arithmetic.
_ROW_CHUNK_BYTES = 4 << 20


def _row_chunks(n: int, width: int) -> list[tuple[int, int]]:
    """Ranges of `n` rows of `width` f64 values, about `_ROW_CHUNK_BYTES` each; one, empty, for
    no rows."""
    step = max(1, _ROW_CHUNK_BYTES // (8 * max(width, 1)))
    return [(r, min(r + step, n)) for r in range(0, n, step)] or [(0, 0)]


def _rows_sums(kind: str, g: np.ndarray, a: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(Σ over the rows of the gradient they write, the same sum of |terms|), f64, flattened in the
    parameter's layout: `g` the rows' backprops and `a` their activations (None for a bias)."""
    if kind == "bias" or a is None:
        return g.sum(0), np.abs(g).sum(0)
    if kind == "layernorm":
        prod = g * a
        return prod.sum(0), np.abs(prod).sum(0)
    if kind == "linear":  # G = gᵀa: rows are the output features
        return (g.T @ a).reshape(-1), (np.abs(g).T @ np.abs(a)).reshape(-1)
    return (a.T @ g).reshape(-1), (np.abs(a).T @ np.abs(g)).reshape(-1)  # conv1d: G = aᵀg


def sketch(site: Site[np.ndarray], rows: Rows, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`rebuild`'s two sums for rows (start, stop) of the layout, each multiplied on the right
    by `v` (cols × k, f64), without forming them: (G·v, |terms|·|v|), each (stop - start) × k.
    A linear site's G is Σ gᵀa, so G·v = gᵀ(a·v): B·T·(in + out)·k products where the rebuild
    takes B·T·in·out. Only the kinds with a matrix layout (linear, conv1d, embedding)."""
    return _sketch(_SiteCheck(site), rows, v)


def _sketch(sc: _SiteCheck, rows: Rows, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    site, ts = sc.site, sc.site.tensors
    start, stop = rows
    if site.kind not in _MATRIX_KINDS:
        raise TraceExportError(f"site `{site.name}` ({site.origin}): a {site.kind} site has one column; it is "
                               "rebuilt, not sketched")
    if site.conv is not None:  # the patches times v, formed a tile at a time: never the whole unfolded batch
        layout(site)
        return conv.sketch(ts["inputs"], ts["backprops"], site.conv, rows, v, sc.on_tile)
    if sc.probed is None:  # the factor along the columns, times v: the same for every block
        along = widen(_flat(ts["backprops"] if site.kind in ("embedding", "conv1d") else ts["activations"]))
        sc.probed = (along @ v, np.abs(along) @ np.abs(v))
    pv, pav = sc.probed
    if site.kind == "embedding":
        at_lookup, at_row, starts = sc.sorted_lookups().run(rows)
        return (_scatter_rows(pv[at_lookup], at_row, starts, stop - start),
                _scatter_rows(pav[at_lookup], at_row, starts, stop - start))
    # the factor along the rows: a linear site's output features, a conv1d site's input features
    g = widen(_flat(ts["backprops"] if site.kind == "linear" else ts["activations"])[:, start:stop])
    return g.T @ pv, np.abs(g).T @ pav


def low_precision_rounds(site: Site[np.ndarray], rows: Rows | None = None) -> np.ndarray | None:
    """The roundings per entry a low-precision backward of this kind adds, where the kind has its
    own count (None: the default of `precision.reduction_tolerance`). An embedding's backward
    adds each lookup's row into the table in the low precision, one rounding per occurrence of
    the id: count + 4 for that row. `rows` (start, stop): those rows of the layout only."""
    return _low_precision_rounds(_SiteCheck(site), rows)


def _low_precision_rounds(sc: _SiteCheck, rows: Rows | None, per_row: bool = False) -> np.ndarray | None:
    """`low_precision_rounds`; `per_row`: one count a row (the same along it), rows × 1."""
    site = sc.site
    if site.kind != "embedding" or not is_low_precision(site.precision):
        return None
    n_rows, cols = layout(site)
    start, stop = (0, n_rows) if rows is None else rows
    at_lookup, at_row, starts = sc.sorted_lookups().run((start, stop))
    count = np.zeros(stop - start)
    count[at_row] = np.diff(np.append(starts, len(at_lookup)))  # the length of each row's run
    per = (count + 4.0)[:, None]
    return per if per_row else np.broadcast_to(per, (stop - start, cols)).reshape(-1)


def check_layouts(parameter: str, uses: Sequence[Site[np.ndarray]], numel: int) -> None:
    """Raises unless every site of the parameter lays out exactly its `numel` entries."""
    for site in uses:
        r, c = layout(site)
        if r * c != numel:
            raise TraceExportError(f"{parameter}: site `{site.name}` ({site.kind}, {site.origin}) rebuilds {r * c} "
                                   f"entries but the parameter has {numel}")


def _blocks(uses: Sequence[Site[np.ndarray]]) -> list[Rows | None]:
    """Row ranges of the parameter's layout, each a block of about `_BLOCK_ENTRIES` entries:
    a tied embedding and head (V×d) is rebuilt a block of vocabulary rows at a time, never
    whole. One block where the sites lay the parameter out with different rows."""
    layouts = {layout(s) for s in uses}
    if len(layouts) != 1:
        return [None]
    rows, cols = layouts.pop()
    step = max(1, _BLOCK_ENTRIES // max(cols, 1))
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def _probe_matrix(uses: Sequence[Site[np.ndarray]], numel: int) -> np.ndarray | None:
    """The ±1 matrix (cols × SKETCH_COLUMNS) the parameter's gradient is checked through, or
    None where it is checked entry by entry: where rebuilding it is cheap, and where its sites
    have no common matrix layout.

    The sketch compares G·v with the framework's gradient·v, where G is the gradient the sites
    rebuild: a linear site's G·v = gᵀ(a·v) costs B·T·(in + out)·k products, not B·T·in·out.
    Its bound is the entries' bounds summed through |v|, so it never refuses a right trace, and
    a site wrong by a structural factor (a missing scale, a skipped use, a wrong layout) moves
    every row's k sums by about √cols times the entries' error, far past it. What it gives up
    is the entry-by-entry resolution: an error confined to a few entries of a row, below the
    row's summed bound, passes."""
    layouts = {layout(s) for s in uses}
    if len(layouts) != 1 or any(s.kind not in _MATRIX_KINDS for s in uses):
        return None
    _, cols = layouts.pop()
    cost = sum(_terms(s) * numel for s in uses if s.kind in ("linear", "conv1d"))
    if cols == 1 or cost <= FULL_CHECK_PRODUCTS:
        return None
    rng = np.random.default_rng(_SKETCH_SEED)
    return (rng.integers(0, 2, (cols, SKETCH_COLUMNS)) * 2 - 1).astype(np.float64)


def _terms(site: Site[np.ndarray]) -> int:
    """Terms each entry of the site's gradient sums: B·R (B·T, or B·T·H for a per-head norm)."""
    g = site.tensors["backprops"]
    return int(g.size // max(g.shape[-1], 1))


def _autograd_rounding(site: Site[np.ndarray], block: Rows | None, cols: int,
                       v: np.ndarray | None) -> np.ndarray | float:
    """The rounding the framework's own backward adds to a site whose factors are exact where the
    framework's are not (`site.autograd_rounding`, in the parameter's layout): GroupNorm with one
    value a group, whose exact weight gradient 0 autograd forms by a cancellation scaled by
    1/√ε. 0 for every other site."""
    bound = site.autograd_rounding
    if bound is None:
        return 0.0
    flat = widen(bound.reshape(-1))
    if block is not None:
        flat = flat[block[0] * cols:block[1] * cols]
    if v is not None:  # a sketched sum's entries gather a row's bounds through |v|
        flat = np.asarray(flat.reshape(-1, cols) @ np.abs(v)).reshape(-1)
    return flat


def check_parameter(parameter: str, uses: Sequence[Site[np.ndarray]], grad: np.ndarray,
                    param_precision: Precision, store: Precision | None, against: Against,
                    on_tile: Callable[[int, int], None] | None = None) -> None:
    """Holds the batch gradient rebuilt from `uses` (the sites of one parameter) to the
    framework's `grad` (the parameter's own, flattened in its sites' layout; a bfloat16 gradient
    as its raw bits), a block of rows at a time, entry by entry or sketched (`_probe_matrix`);
    raises naming the worst entry. `parameter`: how messages name it ("parameter `w` (module
    `fc` (Linear))"); `param_precision`: its dtype's, in which the framework adds the uses of a
    tied parameter; `store`: the precision every factor is stored in (None: each site's own);
    `on_tile`: told (tiles done, tiles in all) as a conv-input site's tiles of examples are
    checked, for a progress line."""
    if not uses:
        raise TraceExportError(f"{parameter}: no site to check it against")
    grad = grad.reshape(-1)
    numel = int(grad.size)
    check_layouts(parameter, uses, numel)
    checks = [_SiteCheck(s, on_tile=on_tile) for s in uses]
    v = _probe_matrix(uses, numel)
    cols = layout(uses[0])[1]
    mass = 1.0 if v is None else float(cols)  # Σ_i |v_ik|
    # terms per entry of the sketch's second product, B·T (B·T·H for a per-head use)
    terms = max(_terms(s) for s in uses)
    worst: tuple[float, int, float, float, float, float] | None = None  # (error / tolerance, entry, rebuilt,
    # framework's, error, tolerance)
    bad_count = 0
    checked = 0
    for block in _blocks(uses):
        rebuilt: np.ndarray | None = None
        absum: np.ndarray | None = None
        tol: np.ndarray | None = None
        for sc in checks:
            site = sc.site
            if v is None:
                r, a = _rebuild(sc, block)
                rounds = _low_precision_rounds(sc, block)
            else:
                assert block is not None  # a sketched parameter has one layout, so row blocks
                r, a = _sketch(sc, block, v)
                r, a = r.reshape(-1), a.reshape(-1)
                per_row = _low_precision_rounds(sc, block, per_row=True)
                # an embedding's count is the same along a row
                rounds = None if per_row is None else np.broadcast_to(per_row, (len(per_row), v.shape[1])).reshape(-1)
            rebuilt = r if rebuilt is None else rebuilt + r
            absum = a if absum is None else absum + a
            t = reduction_tolerance(a, site.precision, site.precision if store is None else store, _terms(site),
                                    rounds, mass)
            t = t + _autograd_rounding(site, block, cols, v)
            tol = t if tol is None else tol + t
        assert rebuilt is not None and absum is not None and tol is not None  # a parameter has uses
        # the framework adds the uses of a tied parameter into its gradient in the parameter's dtype
        tol = tol + 2.0 * (len(uses) - 1) * unit_roundoff(param_precision) * absum \
            + smallest_normal(param_precision) * mass
        if v is None:
            offset = 0 if block is None else block[0] * cols  # blocks come with one layout only
            want = widen(grad[offset:offset + rebuilt.size])
        else:
            assert block is not None
            offset = block[0] * v.shape[1]
            own = widen(grad[block[0] * cols:block[1] * cols]).reshape(-1, cols)
            want = (own @ v).reshape(-1)
            # the two f64 products of the sketch round too: ≤ (cols + B·T)·u64 of their terms
            own_terms = (np.abs(own) @ np.abs(v)).reshape(-1)
            tol = tol + 2.0 * (cols + terms) * unit_roundoff("f64") * (absum + own_terms)
        checked += rebuilt.size
        err = np.abs(rebuilt - want)
        bad = err > tol
        if bad.any():
            bad_count += int(bad.sum())
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.where(bad, err / tol, 0.0)
            k = int(np.argmax(ratio))
            if worst is None or float(ratio[k]) > worst[0]:
                worst = (float(ratio[k]), offset + k, float(rebuilt[k]), float(want[k]), float(err[k]), float(tol[k]))
    if worst is not None:
        _, k, rebuilt_k, want_k, err_k, tol_k = worst
        site_list = ", ".join(f"`{s.name}` ({s.kind}, {s.origin}, computed in {s.precision})" for s in uses)
        if v is None:
            what, at = f"at {bad_count} of {checked} entries", f"entry {k}"
        else:
            what = (f"through a ±1 probe matrix (cols × {v.shape[1]}, the check of a large parameter) at "
                    f"{bad_count} of {checked} probed sums")
            at = f"row {k // v.shape[1]}, probe {k % v.shape[1]}"
        raise TraceExportError(
            f"{parameter}: the gradient rebuilt from its sites {site_list} differs from {against.name}'s {what}; "
            f"worst {at}: rebuilt {rebuilt_k:.6e}, {against.name} {want_k:.6e}, |error| {err_k:.3e} > tolerance "
            f"{tol_k:.3e}. {against.hint}")
