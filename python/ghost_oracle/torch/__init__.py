"""PyTorch side: export a trace of a model on a batch, and assert a clipper's norms in one call.

    from ghost_oracle.torch import assert_norms

    def per_example_loss(model, ids):                 # tensor[B]: each example's own loss
        logits = model(ids).logits
        l = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(),
                                              reduction="none")
        return l.view(ids.shape[0], -1).mean(1)

    assert_norms(model, per_example_loss, ids, claimed_norms=my_clipper_norms(model, ids),
                 max_grad_norm=1.0, noise_multiplier=1.0)

The exporter hooks `nn.Linear`, `nn.Embedding`, `nn.LayerNorm`, Hugging Face's `Conv1D`,
RMSNorms and scaled embeddings (matched by exact type); a parameter used twice (a head tied to
the embedding) becomes two sites of one parameter. It refuses, with `TraceExportError`, a model
it cannot trace faithfully: every trainable parameter must have a site, and the batch gradient
rebuilt from the sites must match autograd's.

A class the exporter does not know but that computes what one of its kinds computes is declared
once, and is then traced as that kind (and still checked against autograd, so a wrong
declaration raises):

    from transformers.models.falcon.modeling_falcon import FalconLinear
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    register_module(FalconLinear, "linear")
    register_module(CohereLayerNorm, "layernorm")       # a LayerNorm without bias

Low precision: a bf16 or f16 model (`model.to(torch.bfloat16)`, `model.half()`) is traced in
its dtype, and a float32 model whose `per_example_loss` runs the forward under `torch.autocast`
is traced per site: the matmuls autocast lowered (linear layers) in autocast's dtype, the rest
(embeddings, norms) in the parameters'. The trace's `compute_dtype` is the coarsest of them,
and the check judges at it.

The step: `export_trace` can also write the DP-SGD step the library took on the batch (the
clipped sum before noise, the update, the divisor; docs/trace-format.md, "The step
(optional)"), and its `inputs` may be a list of micro-batches, traced as the logical batch they
make up:

    step = ghost_oracle.opacus.dp_step(model, per_example_loss, [mb1, mb2], max_grad_norm=1.0,
                                       noise_multiplier=1.0)          # a real Opacus step
    export_trace(model, per_example_loss, step.inputs, "step.safetensors", clipper="opacus",
                 **step.export_kwargs())

`assert_norms` judges the norms only; `assert_update` judges the step (and the norms, when it
is given the library's):

    assert_update(model, per_example_loss, [mb1, mb2], step.update, clipped_sum=step.clipped_sum,
                  max_grad_norm=1.0, noise_multiplier=1.0, batch_divisor=step.batch_divisor,
                  clip_stabilizer=1e-6)
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from .._deprecated import renamed_keywords
from .._failure import ClippingCheckFailed
from .._gate import GateRun, gate
from .._report import Report
from .._types import Clipping
from .errors import TraceExportError
from .kinds import KINDS, Handler, Use, register_module, unregister_module
from .trace import FORMAT, UNCLAIMED, export_trace

if TYPE_CHECKING:
    from typing_extensions import Unpack

Inputs: TypeAlias = torch.Tensor | Mapping[str, torch.Tensor]

__all__ = ["FORMAT", "KINDS", "UNCLAIMED", "ClippingCheckFailed", "Handler", "TraceExportError", "Use",
           "assert_norms", "assert_update", "export_trace", "register_module", "unregister_module"]


def assert_norms(
    model: torch.nn.Module,
    per_example_loss: Callable[[torch.nn.Module, Any], torch.Tensor],
    inputs: Inputs,
    claimed_norms: Any,
    *,
    max_grad_norm: float,
    noise_multiplier: float = 1.0,
    clipper: str = "claimed",
    claimed_coefficients: Any = None,
    dtype: torch.dtype | None = None,
    batch_axis: int = 0,
    **run: Unpack[GateRun],
) -> Report:
    """Asserts that `claimed_norms` are the true per-example gradient norms of `model` on
    `inputs`, as a DP-SGD clipper must compute them.

    Exports the trace of the batch (to a temporary file, or to `trace_path` to keep it), checks
    it with the f64 reference and raises `AssertionError` unless the verdict is pass. The
    message names the verdict, the worst example with its true and claimed norm, the
    sensitivity (its clipped contribution in units of C), σ_eff, the stated and actual ε, and the
    tied parameter involved, with a per-example table.

    Args:
        model: the model, in the precision the clipper computes in (dropout off: the trace and
            the claim must see the same function).
        per_example_loss: `per_example_loss(model, inputs) -> Tensor[B]`, one loss per example,
            with the reduction the clipper assumes; it may run the forward under
            `torch.autocast` (each site is then recorded in the precision it computed in).
        inputs: a tensor of token ids `[B, T]`, or a dict of tensors (B and T from `input_ids`).
        claimed_norms: the B norms the clipper computed (tensor, array or list), or a callable
            `claimed_norms(model, inputs)` returning them.
        max_grad_norm: C.
        noise_multiplier: σ of the run.
        clipper: the name reports give the claim.
        claimed_coefficients: the clipper's coefficients, when it does not clip by min(1, C/n).
        dtype: the dtype the factors are stored in (default: each site's compute dtype).
        precision: the precision the tolerance assumes (default: the trace's, see `check`).
        sampling_rate, steps, delta: the run the ε speaks of (default: q = 0.01, 1000 steps,
            δ = 1e-5).
        epochs, dataset_size: the steps as epochs over a training set of N examples instead of
            `steps` (give both, and not `steps`), as for `ghost_oracle.check`.
        trace_path: where to keep the trace (default: a temporary file, removed afterwards).
        max_memory: the most memory the check may take reading and judging the trace, as for
            `ghost_oracle.check` ("8G", "512M" or bytes; default: the machine's available memory).
        batch_axis: the axis of `inputs` that holds the examples: 0, or 1 for seq-first data
            (batch_first=False). Each use's own batch axis is found by backpropagating single
            examples' losses; a model that mixes examples, or inputs whose examples lie along
            another axis than this one, raise `TraceExportError`.

    Returns:
        the `Report`, when the claim passes.

    Raises:
        ClippingCheckFailed: (an AssertionError) the claimed norms are not the true ones; its
            `.report` is the whole `Report`.
        TraceExportError: the model cannot be traced faithfully.
        ValueError, TypeError: bad arguments.

    The call runs one forward and backward pass: the model's `.grad`s are reset first and hold
    the batch gradient afterwards.
    """
    __tracebackhide__ = True  # pytest shows the failing test's line, not this function
    return _judge("assert_norms", model, per_example_loss, inputs, claimed_norms=claimed_norms, clipper=clipper,
                  run=run, export=dict(max_grad_norm=max_grad_norm, claimed_coefficients=claimed_coefficients,
                                       noise_multiplier=noise_multiplier, dtype=dtype, batch_axis=batch_axis))


def _judge(function: str, model: torch.nn.Module, per_example_loss: Callable[[torch.nn.Module, Any], torch.Tensor],
           inputs: Inputs | list[Inputs], *, claimed_norms: Any, clipper: str, run: GateRun,
           export: Mapping[str, Any]) -> Report:
    """`ghost_oracle._gate.gate` with this module's exporter."""
    __tracebackhide__ = True

    def write(path: str, norms: Any) -> object:
        return export_trace(model, per_example_loss, inputs, path, claimed_norms=norms, clipper=clipper, **export)

    return gate(write, unclaimed=UNCLAIMED, claimed_norms=claimed_norms, clipper=clipper, run=run, function=function)


@renamed_keywords(stabilizer="clip_stabilizer")
def assert_update(
    model: torch.nn.Module,
    per_example_loss: Callable[[torch.nn.Module, Any], torch.Tensor],
    inputs: Inputs | list[Inputs],
    update: Mapping[str, torch.Tensor],
    *,
    clipped_sum: Mapping[str, torch.Tensor] | None = None,
    max_grad_norm: float,
    noise_multiplier: float,
    batch_divisor: float,
    clip_stabilizer: float = 0.0,
    clipping: Clipping = "flat",
    claimed_norms: Any = None,
    claimed_coefficients: Any = None,
    clipper: str = "claimed",
    dtype: torch.dtype | None = None,
    batch_axis: int = 0,
    **run: Unpack[GateRun],
) -> Report:
    """Asserts that `update` is the DP-SGD update of `model` on `inputs`:
    (Σ_i c*_i g*_i + σ C ξ) / D, with c*_i = min(1, C / (n*_i + γ)) from the true per-example
    gradients (docs/tolerances.md, "The step: the clipped sum and the update").

    Exports the trace of the batch with the step (the update, the clipped sum when given, the
    divisor), checks it with the f64 reference and raises `AssertionError` unless the verdict is
    pass. Without noise the update times D is compared with the exact clipped sum; under noise
    the clipped sum (when given) is compared with it and u·D − K is tested as N(0, σ²C²) per
    parameter tensor, and without the clipped sum the update is judged by the coefficients it
    implies (a signal error below the smallest the test can see then passes: the message of a
    failure, and `report.step.noisy_update.smallest_visible`, say how small).

    The message names the verdict, the parameter (the one furthest off, or the tensor whose noise
    is wrong), the figure that decided it (the error against its bound, the implied
    contributions, examples missing from the sum, χ² against its interval and σ̂/σ, the divisor
    the update implies), σ_eff and the stated and actual ε, and per example the true and implied
    coefficients.

    Args:
        model: the model with the weights before the step (dropout off).
        per_example_loss: `per_example_loss(model, batch) -> Tensor[b]`, each example's own loss.
        inputs: the batch (tensor of ids or dict of tensors), or the list of micro-batches the
            step accumulated (traced as their concatenation, the logical batch).
        update: `{name: tensor}` for every trainable parameter (`model.named_parameters()` names,
            a tied parameter once): what the optimizer steps with (Opacus: `p.grad` after
            `optimizer.pre_step()`).
        clipped_sum: the same for the clipped sum before noise (Opacus: `p.summed_grad`); judged
            exactly whatever σ, and it makes the noise testable per tensor.
        max_grad_norm: C.
        noise_multiplier: σ.
        batch_divisor: D, what the library says it divides the noisy sum by (Opacus:
            `expected_batch_size × accumulated_iterations`).
        clip_stabilizer: γ in min(1, C / (n + γ)) (Opacus: 1e-6).
        clipping: "flat", c = min(1, C / (n + γ)); or "automatic", c = C / (n + γ)
            (automatic clipping, normalizing every example; needs γ > 0).
        claimed_norms: the norms the library clipped by (tensor, array, list or callable, as for
            `assert_norms`), judged too; default: the exact norms, so that only the step is judged.
        claimed_coefficients: the library's clip factors, with `claimed_norms`.
        clipper: the name the report gives the claim.
        dtype, precision, sampling_rate, steps, epochs, dataset_size, delta, trace_path,
            batch_axis, max_memory: as for
            `assert_norms` (micro-batches are concatenated along `batch_axis`).

    Returns:
        the `Report` when the step passes; `report.step` holds its figures.

    Raises:
        ClippingCheckFailed: (an AssertionError) the step is wrong (or the claimed norms are);
            its `.report` is the whole `Report`.
        TraceExportError: the model cannot be traced faithfully.
        ValueError, TypeError: bad arguments (a parameter missing from `update`, a bad divisor).

    The call runs one forward and backward pass: the model's `.grad`s are reset first and hold
    the batch gradient afterwards.
    """
    __tracebackhide__ = True
    if update is None:
        raise ValueError("update is required: the {name: tensor} the optimizer steps with")
    return _judge(
        "assert_update", model, per_example_loss, inputs, claimed_norms=claimed_norms, clipper=clipper, run=run,
        export=dict(max_grad_norm=max_grad_norm, claimed_coefficients=claimed_coefficients,
                    noise_multiplier=noise_multiplier, dtype=dtype, update=update, clipped_sum=clipped_sum,
                    batch_divisor=batch_divisor, clip_stabilizer=clip_stabilizer, clipping=clipping,
                    batch_axis=batch_axis))
