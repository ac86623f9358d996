"""`export_trace` for Flax linen models: capture (`capture`), sites per module kind (`kinds/`),
the self-check against `jax.grad` (`check`); the checked sites are handed over as
`ghost_oracle._trace.Site`s to the writer both exporters share (`ghost_oracle._trace.writer`)."""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import ml_dtypes
import numpy as np

from .._trace.format import UNCLAIMED as UNCLAIMED  # re-exported: one placeholder for both exporters
from .._trace.format import TraceExportError
from .._trace.site import array_identity, share_backprops
from .._trace.writer import write_trace
from .arguments import header_arguments, kept_claims, kept_examples
from .capture import PerExampleLoss, capture, flat_params
from .check import STORAGE, self_check
from .kinds import handler_for
from .rounding import model_rounding
from .scan import split_layers
from .sites import Site, raw_bits

STEP_DTYPES = (np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def batch_size(inputs: Any) -> int:
    leaves = [x for x in jax.tree_util.tree_leaves(inputs) if hasattr(x, "shape") and len(x.shape) >= 1]
    if not leaves:
        raise ValueError("inputs holds no array with a batch axis: pass the batch (an array, or a dict or tuple of "
                         "arrays with the examples on axis 0)")
    b = int(leaves[0].shape[0])
    if b == 0:
        raise ValueError("inputs: the batch is empty (0 examples on axis 0): there is no example to trace")
    for k, x in enumerate(leaves):
        arr = np.asarray(x)
        if np.iscomplexobj(arr):
            raise TypeError(f"inputs: array {k} is complex ({arr.dtype}): per-example gradient norms are of real "
                            "models")
        if arr.dtype.kind == "f" or arr.dtype == ml_dtypes.bfloat16:
            finite = np.isfinite(arr.astype(np.float64))
            if not finite.all():
                what = "NaN" if np.isnan(arr.astype(np.float64)).any() else "±inf"
                first = [int(i) for i in np.argwhere(~finite)[0]]
                raise ValueError(f"inputs: array {k} holds {what} (first at index {first}): the losses and "
                                 "gradients are not numbers")
    return b


def _site_names(sites: list[Site]) -> None:
    """A parameter's first use is named by the parameter, the k-th after it `param@k`."""
    seen: dict[str, int] = {}
    for s in sites:
        k = seen.get(s.param, 0)
        seen[s.param] = k + 1
        s.name = s.param if k == 0 else f"{s.param}@{k}"


def _taken(v: Any, keep: np.ndarray, want: Any, taken: dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray]]
           ) -> np.ndarray:
    """A factor of a call's site as the trace stores it: the kept examples, contiguous, in `want`
    (None: as it is). A numpy array that another site of the call took already (the same memory,
    dtype, shape and strides: a bias's backprops and its weight's, one output gradient reshaped
    alike) is that site's array again, so that the writer writes it once (`share_backprops`);
    `taken` holds each array it was given, so that no address is another array's meanwhile."""
    key = None
    if isinstance(v, np.ndarray):
        key = (array_identity(v), want)
        if key in taken:
            return taken[key][1]
    out = np.ascontiguousarray(v[keep])
    if want is not None:
        out = out.astype(want, copy=False)
    if key is not None:
        taken[key] = (v, out)
    return out


def _step_tensors(what: str, given: Any, sites: list[Site], parameters: dict[str, int],
                  scans: dict[tuple[str, ...], int]) -> dict[str, np.ndarray]:
    """`what`'s claimed tensor of every parameter of the manifest, in its order and the trace's layout."""
    if not isinstance(given, Mapping):
        raise TypeError(f"{what} must be a dict from parameter names (the Flax path joined with '.') to arrays, or "
                        f"the params pytree, got {type(given).__name__}")
    # a parameter stacked by nn.scan is given as it is stored (L×…) and written per layer
    flat = split_layers(flat_params(given, what), scans, what)
    layout = {s.param: s for s in sites}
    out = {}
    for key, value in flat.items():
        if key not in parameters:
            near = ", ".join(f"`{n}`" for n in list(parameters)[:6])
            raise ValueError(f"{what}: `{key}` is not a parameter of the trace (its parameters are named like "
                             f"{near}, ...)")
        arr = np.asarray(value)
        if arr.dtype not in STEP_DTYPES:
            raise ValueError(f"{what}: the array for parameter `{key}` has dtype {arr.dtype}; the trace stores "
                             "float64, float32, float16 and bfloat16")
        if arr.size != parameters[key]:
            raise ValueError(f"{what}: the array for parameter `{key}` has shape {list(arr.shape)} ({arr.size} "
                             f"elements); the parameter has {parameters[key]}")
        site = layout[key]
        t = arr if site.layout_name == "identity" else site.to_trace_layout(arr)
        out[key] = raw_bits(np.ascontiguousarray(t))
    missing = [p for p in parameters if p not in out]
    if missing:
        raise ValueError(f"{what}: no array for parameter(s) {', '.join(f'`{m}`' for m in missing)}: it must cover "
                         "every trainable parameter of the trace, or be left out")
    return {p: out[p] for p in parameters}  # the manifest's order


def export_trace(model: nn.Module | Callable[..., Any], params: Any, per_example_loss: Any, inputs: Any = None,
                 path: str | os.PathLike[str] | None = None, *, max_grad_norm: float, claimed_norms: Any = UNCLAIMED,
                 clipper: str = "claimed", claimed_coefficients: Any = None, noise_multiplier: float | None = None,
                 dtype: str | None = None, update: Any = None, clipped_sum: Any = None,
                 batch_divisor: float | None = None, clip_stabilizer: float = 0.0, clipping: str = "flat",
                 batch_axis: int = 0, is_padding_example: Any = None, batch_argnums: int | tuple[int, ...] = 1,
                 keep_batch_dim: bool = True) -> list[dict[str, Any]]:
    """Records the trace of one batch, checks it against `jax.grad` and writes it with the
    claimed norms (and, when given, the claimed step). Returns the site specs. Raises
    `TraceExportError` (a ValueError) instead of writing a trace that is incomplete or wrong.

    Two routes, by the first argument:

    - `export_trace(model, params, per_example_loss, inputs, path, ...)` with a Flax linen
      `model` (below);
    - `export_trace(fun, params, batch, path, ...)` with any other callable: `fun(params, batch)`
      returns the loss of the examples in `batch` (B first), the function jax_privacy's
      `clipped_grad` clips; `batch_argnums` and `keep_batch_dim` mean what they mean there. It is
      captured from its jaxpr (`ghost_oracle.jax.program`); parameters are named by their pytree
      key path joined with '.', a leaf stacked on its first axis and used a layer at a time as
      `name[l]`.

    The linen route: `per_example_loss(apply, inputs)` returns the B losses, where
    `apply(*args, **kwargs)` runs `model.apply({"params": params}, *args, **kwargs)` under the
    capture (once). Both routes: `claimed_norms`: the B norms (array or list), or a callable
    `claimed_norms(params, inputs)`; default `UNCLAIMED` (placeholders). `clipped_sum`,
    `update`: dicts keyed by parameter name or the params pytree itself; a parameter stacked by
    `nn.scan` (L×…) is written as its L layers, `name[l]`, and may also be given so.
    `is_padding_example`: a (B,) bool array; those examples are left out of the trace (and of
    `claimed_norms`, which has B entries). `dtype`: the precision the factors are stored in
    ("f64", "f32", "f16", "bf16"; default each site's own). `batch_axis`: the axis of `inputs`
    that holds the examples, as for `ghost_oracle.torch.export_trace`; 0 is the only one this
    exporter follows (below)."""
    step_keywords: dict[str, Any] = dict(
        max_grad_norm=max_grad_norm, claimed_norms=claimed_norms, clipper=clipper,
        claimed_coefficients=claimed_coefficients, noise_multiplier=noise_multiplier, dtype=dtype, update=update,
        clipped_sum=clipped_sum, batch_divisor=batch_divisor, clip_stabilizer=clip_stabilizer, clipping=clipping,
        batch_axis=batch_axis, is_padding_example=is_padding_example)
    if not isinstance(model, nn.Module):
        from .program import export_program_trace

        # the program route's path is its fourth argument (`inputs`' place), or given by keyword
        if inputs is not None and path is not None:
            raise TypeError("export_trace(fun, params, batch, path, ...): the program route takes one path; got "
                            "a fifth positional argument as well")
        target = path if inputs is None else inputs
        if target is None:
            raise TypeError("export_trace(fun, params, batch, path, ...): missing the path to write")
        return export_program_trace(model, params, per_example_loss, target, batch_argnums=batch_argnums,
                                    keep_batch_dim=keep_batch_dim, **step_keywords)
    if batch_argnums != 1 or keep_batch_dim is not True:
        raise ValueError("batch_argnums and keep_batch_dim are the program route's (export_trace(fun, params, batch, "
                         "path)); a linen model takes per_example_loss and inputs instead")
    if path is None:
        raise TypeError("export_trace(model, params, per_example_loss, inputs, path, ...): missing the path")
    return _export_linen(model, params, per_example_loss, inputs, path, **step_keywords)


def _export_linen(model: nn.Module, params: Any, per_example_loss: PerExampleLoss, inputs: Any,
                  path: str | os.PathLike[str], *, claimed_norms: Any, max_grad_norm: float,
                  clipper: str = "claimed", claimed_coefficients: Any = None, noise_multiplier: float | None = None,
                  dtype: str | None = None, update: Any = None, clipped_sum: Any = None,
                  batch_divisor: float | None = None, clip_stabilizer: float = 0.0, clipping: str = "flat",
                  batch_axis: int = 0, is_padding_example: Any = None) -> list[dict[str, Any]]:
    """The linen route of `export_trace`: capture by `nn.intercept_methods` (`capture.py`)."""
    header = header_arguments(path, batch_axis=batch_axis, max_grad_norm=max_grad_norm,
                              noise_multiplier=noise_multiplier, dtype=dtype, batch_divisor=batch_divisor,
                              clip_stabilizer=clip_stabilizer, clipping=clipping, has_update=update is not None)
    path, c, dtype = header.path, header.max_grad_norm, header.dtype
    batch_divisor, clip_stabilizer = header.batch_divisor, header.clip_stabilizer
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a flax.linen Module, got {type(model).__name__}")
    b = batch_size(inputs)
    keep = kept_examples(is_padding_example, b)
    captured = capture(model, params, per_example_loss, inputs, b, keep.astype(np.float64))
    sites: list[Site] = []
    store = dtype
    for call in captured.calls:
        handler = handler_for(call.module, call.method)
        assert handler is not None
        # one array of the call's, taken once: a bias's backprops are its weight's (`_taken`)
        taken: dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray]] = {}
        for site in handler.sites(call, b):
            want = STORAGE[store or site.precision]
            site.tensors = {k: _taken(v, keep, None if k == "ids" else want, taken) for k, v in site.tensors.items()}
            sites.append(site)
    _site_names(sites)
    grads = {k: np.asarray(v)
             for k, v in split_layers(flat_params(captured.param_grads, "params"), captured.scans, "params").items()}
    unused = self_check(sites, grads, store)
    for name in unused:
        warnings.warn(f"parameter `{name}` received no gradient: it is left out of the trace", stacklevel=2)
    if not sites:
        raise TraceExportError(f"no modelled module was called: the model's parameters {list(grads)[:4]} have no site")
    parameters = {name: int(np.asarray(g).size) for name, g in grads.items() if name not in unused}
    norms, coefficients = kept_claims(claimed_norms, claimed_coefficients, b, keep,
                                      lambda claim: claim(params, inputs))
    step = {what: _step_tensors(what, given, sites, parameters, captured.scans)
            for what, given in (("clipped_sum", clipped_sum), ("update", update)) if given is not None}
    # the rounding of the model's own forward and backward in the factors as written, measured
    # by a replay at another precision (`rounding.py`); None, with a warning, where it cannot be
    rounding = model_rounding(model, params, per_example_loss, inputs, b, keep, captured.calls, sites)
    # a bias's backprops are its layer's output gradient, the array its weight's are: written once
    return write_trace(path, sites=share_backprops([s.handover() for s in sites]), parameters=parameters,
                       claimed_norms=norms, claimed_coefficients=coefficients, step=step,
                       rounding=None if rounding is None else rounding.rounding,
                       rounding_method=None if rounding is None else rounding.method, max_grad_norm=c,
                       clipper=clipper, noise_multiplier=noise_multiplier, batch_divisor=batch_divisor,
                       clip_stabilizer=clip_stabilizer, clipping=clipping)
