"""The trace exporter: dump a ghost-oracle trace (docs/trace-format.md) from a PyTorch model, for
auditing a clipper that lives in PyTorch (`ghost_oracle.check(TRACE)`, `ghost-oracle check TRACE`).

    from ghost_oracle.torch import export_trace
    export_trace(model, per_example_loss, inputs, "trace.safetensors",
                 claimed_norms=my_clipper_norms, max_grad_norm=1.0, clipper="my-clipper")

The stages, one module each: `record` hooks the modules a handler models (`kinds/`, one file
per kind of module, registered by exact type; `register_module` declares users' classes) and,
through `functions`, captures the functional calls on parameters no handler models (F.linear,
F.embedding, `x @ w`: `nn.MultiheadAttention`'s projections, an RNN cell's linear layers at
every step, a bare parameter); every call of a module or function is a use of its own, so a
parameter used several times (a tied head, a cell at every time step) has a site per use;
`layout` finds each use's batch axis by backpropagating single examples' losses and refuses a
model that mixes examples; the handlers turn each use into sites whose factors are
B×rows×features, rows whatever the use has (positions, image positions, (position, group)
pairs of a grouped convolution, bag members, one row for a pooled B×F); `check` rebuilds every
parameter's batch gradient from the sites and refuses a trace that does not match autograd's;
`step` checks the claimed step; this module hands the checked sites over to the writer both
exporters share (`ghost_oracle._trace.writer`).

`inputs` is the batch, passed to `per_example_loss` as it is: a tensor, a dict or a tuple of
tensors, or a list of micro-batches (tensors or dicts), which is traced as the logical batch
they make up (their concatenation along `batch_axis`). B is read from the tensor (a dict's
`input_ids`, else its first tensor) along `batch_axis`, else from the per-example loss;
`per_example_loss(model, inputs) -> tensor(B)`; `claimed_norms` is a tensor, array or list of
the B norms the clipper under audit used, or a callable returning one (it is called after the
trace is recorded, with the model and the batch). `dtype` is the dtype the factors are stored
in (default: each site's compute dtype).

Precision is per site: each use is recorded in the dtype its module really computed in. That is
the parameters' dtype (an f32, bf16 or f16 model; for a norm, the dtype of its own product with
its weight, found by replaying it), except where autocast lowered the module's op: when autocast
is enabled for the output's device type inside the module's forward and the output comes out in
autocast's dtype (not the weight's), the site computed in autocast's dtype. On CPU and CUDA that
is true of `nn.Linear` and `Conv1D` (matmuls), not of embeddings or norms, which stay in the
parameters' dtype; the output's dtype decides, not a list of ops. Such a site's activations are
stored as the matmul saw them (cast to autocast's dtype, as autocast casts them) and its
backprops as autograd produced them (in the output's dtype). The header carries `compute_dtype`
(the coarsest of the sites' precisions; when they differ, every site's entry in `sites` carries
its own) and the `parameters` manifest (every trainable parameter that received a gradient,
with its number of elements; a tied parameter once).

A use shared by every example (GPT-2's 1×T position lookup, nanoGPT's `wpe(arange(T))`),
computed from no example of the batch, gets each example's own output gradient and its one
input repeated, in the trace's factors only (`layout`); activations flattened to B·T rows
inside a block (OPT's MLP) are split back into examples by the layout found for them. The
model's own module hooks (Opacus's) are set aside for the recorded forward and put back after
it.

Refused, with the parameter named: mixture-of-experts layers whose experts are one fused 3-D
tensor (Qwen3-MoE's), where each token uses the slices its router picked; freezing the experts
and the router traces the rest.

The step (optional): `clipped_sum` and `update` map parameter names (`model.named_parameters()`
names, a tied parameter under any of its names, or the trace's `param` names) to the library's
clipped sum Σ_i c_i g_i before noise and to the update it steps with, (Σ_i c_i g_i + σ C ξ) / D.
Each covers every trainable parameter of the trace or is left out; they are written as
`claimed.clipped_sum.<param>` and `claimed.update.<param>` in the parameter's shape and in the
dtype given. `batch_divisor` is D (required with `update`); `clip_stabilizer` (γ) and `clipping`
(`flat`: c = min(1, C/(n + γ)); `automatic`: c = C/(n + γ)) say how the library forms its
coefficients.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._atomic import check_target
from .._trace.format import FORMAT as FORMAT  # re-exported; the header is framework-neutral
from .._trace.format import UNCLAIMED as UNCLAIMED  # re-exported: one placeholder for both exporters
from .._trace.format import number, step_rule
from .._trace.site import share_backprops
from .._trace.writer import write_trace
from .arguments import check_inputs, check_model, integer_input_error
from .batch import (
    _batch_size,
    _check_batch_axis,
    _concat_micro_batches,
    _input_tensors,
    _per_example,
    input_leaves,
    packings,
)
from .check import self_check
from .errors import TraceExportError
from .kinds import Site, Use
from .kinds.base import numpy_site, torch_dtype
from .layout import probe_examples, settle_layouts
from .precision import DTYPE_NAMES, unit_roundoff, with_islands
from .precision import compute_dtype as model_compute_dtype
from .progress import Progress
from .record import param_names, param_owners, record
from .rounding import CastWatch
from .rounding import model_rounding as measure_model_rounding
from .step import _resolve_step


def _own(v: torch.Tensor, owned: set[int]) -> torch.Tensor:
    """A factor as the file is written from it: on the host, contiguous, holding its storage
    alone (the file holds each tensor's bytes apart; two factors that are one tensor, a bias's
    backprops and its weight's, are one site's and written once, `_collect_sites`). A factor
    that already is that is written as captured, not copied: at 1B-class sizes the factors are
    gigabytes."""
    v = v.detach().cpu()
    if v.is_contiguous():
        storage = v.untyped_storage()
        whole = v.storage_offset() == 0 and storage.nbytes() == v.numel() * v.element_size()
        if not whole or storage.data_ptr() in owned:
            v = v.clone()
    else:
        v = v.contiguous()
    owned.add(v.untyped_storage().data_ptr())
    return v


def export_trace(model: torch.nn.Module, per_example_loss: Callable[[torch.nn.Module, Any], Any], inputs: Any,
                 path: str | os.PathLike[str], claimed_norms: Any, max_grad_norm: float,
                 clipper: str = "claimed", claimed_coefficients: Any = None, noise_multiplier: float | None = None,
                 dtype: torch.dtype | None = None, update: Mapping[str, torch.Tensor] | None = None,
                 clipped_sum: Mapping[str, torch.Tensor] | None = None, batch_divisor: float | None = None,
                 clip_stabilizer: float = 0.0, clipping: str = "flat", batch_axis: int = 0,
                 model_rounding: bool = True) -> list[dict[str, Any]]:
    """Records the trace of one batch, checks it against autograd and writes it with the claimed
    norms (and, when given, the claimed step: `clipped_sum`, `update`, `batch_divisor`,
    `clip_stabilizer`, `clipping`; see the module's docstring). Returns the site specs. Raises
    `TraceExportError` (a ValueError) instead of writing a trace that is incomplete or wrong.

    `inputs` may be a list of micro-batches: the trace is of their concatenation, the logical
    batch a step is taken on.

    `batch_axis` is the axis of `inputs` that holds the examples: 0 (batch × sequence), or 1 for
    seq-first data (batch_first=False). Each use's own batch axis is found, not assumed: single
    examples' losses are backpropagated (every example alone for B ≤ 8, else a seeded choice, four
    at a time), and a group's gradient must reach its use's output along one axis at its own
    examples' indices and nowhere else (`layout.py`). A model that mixes examples is refused,
    naming the first use where it shows; so is a use fed the inputs directly whose examples lie
    along another axis than `batch_axis`.

    `model_rounding=False` leaves out the replays that measure the model's own rounding
    (`model.rounding`, docs/trace-format.md): the judge then bounds the clipper's arithmetic on
    the traced factors only, as where the replays do not fit in memory. They are a float64
    forward and backward of the batch and random-rounding ones (tens of times the step on a
    CNN at a DP batch size, docs/results.md).

    Runs one forward pass of `per_example_loss(model, inputs)`, one backward per probed group of
    examples, then the backward of their sum: the model's `.grad`s are reset first and hold the
    batch gradient afterwards."""
    if not isinstance(model_rounding, bool):
        raise TypeError(f"model_rounding must be True or False, got {model_rounding!r}")
    batch_axis = _check_batch_axis(batch_axis)
    path = check_target(path, "path")  # before the model runs: a path that cannot be written fails fast
    if isinstance(inputs, list):  # micro-batches
        inputs = _concat_micro_batches(inputs, batch_axis)
    b_inputs = _batch_size(inputs, batch_axis)
    check_inputs(inputs, b_inputs, batch_axis)
    check_model(model)
    names = param_names(model)
    args = _StepArguments.checked(model, names, max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier,
                                  dtype=dtype, update=update, clipped_sum=clipped_sum, batch_divisor=batch_divisor,
                                  clip_stabilizer=clip_stabilizer, clipping=clipping)
    progress = Progress()
    watch = CastWatch()
    entries, b = _record_batch(model, per_example_loss, inputs, b_inputs, batch_axis, progress, watch)
    sites = _collect_sites(entries, names, dtype, b, progress)
    self_check(model, sites, names, param_owners(model), dtype, progress)
    specs = [s.spec() for s in sites]
    compute_dtype = _site_precisions(sites, specs, args.compute_dtype)
    compute_dtype = with_islands(specs, compute_dtype, watch.coarsest)
    rounding = None
    if model_rounding:
        def on_replay(done: int, total: int) -> None:
            progress.step("replaying the model at another precision (its own rounding), replays", done, total)

        rounding = measure_model_rounding(model, per_example_loss, inputs, b_inputs, batch_axis, b, entries, sites,
                                          watch, args.compute_dtype, compute_dtype, on_replay)
    parameters = _manifest(model, names)
    if claimed_norms is UNCLAIMED:
        claimed_norms = torch.ones(b, dtype=torch.float64)
    elif callable(claimed_norms):
        claimed_norms = claimed_norms(model, inputs)
    norms = _host(_per_example(claimed_norms, b, "claimed_norms"))
    coefficients = None if claimed_coefficients is None else \
        _host(_per_example(claimed_coefficients, b, "claimed_coefficients"))
    step = _step_tensors(args.step, parameters)
    # each site handed over at the precision its spec was given (the float32 islands counted)
    handed = []
    for site, spec in zip(sites, specs, strict=True):
        handed.append(numpy_site(site))
        handed[-1].precision = spec.get("compute_dtype", DTYPE_NAMES[compute_dtype])
    progress.step("writing the trace", 0, 1)
    # a bias's backprops are its weight's tensor, handed over as one array: written once
    specs = write_trace(path, sites=share_backprops(handed), parameters=parameters, claimed_norms=norms,
                        claimed_coefficients=coefficients, step=step,
                        rounding=None if rounding is None else _host(rounding.rounding),
                        rounding_method=None if rounding is None else rounding.method,
                        max_grad_norm=args.max_grad_norm, clipper=clipper, noise_multiplier=args.noise_multiplier,
                        batch_divisor=args.batch_divisor, clip_stabilizer=args.clip_stabilizer, clipping=clipping,
                        on_bytes=lambda done, total: progress.step("writing the trace, MiB", done >> 20, total >> 20))
    progress.done()
    return specs


def _host(t: torch.Tensor) -> np.ndarray:
    """A tensor as the writer takes it: a numpy array on the host, a view where it already is
    one (a bfloat16 tensor as its raw bits in uint16, as `_trace` holds bfloat16)."""
    t = t.detach().cpu()
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


#: A claimed step: for "clipped_sum" and "update", each parameter's (parameter, claimed tensor).
Step = dict[str, dict[str, tuple[torch.nn.Parameter, torch.Tensor]]]


@dataclass
class _StepArguments:
    """`export_trace`'s numbers and claimed step, checked before anything runs."""

    max_grad_norm: float
    noise_multiplier: float | None
    compute_dtype: torch.dtype
    step: Step
    batch_divisor: float | None
    clip_stabilizer: float

    @staticmethod
    def checked(model: torch.nn.Module, names: Mapping[int, str], *, max_grad_norm: float,
                noise_multiplier: float | None, dtype: torch.dtype | None,
                update: Mapping[str, torch.Tensor] | None, clipped_sum: Mapping[str, torch.Tensor] | None,
                batch_divisor: float | None, clip_stabilizer: float, clipping: str) -> _StepArguments:
        c = number(max_grad_norm, "max_grad_norm", positive=True)
        sigma = None if noise_multiplier is None else number(noise_multiplier, "noise_multiplier", positive=False)
        compute_dtype = model_compute_dtype(model, TraceExportError)
        if compute_dtype not in DTYPE_NAMES:
            raise TraceExportError(f"the model computes in {compute_dtype}; traces record {list(DTYPE_NAMES)}")
        if dtype is not None and dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype {dtype} cannot store a trace; use one of {list(DTYPE_NAMES)}")
        step: Step = {}
        for what, claimed in (("clipped_sum", clipped_sum), ("update", update)):
            if claimed is not None:
                step[what] = _resolve_step(model, what, claimed, names)
        batch_divisor, gamma = step_rule(batch_divisor=batch_divisor, clip_stabilizer=clip_stabilizer,
                                         clipping=clipping, has_update=update is not None,
                                         divisor_is="Opacus: expected_batch_size × accumulated_iterations")
        return _StepArguments(max_grad_norm=c, noise_multiplier=sigma, compute_dtype=compute_dtype, step=step,
                              batch_divisor=batch_divisor, clip_stabilizer=gamma)


def _record_batch(model: torch.nn.Module, per_example_loss: Callable[[torch.nn.Module, Any], Any], inputs: Any,
                  b_inputs: int | None, batch_axis: int, progress: Progress,
                  watch: CastWatch | None = None) -> tuple[list[Use], int]:
    """Runs the batch's forward with every use recorded, the per-example probes that find each
    use's batch axis, then the batch's backward: (the uses, B)."""
    model.zero_grad(set_to_none=True)
    # floating-point inputs made leaves that require gradients, so that the probes see whether
    # an example's loss reaches another example's inputs; the model gets them, the user's
    # callable `claimed_norms` the inputs as given
    traced_inputs, leaves = input_leaves(inputs)
    rec, handles = record(model, b_inputs or 0, batch_axis, traced_inputs)
    entries = rec.entries
    try:
        try:
            with watch.watching() if watch is not None else contextlib.nullcontext():
                losses = per_example_loss(model, traced_inputs)
        except RuntimeError as err:  # integer inputs meeting a float module: named; else the user's error
            named = integer_input_error(err, model, inputs)
            if named is not None:
                raise named from err
            raise
        finally:
            for h in reversed(handles):  # the forward is over: nothing else is a use
                h.remove()
        b = b_inputs if b_inputs is not None else (losses.shape[0] if torch.is_tensor(losses) and losses.dim() == 1
                                                   else None)
        if b is None or not torch.is_tensor(losses) or losses.shape != (b,) or b == 0:
            shape = tuple(losses.shape) if torch.is_tensor(losses) else type(losses).__name__
            want = f"({b},)" if b else "(B,)"
            hint = (f" (the inputs' axis {batch_axis} has {b} entries: if the examples lie along another axis, "
                    "pass batch_axis)" if torch.is_tensor(losses) and losses.dim() == 1 and b else "")
            raise ValueError(f"per_example_loss returned {shape}; expected a tensor of shape {want}, one loss per "
                             f"example{hint}")
        # The probes first, then the batch's backward: the probes' gradients of every use's output
        # are let go before the batch's are captured, and the batch's backward frees the graph as
        # it goes (unless a use that may be shared by every example needs it afterwards).
        rec.probing = True
        probes = probe_examples(entries, losses, b, batch_axis, leaves, progress, packings(traced_inputs))
        rec.probing = False
        losses.sum().backward(retain_graph=probes.may_be_shared(entries))
        rec.probing = True
        settle_layouts(entries, probes, losses, b, batch_axis, _input_tensors(inputs), progress)
    finally:
        for e in entries:  # the outputs hold the graph alive
            e.output = None
        losses = None
    return entries, b


def _same_view(v: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors one array: the same bytes of the same storage, read alike."""
    return (v.device, v.untyped_storage().data_ptr(), v.storage_offset(), v.dtype, tuple(v.shape), v.stride())


def _collect_sites(entries: list[Use], names: Mapping[int, str], dtype: torch.dtype | None,
                   b: int, progress: Progress | None = None) -> list[Site[torch.Tensor]]:
    """Every use's sites, each name once, their factors as written; a use's capture is let go as
    its sites are formed. A site whose backprops are the very tensor an earlier site's of the
    same use are (a bias and its weight: the layer's output gradient) is given that site's
    tensor as written, not a copy of its own, so that the handover sees one array and the trace
    holds it once (`share_backprops`). Only sites of one use are compared: the tensors compared
    are held until the use's sites are formed, so that no address is reused meanwhile."""
    sites: list[Site[torch.Tensor]] = []
    seen: set[str] = set()
    owned: set[int] = set()
    for n, use in enumerate(entries):
        if progress is not None:
            progress.step("forming the sites, uses", n, len(entries))
        # each backprops tensor of the use as captured -> (the tensor as written, the captured
        # tensor: held, so that its address stays its own)
        backprops: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        for site in use.form_sites(names, dtype, b):
            if site.name in seen:
                raise TraceExportError(f"site name `{site.name}` appears twice")
            seen.add(site.name)
            captured = site.tensors.get("backprops")
            view = None if captured is None else _same_view(captured)
            holder = backprops.get(view) if view is not None else None
            site.tensors = {k: holder[0] if k == "backprops" and holder is not None else _own(v, owned)
                            for k, v in site.tensors.items()}
            if holder is None and view is not None and captured is not None:
                backprops[view] = (site.tensors["backprops"], captured)
            sites.append(site)
        use.input = None  # what is left of a use's capture is its sites' factors
        use.output_grad = None
    return sites


def _site_precisions(sites: list[Site[torch.Tensor]], specs: list[dict[str, Any]],
                     model_dtype: torch.dtype) -> torch.dtype:
    """The header's compute dtype: the coarsest site's (what a reader that knows no per-site
    precision judges at); where the sites differ, each spec carries its own."""
    site_dtypes = [torch_dtype(s.precision) for s in sites]
    if len(set(site_dtypes)) > 1:
        for spec, site in zip(specs, sites, strict=True):
            spec["compute_dtype"] = site.precision
    return max(site_dtypes, key=unit_roundoff) if site_dtypes else model_dtype


def _manifest(model: torch.nn.Module, names: Mapping[int, str]) -> dict[str, int]:
    """Every trainable parameter that received a gradient, once, with its number of entries (a
    parameter without a gradient is left out, with a warning)."""
    parameters: dict[str, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad and names[id(p)] not in parameters:
            if p.grad is None:
                warnings.warn(f"parameter `{names[id(p)]}` received no gradient: it is left out of the trace",
                              stacklevel=1)
                continue
            parameters[names[id(p)]] = p.numel()
    return parameters


def _step_tensors(step: Step, parameters: Mapping[str, int]) -> dict[str, dict[str, np.ndarray]]:
    """The claimed step's tensors, for "clipped_sum" and "update" each parameter's in the
    manifest's order, each covering every parameter of the manifest once (a tied parameter
    under its trace name)."""
    tensors: dict[str, dict[str, np.ndarray]] = {}
    for what, given in step.items():
        for param in given:
            if param not in parameters:
                raise ValueError(f"{what}: parameter `{param}` received no gradient in this batch and is left out "
                                 f"of the trace; leave it out of {what} too")
        missing = [param for param in parameters if param not in given]
        if missing:
            raise ValueError(f"{what}: no tensor for parameter(s) {', '.join(f'`{m}`' for m in missing)}: it must "
                             "cover every trainable parameter of the trace, or be left out")
        tensors[what] = {}
        for param in parameters:  # the manifest's order
            p, t = given[param]
            # a copy: the trace holds what was claimed when it was exported
            tensors[what][param] = _host(t.detach().to("cpu").reshape(p.shape).contiguous().clone())
    return tensors
