"""A convolution's weight as a trace of format `ghost-oracle-trace/2` holds it: the layer's
input (B×C_in×S_1…S_n) and its output gradient (B×P×C_out), with the geometry that turns them
into the gradient (docs/trace-format.md). Each input value is stored once, where the unfolded
`linear` form of format /1 stores it ∏k times.

For example i, output channel o of group j = o // (C_out/g) and column (c, κ):

    G_i[o, (c, κ)] = Σ_p δ_i[p, o] · x̃_i[j·C_in/g + c, p_1·s_1 + κ_1·d_1, …, p_n·s_n + κ_n·d_n]

x̃ the input zero-padded by (lo_d, hi_d) on each spatial axis. Everything here walks the batch
in tiles of examples and the kernel one offset κ at a time: for one κ the positions
p·s + κ·d are one strided view of x̃, so no tile is ever unfolded ∏k times. numpy only."""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: f64 bytes of one tile of examples (its padded input, one offset's view of it, its output
#: gradient): the rebuild's memory above the factors.
TILE_BYTES = 64 << 20


@dataclass(frozen=True)
class ConvGeometry:
    """How a convolution slides, as the header's `conv` entry writes it: per spatial axis the
    kernel size, stride, dilation and zero padding (lo, hi), and the number of groups."""

    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]
    groups: int

    def __post_init__(self) -> None:
        n = len(self.kernel)
        if n < 1:
            raise ValueError("a convolution's geometry needs at least one spatial axis")
        for what, values in (("stride", self.stride), ("dilation", self.dilation), ("padding", self.padding)):
            if len(values) != n:
                raise ValueError(f"the convolution's {what} has {len(values)} axes; its kernel has {n}")
        if any(int(k) < 1 for k in (*self.kernel, *self.stride, *self.dilation)) or int(self.groups) < 1:
            raise ValueError(f"the convolution's kernel {list(self.kernel)}, stride {list(self.stride)}, dilation "
                             f"{list(self.dilation)} and groups {self.groups} must be positive integers")
        if any(len(p) != 2 or int(p[0]) < 0 or int(p[1]) < 0 for p in self.padding):
            raise ValueError(f"the convolution's padding {[list(p) for p in self.padding]} must be (lo, hi) pairs "
                             "≥ 0")

    def spec(self) -> dict[str, Any]:
        """The header's `conv` entry."""
        return {"kernel": [int(k) for k in self.kernel], "stride": [int(s) for s in self.stride],
                "dilation": [int(d) for d in self.dilation],
                "padding": [[int(lo), int(hi)] for lo, hi in self.padding], "groups": int(self.groups)}

    @staticmethod
    def of_spec(spec: Mapping[str, Any]) -> ConvGeometry:
        """The geometry a header's `conv` entry writes."""
        return ConvGeometry(kernel=tuple(spec["kernel"]), stride=tuple(spec["stride"]),
                            dilation=tuple(spec["dilation"]),
                            padding=tuple((int(lo), int(hi)) for lo, hi in spec["padding"]),
                            groups=int(spec["groups"]))

    @property
    def taps(self) -> int:
        """∏k: the kernel's offsets."""
        return math.prod(self.kernel)

    def outputs(self, spatial: Sequence[int]) -> tuple[int, ...]:
        """O_d = floor((S_d + lo_d + hi_d − d_d·(k_d − 1) − 1) / s_d) + 1 for input sizes S."""
        return tuple((s + lo + hi - d * (k - 1) - 1) // st + 1 for s, (lo, hi), d, k, st
                     in zip(spatial, self.padding, self.dilation, self.kernel, self.stride, strict=True))

    def offsets(self, outputs: Sequence[int]) -> Iterator[tuple[slice, ...]]:
        """For each offset κ (row-major), the view of the padded input's spatial axes that holds
        x̃[p·s + κ·d] at output position p."""
        for kappa in itertools.product(*(range(k) for k in self.kernel)):
            yield tuple(slice(k * d, k * d + s * (o - 1) + 1, s)
                        for k, d, s, o in zip(kappa, self.dilation, self.stride, outputs, strict=True))


@dataclass(frozen=True)
class ConvShape:
    """A conv-input site's sizes, checked against its geometry."""

    b: int
    c_in: int
    c_out: int
    outputs: tuple[int, ...]

    @property
    def positions(self) -> int:
        return math.prod(self.outputs)


def conv_shape(geo: ConvGeometry, inputs_shape: Sequence[int], backprops_shape: Sequence[int]) -> ConvShape:
    """The sizes of a site's `inputs` (B×C_in×S…) and `backprops` (B×P×C_out); a ValueError
    saying what does not fit the geometry."""
    n = len(geo.kernel)
    if len(inputs_shape) != n + 2:
        raise ValueError(f"its inputs have shape {list(inputs_shape)}; a convolution with {n} spatial axes reads "
                         f"examples × channels × {n} axes")
    if len(backprops_shape) != 3 or backprops_shape[0] != inputs_shape[0]:
        raise ValueError(f"its backprops have shape {list(backprops_shape)}; with inputs {list(inputs_shape)} they "
                         "are examples × positions × output channels")
    b, c_in = int(inputs_shape[0]), int(inputs_shape[1])
    c_out = int(backprops_shape[2])
    if c_in % geo.groups or c_out % geo.groups:
        raise ValueError(f"{c_in} input and {c_out} output channels do not split into {geo.groups} groups")
    outputs = geo.outputs([int(s) for s in inputs_shape[2:]])
    if any(o < 1 for o in outputs):
        raise ValueError(f"inputs of spatial size {list(inputs_shape[2:])} leave no output position under the "
                         f"geometry {geo.spec()}")
    shape = ConvShape(b=b, c_in=c_in, c_out=c_out, outputs=outputs)
    if int(backprops_shape[1]) != shape.positions:
        raise ValueError(f"its backprops have {backprops_shape[1]} positions; the geometry {geo.spec()} on inputs "
                         f"{list(inputs_shape)} gives {'×'.join(map(str, outputs))} = {shape.positions}")
    return shape


def f64(a: np.ndarray) -> np.ndarray:
    """`a` in float64: a uint16 array is bfloat16's raw bits (the upper half of a float32)."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64, copy=False)


def _tiles(shape: ConvShape, geo: ConvGeometry, spatial: Sequence[int]) -> list[tuple[int, int]]:
    padded = math.prod(s + lo + hi for s, (lo, hi) in zip(spatial, geo.padding, strict=True))
    per_example = 8 * (shape.c_in * (padded + shape.positions) + 3 * shape.c_out * shape.positions)
    step = max(1, TILE_BYTES // max(per_example, 1))
    return [(i, min(i + step, shape.b)) for i in range(0, shape.b, step)]


def _padded(geo: ConvGeometry, x: np.ndarray) -> np.ndarray:
    if not any(lo or hi for lo, hi in geo.padding):
        return x
    return np.pad(x, [(0, 0), (0, 0), *geo.padding])


def _tile(inputs: np.ndarray, backprops: np.ndarray, geo: ConvGeometry, shape: ConvShape, examples: tuple[int, int],
          groups: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Examples (t0, t1) of groups (first, count), in f64: the input zero-padded (t × C × S̃…)
    and the output gradient as groups × C_out/g × (t·P), the rows of its products."""
    (t0, t1), (j0, gs) = examples, groups
    cin_g, cout_g = shape.c_in // geo.groups, shape.c_out // geo.groups
    x = _padded(geo, f64(inputs[t0:t1, j0 * cin_g:(j0 + gs) * cin_g]))
    d = f64(backprops[t0:t1, :, j0 * cout_g:(j0 + gs) * cout_g]).reshape(t1 - t0, shape.positions, gs, cout_g)
    return x, np.ascontiguousarray(d.transpose(2, 3, 0, 1)).reshape(gs, cout_g, (t1 - t0) * shape.positions)


#: (tiles done, tiles in all), after each tile of examples.
OnTile = Callable[[int, int], None]


def _groups(shape: ConvShape, geo: ConvGeometry, rows: tuple[int, int] | None) -> tuple[int, int, int, int]:
    """(first group, groups, first row, last row) of the rows (output channels) asked for."""
    start, stop = (0, shape.c_out) if rows is None else rows
    cout_g = shape.c_out // geo.groups
    j0 = start // cout_g
    j1 = (stop - 1) // cout_g + 1 if stop > start else j0
    return j0, j1 - j0, start - j0 * cout_g, stop - j0 * cout_g


def rebuild(inputs: np.ndarray, backprops: np.ndarray, geo: ConvGeometry, rows: tuple[int, int] | None = None,
            on_tile: OnTile | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(Σ_i G_i, Σ_i Σ_p |terms|), f64, rows (start, stop) of the layout C_out × (C_in/g · ∏k)
    (all of them for None), flattened: the batch gradient a conv-input site defines and the sum
    of its terms' magnitudes, which the tolerance scales with."""
    shape = conv_shape(geo, inputs.shape, backprops.shape)
    g, k = geo.groups, geo.taps
    cin_g, cout_g = shape.c_in // g, shape.c_out // g
    j0, gs, lo, hi = _groups(shape, geo, rows)
    out = np.zeros((gs, cout_g, cin_g, k))
    mag = np.zeros((gs, cout_g, cin_g, k))
    tiles = _tiles(shape, geo, inputs.shape[2:])
    for n, (t0, t1) in enumerate(tiles):
        t, tp = t1 - t0, (t1 - t0) * shape.positions
        x, dg = _tile(inputs, backprops, geo, shape, (t0, t1), (j0, gs))
        dabs = np.abs(dg)
        for kappa, view in enumerate(geo.offsets(shape.outputs)):
            xk = x[(slice(None), slice(None)) + view].reshape(t, gs, cin_g, shape.positions)
            xg = np.ascontiguousarray(xk.transpose(1, 0, 3, 2)).reshape(gs, tp, cin_g)
            out[..., kappa] += dg @ xg
            mag[..., kappa] += dabs @ np.abs(xg)
        if on_tile is not None:
            on_tile(n + 1, len(tiles))
    return (out.reshape(gs * cout_g, cin_g * k)[lo:hi].reshape(-1),
            mag.reshape(gs * cout_g, cin_g * k)[lo:hi].reshape(-1))


def sketch(inputs: np.ndarray, backprops: np.ndarray, geo: ConvGeometry, rows: tuple[int, int], v: np.ndarray,
           on_tile: OnTile | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`rebuild`'s two sums for rows (start, stop), each times `v` ((C_in/g · ∏k) × m) on the
    right, without forming them: G·v = Σ_p δ_pᵀ (Σ_κ x̃_{p,κ} v_κ), B·P·C_in·∏k·m products for
    the inner sums where the rebuild takes B·P·C_in·∏k·C_out/g. Each (stop - start) × m."""
    shape = conv_shape(geo, inputs.shape, backprops.shape)
    g, k, m = geo.groups, geo.taps, v.shape[1]
    cin_g, cout_g = shape.c_in // g, shape.c_out // g
    j0, gs, lo, hi = _groups(shape, geo, rows)
    vk = v.reshape(cin_g, k, m)
    vabs = np.abs(vk)
    # |v|'s columns are one column repeated for a ±1 probe matrix: the magnitudes' sums are then
    # taken for that one column and repeated, a fifth of the sketch's products and memory traffic
    ma = 1 if m > 1 and bool((vabs == vabs[..., :1]).all()) else m
    vabs = vabs[..., :ma]
    out = np.zeros((gs, cout_g, m))
    mag = np.zeros((gs, cout_g, ma))
    tiles = _tiles(shape, geo, inputs.shape[2:])
    for n, (t0, t1) in enumerate(tiles):
        t, tp = t1 - t0, (t1 - t0) * shape.positions
        x, dg = _tile(inputs, backprops, geo, shape, (t0, t1), (j0, gs))
        if math.prod(x.shape[2:]) <= 2 * shape.positions:
            # stride 1: the channels contracted first, on the whole padded tile (one product for
            # every offset and probe), then each offset's strided view of it summed: the tile is
            # read once
            xs = x.reshape(t, gs, cin_g, *x.shape[2:])
            z = np.tensordot(xs, vk.reshape(cin_g, k * m), axes=([2], [0])).reshape(*xs.shape[:2], *x.shape[2:], k, m)
            zabs = np.tensordot(np.abs(xs), vabs.reshape(cin_g, k * ma),
                                axes=([2], [0])).reshape(*xs.shape[:2], *x.shape[2:], k, ma)
            y = np.zeros((t, gs, *shape.outputs, m))
            yabs = np.zeros((t, gs, *shape.outputs, ma))
            for kappa, view in enumerate(geo.offsets(shape.outputs)):
                at = (slice(None), slice(None)) + view + (kappa,)
                y += z[at]
                yabs += zabs[at]
            y, yabs = y.reshape(t, gs, shape.positions, m), yabs.reshape(t, gs, shape.positions, ma)
        else:
            # strided (a patch embedding, stride = kernel): the whole tile times every offset
            # would be (input positions / output positions) times the work and memory, so each
            # offset's own view is contracted alone
            y = np.zeros((t, gs, shape.positions, m))
            yabs = np.zeros((t, gs, shape.positions, ma))
            for kappa, view in enumerate(geo.offsets(shape.outputs)):
                xk = x[(slice(None), slice(None)) + view].reshape(t, gs, cin_g, shape.positions)
                y += np.tensordot(xk, vk[:, kappa], axes=([2], [0]))
                yabs += np.tensordot(np.abs(xk), vabs[:, kappa], axes=([2], [0]))
        out += dg @ np.ascontiguousarray(y.transpose(1, 0, 2, 3)).reshape(gs, tp, m)
        mag += np.abs(dg) @ np.ascontiguousarray(yabs.transpose(1, 0, 2, 3)).reshape(gs, tp, ma)
        if on_tile is not None:
            on_tile(n + 1, len(tiles))
    mag = np.broadcast_to(mag, (gs, cout_g, m))
    return out.reshape(gs * cout_g, m)[lo:hi], mag.reshape(gs * cout_g, m)[lo:hi]


def per_example(inputs: np.ndarray, backprops: np.ndarray, geo: ConvGeometry, t0: int, t1: int) -> np.ndarray:
    """G_i for examples t0 ≤ i < t1, f64, (t1 - t0) × C_out × (C_in/g · ∏k): each example's
    gradient of the weight, materialized (the model's rounding is measured on it)."""
    shape = conv_shape(geo, inputs.shape, backprops.shape)
    g, k, t = geo.groups, geo.taps, t1 - t0
    cin_g, cout_g = shape.c_in // g, shape.c_out // g
    x = _padded(geo, f64(inputs[t0:t1]))
    # t×g×cout_g×P and, per offset, t×g×P×cin_g, each contiguous: numpy's matmul calls BLAS on
    # contiguous stacks only (a strided view goes through its own loop, 100× slower)
    d = np.ascontiguousarray(f64(backprops[t0:t1]).reshape(t, shape.positions, g, cout_g).transpose(0, 2, 3, 1))
    out = np.empty((t, g, cout_g, cin_g, k))
    for kappa, view in enumerate(geo.offsets(shape.outputs)):
        xk = x[(slice(None), slice(None)) + view].reshape(t, g, cin_g, shape.positions)
        out[..., kappa] = d @ np.ascontiguousarray(xk.transpose(0, 1, 3, 2))
    return out.reshape(t, shape.c_out, cin_g * k)


def example_tiles(geo: ConvGeometry, inputs_shape: Sequence[int],
                  backprops_shape: Sequence[int]) -> list[tuple[int, int]]:
    """The tiles of examples `per_example` is called on, each about `TILE_BYTES` of f64 (its
    output counted)."""
    shape = conv_shape(geo, inputs_shape, backprops_shape)
    cols = shape.c_in // geo.groups * geo.taps
    padded = math.prod(s + lo + hi for s, (lo, hi) in zip(inputs_shape[2:], geo.padding, strict=True))
    per = 8 * (shape.c_in * (padded + shape.positions) + shape.c_out * (shape.positions + 2 * cols))
    step = max(1, TILE_BYTES // max(per, 1))
    return [(i, min(i + step, shape.b)) for i in range(0, shape.b, step)]


def unfold(inputs: np.ndarray, backprops: np.ndarray, geo: ConvGeometry) -> tuple[np.ndarray, np.ndarray]:
    """The format-/1 twin of a conv-input site: (activations B×(P·g)×(C_in/g·∏k), backprops
    B×(P·g)×C_out), rows the (position, group) pairs, each row's backprops the output gradient
    with the other groups' channels zeroed. The whole batch unfolded: for tests and small
    traces only."""
    shape = conv_shape(geo, inputs.shape, backprops.shape)
    g, p = geo.groups, shape.positions
    cin_g, cout_g = shape.c_in // g, shape.c_out // g
    x = _padded(geo, f64(inputs))
    taps = [x[(slice(None), slice(None)) + view].reshape(shape.b, shape.c_in, p) for view in geo.offsets(shape.outputs)]
    patches = np.stack(taps, axis=-1)  # B×C_in×P×∏k
    acts = patches.reshape(shape.b, g, cin_g, p, geo.taps).transpose(0, 3, 1, 2, 4).reshape(shape.b, p * g, -1)
    d = f64(backprops)
    mask = np.zeros((g, shape.c_out))
    for j in range(g):
        mask[j, j * cout_g:(j + 1) * cout_g] = 1.0
    bps = (d[:, :, None, :] * mask).reshape(shape.b, p * g, shape.c_out)
    return acts, bps
