"""The one writer of trace files (docs/trace-format.md): both exporters hand it their checked
sites, the claims, the step and the header's numbers, and it writes the safetensors file.

numpy only, and not through `safetensors.numpy`: numpy has no bfloat16, so a bf16 factor comes
as its raw bits in a `uint16` array (`site.py`), which safetensors' numpy writer would label U16.
The format holds no uint16 tensor of its own, so here a `uint16` array is always bfloat16 bits.

The file is safetensors' layout, byte for byte what `safetensors.save_file` writes followed by
the header's `__metadata__` keys put in sorted order (the exporters wrote it so before, and a
trace's bytes are a function of the trace alone: safetensors writes the metadata in a HashMap's
per-call order): 8 bytes of little-endian header length, the header as compact JSON (non-ASCII
as is) padded with spaces to a multiple of 8, then every tensor's bytes, one after the other in
the header's order, which is safetensors' own (by dtype, the order of its `Dtype` enum from the
last, then by name). Each array is streamed to the file as it is held, so that writing a trace
of gigabytes of factors makes no second copy of them; the file is written to a temporary name
and renamed into place (`_atomic.write_atomically`).

A site whose `backprops_of` names another (a bias beside its weight: one output gradient) has no
`<name>.backprops` of its own: the array is written once, under the other site's name, and the
header says which (format `ghost-oracle-trace/3`). That the two are one array is checked, not
assumed: the same memory, else the same bits."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, BinaryIO

import numpy as np

from .._atomic import write_atomically
from .format import PRECISION_NAMES, TraceExportError, trace_metadata
from .site import Precision, Site, array_identity

#: safetensors' name of each dtype a trace's arrays are held in (a uint16 array: bfloat16 bits).
_SAFETENSORS_DTYPES = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
                       np.dtype(np.uint16): "BF16", np.dtype(np.int64): "I64", np.dtype(np.int32): "I32"}
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_ID_DTYPES = ("I64", "I32")
#: The order of safetensors' `Dtype` enum among the dtypes above; it writes the tensors by dtype
#: from the last of them, then by name.
_SAFETENSORS_ORDER = ("F16", "BF16", "I32", "F32", "F64", "I64")


def coarsest_precision(precisions: Iterable[Precision]) -> Precision:
    """The coarsest of `precisions` (bf16 is coarser than f16): the header's `compute_dtype`."""
    return max(precisions, key=PRECISION_NAMES.index)


def site_specs(sites: Sequence[Site[Any]]) -> list[dict[str, Any]]:
    """The header's `sites`: every site's spec, each carrying its own `compute_dtype` where the
    sites' precisions differ (a reader that knows no per-site precision judges every site at
    the header's, the coarsest)."""
    specs = [s.spec() for s in sites]
    if len({s.precision for s in sites}) > 1:
        for spec, s in zip(specs, sites, strict=True):
            spec["compute_dtype"] = s.precision
    return specs


def write_trace(path: str, *, sites: Sequence[Site[np.ndarray]], parameters: Mapping[str, int],
                claimed_norms: np.ndarray, claimed_coefficients: np.ndarray | None = None,
                step: Mapping[str, Mapping[str, np.ndarray]] | None = None,
                rounding: np.ndarray | None = None, rounding_method: str | None = None,
                max_grad_norm: float, clipper: str, noise_multiplier: float | None = None,
                batch_divisor: float | None = None, clip_stabilizer: float = 0.0,
                clipping: str = "flat", on_bytes: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """Writes the trace at `path` (atomically) and returns the header's site specs.

    `sites`: checked sites, their factors in the dtype they are stored in (ids int64 or int32,
    the rest float64, float32, float16, or bfloat16 bits in uint16). `parameters`: the manifest.
    `claimed_norms`, `claimed_coefficients`: B numbers each (written as float64). `step`: for
    "clipped_sum" and "update", the claimed tensor of every parameter of the manifest, in the
    manifest's order (written as `claimed.<what>.<param>`). `rounding`: the B values of
    `model.rounding`, measured as `rounding_method` says. The header's `compute_dtype` is the
    coarsest of the sites' precisions. The numbers are checked as `format.trace_metadata`
    checks them. The header's `format` is `ghost-oracle-trace/3` where a site's backprops are
    another's (`backprops_of`), else `/2` where a site carries a convolution's geometry, `/1`
    otherwise (`format.format_of`). `on_bytes`: told (bytes
    written, bytes in all) as the tensors are written, for a progress line."""
    if not sites:
        raise TraceExportError("no site to write: no modelled use of a parameter reached the loss")
    step = step or {}
    specs = site_specs(sites)
    meta = trace_metadata(max_grad_norm=max_grad_norm, clipper=clipper, sites=specs,
                          compute_dtype=coarsest_precision(s.precision for s in sites), parameters=parameters,
                          noise_multiplier=noise_multiplier, batch_divisor=batch_divisor,
                          clip_stabilizer=clip_stabilizer, clipping=clipping, has_step=bool(step),
                          model_rounding=None if rounding is None else rounding_method)
    tensors: dict[str, np.ndarray] = {}

    def add(name: str, array: np.ndarray, allowed: tuple[str, ...], what: str) -> None:
        if name in tensors:
            raise TraceExportError(f"tensor `{name}` would be written twice ({what})")
        array = np.asarray(array)
        if _SAFETENSORS_DTYPES.get(array.dtype) not in allowed:
            raise TraceExportError(f"{what}: tensor `{name}` is held as {array.dtype}; a trace stores it as "
                                   f"{' or '.join(allowed)}")
        tensors[name] = array

    by_name = {s.name: s for s in sites}
    for s in sites:
        for key, array in s.tensors.items():
            if key == "backprops" and s.backprops_of is not None:
                _check_shared(s, by_name)
                continue  # written once, under the site it names
            add(f"{s.name}.{key}", array, _ID_DTYPES if key == "ids" else _FLOAT_DTYPES,
                f"site `{s.name}` ({s.origin})")
    b = len(claimed_norms)
    for name, values in (("claimed.norms", claimed_norms), ("claimed.coefficients", claimed_coefficients),
                         ("model.rounding", rounding)):
        if values is not None:
            if np.shape(values) != (b,):
                raise ValueError(f"{name} has shape {list(np.shape(values))}; the trace has {b} examples")
            add(name, np.asarray(values, dtype=np.float64), ("F64",), name)
    for what, given in step.items():
        if set(given) != set(parameters):
            raise ValueError(f"{what}: the claimed tensors cover {sorted(given)}; the trace's parameters are "
                             f"{sorted(parameters)}, each once")
        for param, array in given.items():
            add(f"claimed.{what}.{param}", array, _FLOAT_DTYPES, what)
    write_atomically(path, "path", lambda tmp: _write_safetensors(tmp, tensors, meta, on_bytes))
    return specs


def _check_shared(site: Site[np.ndarray], by_name: Mapping[str, Site[np.ndarray]]) -> None:
    """`site`'s `backprops_of` as the reader holds it: another site of the trace, holding its own
    backprops, whose array is `site`'s (the same memory, else the same dtype, shape and bits)."""
    other_name = site.backprops_of
    where = f"site `{site.name}` ({site.origin})"
    other = by_name.get(other_name) if other_name is not None else None
    if other is None:
        raise TraceExportError(f"{where}: its backprops are said to be site `{other_name}`'s, which is not among "
                               "the sites written")
    if other is site:
        raise TraceExportError(f"{where}: its backprops are said to be its own site's (`backprops_of` names the "
                               "site itself)")
    if other.backprops_of is not None:
        raise TraceExportError(f"{where}: its backprops are said to be site `{other.name}`'s, whose backprops are "
                               f"site `{other.backprops_of}`'s in turn; name the site that holds them")
    a, b = np.asarray(site.tensors["backprops"]), other.tensors.get("backprops")
    if b is None:
        raise TraceExportError(f"{where}: its backprops are said to be site `{other.name}`'s, which has none")
    b = np.asarray(b)
    # one array (the exporters' case) is not read: comparing its bits would read it all
    if array_identity(a) != array_identity(b) and not (
            a.dtype == b.dtype and a.shape == b.shape and np.array_equal(_bits(a), _bits(b))):
        raise TraceExportError(f"{where}: its backprops ({a.dtype}, {list(a.shape)}) are said to be site "
                               f"`{other.name}`'s ({b.dtype}, {list(b.shape)}), but differ from them")


def _bits(a: np.ndarray) -> np.ndarray:
    """`a`'s entries as unsigned integers of their width: compared, they are equal bit for bit (a
    -0.0 is not a 0.0, a NaN is its own payload)."""
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _header(tensors: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> tuple[bytes, list[str]]:
    """The header's bytes (padded) and the tensors' names in the order their bytes follow it."""
    order = sorted(tensors, key=lambda n: (-_SAFETENSORS_ORDER.index(_SAFETENSORS_DTYPES[tensors[n].dtype]), n))
    header: dict[str, Any] = {"__metadata__": dict(sorted(meta.items()))}
    offset = 0
    for name in order:
        a = tensors[name]
        header[name] = {"dtype": _SAFETENSORS_DTYPES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    return text + b" " * (-len(text) % 8), order


def _write_safetensors(tmp: str, tensors: Mapping[str, np.ndarray], meta: Mapping[str, str],
                       on_bytes: Callable[[int, int], None] | None = None) -> None:
    header, order = _header(tensors, meta)
    total = sum(a.nbytes for a in tensors.values())
    written = 0
    with open(tmp, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for name in order:
            _write_array(f, tensors[name])
            written += tensors[name].nbytes
            if on_bytes is not None:
                on_bytes(written, total)


def _write_array(f: BinaryIO, a: np.ndarray) -> None:
    """`a`'s bytes, little-endian and in C order, written from the array's own memory where it
    is so laid out already (a copy of this one array otherwise)."""
    a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
    if a.nbytes:
        f.write(a.data.cast("B"))


__all__ = ["coarsest_precision", "site_specs", "write_trace"]
