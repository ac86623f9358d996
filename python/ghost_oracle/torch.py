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

`assert_norms` judges the norms only.
"""
from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Mapping
from typing import Any, Union

import torch

from ._api import check
from ._export import FORMAT, TraceExportError, export_trace
from ._report import Report

Inputs = Union[torch.Tensor, Mapping[str, torch.Tensor]]

__all__ = ["FORMAT", "TraceExportError", "assert_norms", "export_trace"]


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
    precision: str | None = None,
    sampling_rate: float | None = None,
    steps: int | None = None,
    delta: float | None = None,
    trace_path: str | os.PathLike[str] | None = None,
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
        trace_path: where to keep the trace (default: a temporary file, removed afterwards).

    Returns:
        the `Report`, when the claim passes.

    Raises:
        AssertionError: the claimed norms are not the true ones.
        TraceExportError: the model cannot be traced faithfully.
        ValueError, TypeError: bad arguments.

    The call runs one forward and backward pass: the model's `.grad`s are reset first and hold
    the batch gradient afterwards.
    """
    __tracebackhide__ = True  # pytest shows the failing test's line, not this function

    def run(path: str) -> Report:
        export_trace(model, per_example_loss, inputs, path, claimed_norms=claimed_norms,
                     max_grad_norm=max_grad_norm, clipper=clipper,
                     claimed_coefficients=claimed_coefficients, noise_multiplier=noise_multiplier,
                     dtype=dtype)
        return check(path, precision=precision, sampling_rate=sampling_rate, steps=steps, delta=delta)

    if trace_path is not None:
        report = run(os.fspath(trace_path))
    else:
        with tempfile.TemporaryDirectory(prefix="ghost-oracle-") as d:
            # the file's name is the case's name in the report's table
            name = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(clipper)).strip("._") or "trace"
            report = run(os.path.join(d, f"{name}.safetensors"))
    if not report.passed:
        raise AssertionError(report.explain())
    return report
