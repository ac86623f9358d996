"""The judging of one captured computation, with the package's public exporter and check only:
the trace is exported from the copied module, its inputs and the surrogate loss (the exporter
re-derives every per-example gradient itself, and refuses what it cannot model), the library's
claimed norms are written into it, and the f64 judge gives the verdict. Nothing here reads the
library's per-sample state."""
from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np

from .computation import Computation, Outcome, StepClaims


def _max_rel_err(true: np.ndarray, claimed: np.ndarray) -> float:
    """max_i |claimed_i − true_i| / true_i; an example whose true norm is 0 counts by its absolute
    error (inf when the claim is not 0 either)."""
    worst = 0.0
    for t, c in zip(true.tolist(), claimed.tolist(), strict=True):
        if t > 0:
            worst = max(worst, abs(c - t) / t)
        elif c != 0:
            worst = math.inf
    return worst


def judge(c: Computation, outcome: Outcome, *, max_memory: int | str | None) -> Outcome:
    """Fills `outcome` (its `test` and `call` already set) for computation `c`."""
    from ..torch import export_trace

    if c.skip_reason is not None:
        outcome.outcome, outcome.message = "skipped", c.skip_reason
        return outcome
    if c.refuse_reason is not None:
        outcome.outcome, outcome.message = "refused", c.refuse_reason
        return outcome
    loss = c.per_example_loss
    if loss is None:
        raise ValueError("the computation was never completed by its backward pass")
    name = f"{c.library}-{c.mode}-{c.module}"

    def write(path: str) -> None:
        export_trace(c.model, loss, c.inputs, path, claimed_norms=c.claimed_norms,
                     max_grad_norm=c.max_grad_norm, clipper=f"{c.library}-{c.mode}", batch_axis=c.batch_axis)

    return _export_and_judge(outcome, name, write, "it", max_memory)


def _export_and_judge(outcome: Outcome, name: str, write: Callable[[str], None], what: str,
                      max_memory: int | str | None) -> Outcome:
    """Writes the trace (`write(path)`) into a temporary folder and judges it: a refusal of the
    exporter is the outcome "refused", with its message (`what`: what the exporter traced)."""
    import torch

    from ..torch import TraceExportError

    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        # the library's test may run in deterministic mode; the exporter's own scatter-adds on
        # CUDA have no deterministic kernel, and its arithmetic is f64 and checked against autograd
        if deterministic:
            torch.use_deterministic_algorithms(False)
        with tempfile.TemporaryDirectory(prefix="ghost-oracle-shadow-") as d, torch.enable_grad():
            path = os.path.join(d, re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + ".safetensors")
            try:
                write(path)
            except TraceExportError as e:
                outcome.outcome, outcome.message = "refused", str(e)
                return outcome
            except (ValueError, TypeError, RuntimeError, NotImplementedError) as e:
                outcome.outcome = "refused"
                outcome.message = f"the exporter could not trace {what}: {type(e).__name__}: {e}"
                return outcome
            report: Any = _check_trace(outcome, path, max_memory)
            if report is None:
                return outcome
    finally:
        if deterministic:
            torch.use_deterministic_algorithms(True, warn_only=warn_only)
    return _judged(outcome, report)


def _concat(values: list[Any], sizes: list[int], axis: int, what: str) -> Any:
    """The micro-batches' arguments as one batch: each tensor whose `axis` is its micro-batch's
    examples is concatenated along it; anything else must be the same in every micro-batch."""
    import torch
    from torch.utils._pytree import tree_flatten, tree_unflatten

    flat = [tree_flatten(v) for v in values]
    spec = flat[0][1]
    if any(s != spec for _, s in flat[1:]):
        raise _StepRefused(f"the micro-batches' {what} differ in structure")
    out = []
    for j, leaves in enumerate(zip(*(f for f, _ in flat), strict=True)):
        first = leaves[0]
        if torch.is_tensor(first):
            if all(torch.is_tensor(t) and t.dim() > axis and t.shape[axis] == b
                   for t, b in zip(leaves, sizes, strict=True)):
                out.append(torch.cat(leaves, dim=axis))
                continue
            if all(torch.is_tensor(t) and t.shape == first.shape and torch.equal(t, first) for t in leaves[1:]):
                out.append(first)
                continue
            raise _StepRefused(f"{what} {j} is neither one row per example along axis {axis} in every micro-batch "
                               "nor the same tensor in each")
        if any(t != first for t in leaves[1:]):
            raise _StepRefused(f"{what} {j} differs between the micro-batches and is not a tensor of examples")
        out.append(first)
    return tree_unflatten(out, spec)


class _StepRefused(Exception):
    """The step's micro-batches cannot be traced as one batch: recorded as refused."""


def _logical_batch(parts: list[Computation]) -> tuple[Any, Any, Any]:
    """(the module copy, the logical batch, its surrogate loss) of a step's micro-batches; the
    copies of every micro-batch must hold the same parameter values (no other update between)."""
    import torch

    from .surrogate import SurrogateLoss

    model = parts[0].model
    if len(parts) == 1:
        return model, parts[0].inputs, parts[0].per_example_loss
    reference = dict(model.named_parameters())
    for k, c in enumerate(parts[1:], start=1):
        for name, p in c.model.named_parameters():
            if not torch.equal(p, reference[name]):
                raise _StepRefused(f"parameter `{name}` changed between micro-batch 0 and micro-batch {k} of the "
                                   "step (an update outside the DP optimizer?)")
    axis = parts[0].batch_axis
    sizes = [c.batch_size for c in parts]
    losses = [c.per_example_loss for c in parts]
    if any(not isinstance(loss, SurrogateLoss) for loss in losses) or any(c.batch_axis != axis for c in parts):
        raise _StepRefused("the micro-batches were captured differently")
    if any(isinstance(loss, SurrogateLoss) and loss.segments for loss in losses):
        raise _StepRefused("several micro-batches of PackedSequences: their packings are not joined into one "
                           "logical batch (each micro-batch's norms are judged)")
    first = losses[0]
    assert isinstance(first, SurrogateLoss)
    grads = []
    for j, (index, _, g_axis) in enumerate(first.grads):
        pieces = []
        for loss, b in zip(losses, sizes, strict=True):
            assert isinstance(loss, SurrogateLoss)
            if len(loss.grads) != len(first.grads) or loss.grads[j][0] != index or loss.grads[j][2] != g_axis \
                    or loss.autocast != first.autocast:
                raise _StepRefused("the micro-batches' outputs received gradients differently")
            g = loss.grads[j][1]
            if g.shape[g_axis] != b:
                raise _StepRefused(f"output {index}'s gradient has no axis {g_axis} of the micro-batch's {b} examples")
            pieces.append(g * loss.scale)  # each micro-batch's own scale (its B under a mean)
        grads.append((index, torch.cat(pieces, dim=g_axis), g_axis))
    inputs = [c.inputs if isinstance(c.inputs, tuple) else (c.inputs,) for c in parts]
    batch = _concat(inputs, sizes, axis, "argument")
    kwargs = _concat([loss.kwargs for loss in losses if isinstance(loss, SurrogateLoss)], sizes, axis,
                     "keyword argument")
    if not isinstance(parts[0].inputs, tuple):
        batch = batch[0]
    return model, batch, SurrogateLoss(grads, 1.0, kwargs, first.autocast)


def judge_step(parts: list[Computation], claims: StepClaims, divisor: float, outcome: Outcome, *,
               max_memory: int | str | None) -> Outcome:
    """Fills `outcome` for a DP optimizer's step over the computations `parts` (its micro-batches,
    in order): the step is exported as `assert_update` exports it (the clipped sum, the update,
    the divisor, the claimed norms of every example) from the module copies, their inputs and
    the surrogate losses, and judged by the f64 check."""
    import torch

    from ..torch import export_trace

    if claims.refuse_reason is not None:
        outcome.outcome, outcome.message = "refused", claims.refuse_reason
        return outcome
    parts = [c for c in parts if not c.empty]
    if not parts:
        outcome.outcome, outcome.message = "skipped", "empty batch (no examples in any micro-batch of the step)"
        return outcome
    if any(c.claimed_norms is None or c.model is None for c in parts):
        outcome.outcome = "skipped"
        outcome.message = "a micro-batch of the step was not captured whole"
        return outcome
    outcome.mode = parts[0].mode
    outcome.module = parts[0].module
    outcome.wrapped = parts[0].wrapped
    outcome.batch_size = sum(c.batch_size for c in parts)
    names = parts[0].names
    missing = [i for i in claims.params if i not in names]
    if missing:
        outcome.outcome = "refused"
        outcome.message = (f"{claims.optimizer} steps {len(missing)} parameter(s) the module {outcome.module} does not "
                           "hold: its step is not of this module alone")
        return outcome
    try:
        model, batch, loss = _logical_batch(parts)
    except _StepRefused as e:
        outcome.outcome, outcome.message = "refused", f"the step's micro-batches: {e}"
        return outcome
    claimed = torch.cat([torch.as_tensor(c.claimed_norms, dtype=torch.float64).reshape(-1) for c in parts])
    update = {names[i]: t for i, t in claims.update.items()}
    clipped_sum = {names[i]: t for i, t in claims.clipped_sum.items()}

    def write(path: str) -> None:
        export_trace(model, loss, batch, path, claimed_norms=claimed, max_grad_norm=claims.max_grad_norm,
                     clipper=f"{claims.library}-{outcome.mode}-step", noise_multiplier=claims.noise_multiplier,
                     update=update, clipped_sum=clipped_sum, batch_divisor=divisor,
                     clip_stabilizer=claims.clip_stabilizer, clipping="flat", batch_axis=parts[0].batch_axis)

    return _export_and_judge(outcome, f"{claims.library}-{outcome.mode}-step", write, "the step", max_memory)


def _check_trace(outcome: Outcome, path: str, max_memory: int | str | None) -> Any:
    """The check's report on a written trace, or None with `outcome` marked: skipped where the
    check would pass `max_memory`, refused where it cannot read the trace (never a pass)."""
    from .._api import check  # lazily, as the callers import the exporter

    try:
        return check(path, max_memory=max_memory)
    except ValueError as e:
        if "memory" in str(e).lower():
            outcome.outcome, outcome.message = "skipped", f"over max_memory: {e}"
        else:
            outcome.outcome, outcome.message = "refused", f"the check refused the trace: {e}"
        return None


def _judged(outcome: Outcome, report: Any) -> Outcome:
    """`outcome` as judged: the verdict, the largest relative error of a claim, the explanation."""
    outcome.outcome = "judged"
    outcome.verdict = str(report.verdict)
    outcome.max_rel_err = _max_rel_err(np.asarray(report.true_norms, dtype=np.float64),
                                       np.asarray(report.claimed_norms, dtype=np.float64))
    if outcome.verdict != "pass":
        outcome.explanation = report.explain()
        outcome.message = outcome.explanation.splitlines()[0] if outcome.explanation else outcome.verdict
    outcome.report = report
    return outcome
