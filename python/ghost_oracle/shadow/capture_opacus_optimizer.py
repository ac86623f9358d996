"""Capture of Opacus 1.6's DP optimizer steps, from outside Opacus: `pre_step` and `zero_grad` of
`DPOptimizer` and `DPOptimizerFastGradientClipping` (ghost clipping's) are wrapped while a
session is active, each calling the original unchanged.

Right after a `pre_step` that did not skip (the clipped sum is `p.summed_grad`, the noisy and
divided sum `p.grad`, and the weights have not moved yet) the claims are read: per parameter the
clipped sum and the update, the optimizer's C, σ, and the divisor it states (its expected batch
size times its `accumulated_iterations`, read before it clips; 1 for a summed loss). The
session judges the step over the computations captured since the last `zero_grad()` (and those
a skipped step already clipped). A skipped step
(`signal_skip_step`, as `BatchMemoryManager` does) moves the open computations into the sum.

A `zero_grad()` is the user's when it is not called from inside Opacus's ghost-clipping loss
(`DPTensorFastGradientClipping.backward`, which zeroes the gradients between its two backward
passes: an implementation step, not the start of a new batch; whether it loses what earlier
`backward()` calls accumulated is what the step's judging finds out)."""
from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping, FSDPOptimizerFastGradientClipping
from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

from . import session as sessions
from .computation import StepClaims

LIBRARY = "opacus"
#: Opacus 1.6's γ in its clip factor min(1, C / (n + γ)), in both optimizers
CLIP_STABILIZER = 1e-6
#: the optimizers whose step is flat DP-SGD as `assert_update` judges it; their subclasses
#: (per-layer and adaptive clipping, the distributed ones) are refused by name, except the FSDP
#: ghost-clipping one on one process (its noise divided by a world size of 1: flat DP-SGD)
JUDGED = (DPOptimizer, DPOptimizerFastGradientClipping)
#: the classes whose `pre_step`/`zero_grad` are wrapped: the FSDP optimizer defines its own,
#: calling neither of its parent's
WRAPPED = (*JUDGED, FSDPOptimizerFastGradientClipping)

_inside = threading.local()


def _params(optimizer: Any) -> frozenset[int]:
    return frozenset(id(p) for p in optimizer.params)


def _accumulated(optimizer: Any) -> int | None:
    try:
        return int(optimizer.accumulated_iterations)
    except (ValueError, TypeError, AttributeError):  # no grad samples: nothing accumulated to state
        return None


def _whole(t: Any) -> Any:
    """A DTensor's full value (on one process, gathered from itself alone); any other tensor as is."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def _claims(optimizer: Any, accumulated: int | None) -> StepClaims:
    name = type(optimizer).__name__
    params = _params(optimizer)
    refuse = None
    fsdp = type(optimizer) is FSDPOptimizerFastGradientClipping
    if fsdp and int(optimizer.world_size) != 1:
        refuse = (f"{name} over {optimizer.world_size} processes: each holds a shard and its own examples "
                  "(its step is judged on one process)")
    elif type(optimizer) not in JUDGED and not fsdp:
        refuse = (f"{name}: not flat per-example clipping with one C (DPOptimizer, "
                  "DPOptimizerFastGradientClipping, and FSDPOptimizerFastGradientClipping on one process are judged)")
    sigma = float(optimizer.noise_multiplier)
    adjusted = getattr(optimizer, "_adjusted_noise_multiplier", None)
    if refuse is None and adjusted is not None and float(adjusted) != sigma:
        refuse = f"{name}: adaptive clipping's noise multiplier {adjusted} differs from the stated {sigma}"
    clipped_sum: dict[int, Any] = {}
    update: dict[int, Any] = {}
    for p in optimizer.params:
        summed = optimizer.grad_state[p]["summed_grad"] if fsdp else getattr(p, "summed_grad", None)
        grad = p.grad
        if summed is None or grad is None:
            refuse = refuse or f"{name}: a parameter of shape {list(p.shape)} has no clipped sum or update"
            continue
        if refuse is None:  # a refused FSDP step's shards are never gathered (a collective)
            clipped_sum[id(p)] = _whole(summed).detach().reshape(p.shape).clone()
            update[id(p)] = _whole(grad).detach().clone()
    expected = optimizer.expected_batch_size
    return StepClaims(library=LIBRARY, optimizer=name, params=params, clipped_sum=clipped_sum, update=update,
                      max_grad_norm=float(optimizer.max_grad_norm), noise_multiplier=sigma,
                      clip_stabilizer=CLIP_STABILIZER, expected_batch_size=None if expected is None else int(expected),
                      loss_reduction=str(optimizer.loss_reduction), accumulated_iterations=accumulated,
                      refuse_reason=refuse)


def _wrap_pre_step(original: Callable[..., Any]) -> Callable[..., Any]:
    def pre_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        session = sessions.current()
        if session is None or getattr(_inside, "active", False):
            return original(self, *args, **kwargs)
        accumulated = _accumulated(self)  # before the clipping marks the grad samples processed
        _inside.active = True  # a subclass's pre_step calling its parent's is one step
        try:
            result = original(self, *args, **kwargs)
        finally:
            _inside.active = False
        if result is False:
            session.on_skipped_step(_params(self))
        else:
            session.on_step(_claims(self, accumulated))
        return result

    pre_step.__wrapped__ = original  # type: ignore[attr-defined]
    return pre_step


def _called_from_ghost_loss() -> bool:
    """Whether the `zero_grad` being run was called by ghost clipping's loss between its passes."""
    frame = sys._getframe(2)  # the wrapper's caller
    owner = frame.f_locals.get("self")
    return frame.f_code.co_name == "backward" and isinstance(owner, DPTensorFastGradientClipping)


def _wrap_zero_grad(original: Callable[..., Any]) -> Callable[..., Any]:
    def zero_grad(self: Any, *args: Any, **kwargs: Any) -> Any:
        session = sessions.current()
        if session is not None and not _called_from_ghost_loss():
            session.on_zero_grad(_params(self), keep_clipped=bool(getattr(self, "_is_last_step_skipped", False)))
        return original(self, *args, **kwargs)

    zero_grad.__wrapped__ = original  # type: ignore[attr-defined]
    return zero_grad


def install() -> Callable[[], None]:
    """Wraps the optimizers' `pre_step` and `zero_grad`; returns the function that restores them."""
    saved: list[tuple[type, str, Any]] = []
    for cls in WRAPPED:
        for attr, wrap in (("pre_step", _wrap_pre_step), ("zero_grad", _wrap_zero_grad)):
            if attr in cls.__dict__:
                original = cls.__dict__[attr]
                saved.append((cls, attr, original))
                setattr(cls, attr, wrap(original))

    def uninstall() -> None:
        for cls, attr, original in reversed(saved):
            setattr(cls, attr, original)

    return uninstall

