"""`make_private`: `PrivacyEngine.make_private` with exact tied ghost clipping.

    module, optimizer, criterion, data_loader = make_private(
        engine, module=model, optimizer=optimizer, criterion=criterion, data_loader=data_loader,
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost")

The engine's own `make_private` runs, with two of its steps, for this call only, building this
package's classes instead of Opacus's: the ghost-clipping module (or hooks object, with
`wrap_model=False`) and the loss wrapper. Any other `grad_sample_mode` is Opacus's, unchanged.
"""
from __future__ import annotations

from typing import Any

from opacus import PrivacyEngine
from opacus.grad_sample.gsm_base import AbstractGradSampleModule
from torch import nn

from .plugin import (
    TiedDPLoss,
    TiedGhostClipping,
    TiedGradSampleHooks,
    TiedGradSampleModule,
)

__all__ = ["make_private"]

GHOST_MODES = ("ghost", "ghost_fsdp")


def _classes(grad_sample_mode: str) -> tuple[type[TiedGhostClipping], type[TiedGhostClipping] | None]:
    """(wrapping class, non-wrapping class) for a ghost mode."""
    if grad_sample_mode == "ghost":
        return TiedGradSampleModule, TiedGradSampleHooks
    from .fsdp import (
        TiedGradSampleModuleFSDP,  # the FSDP classes import torch.distributed
    )

    return TiedGradSampleModuleFSDP, None


def make_private(engine: PrivacyEngine, **kwargs: Any) -> Any:
    """`engine.make_private(**kwargs)`: the same keyword arguments and the same return value
    (`(module, optimizer, criterion, data_loader)` in ghost modes, `(module, optimizer,
    data_loader)` otherwise). With `grad_sample_mode="ghost"` (or `"ghost_fsdp"`) a parameter
    used by several modules (a head tied to the embedding) is clipped by its exact per-example
    norm, cross terms included, and several `backward()` calls before one `step()` accumulate."""
    if not isinstance(engine, PrivacyEngine):
        raise TypeError(f"engine must be an opacus.PrivacyEngine, got {type(engine).__name__}")
    mode = kwargs.get("grad_sample_mode", "hooks")
    if mode not in GHOST_MODES:
        return engine.make_private(**kwargs)
    wrapping, hooks_only = _classes(mode)

    def prepare_model(module: nn.Module, *, batch_first: bool = True, max_grad_norm: Any = 1.0,
                      loss_reduction: str = "mean", grad_sample_mode: str = mode,
                      wrap_model: bool = True) -> Any:
        engine.validate(module=module, optimizer=None, data_loader=None)
        if isinstance(module, AbstractGradSampleModule):
            if (wrap_model and type(module) is wrapping and module.batch_first == batch_first
                    and module.loss_reduction == loss_reduction):
                return module
            raise ValueError(f"module is already a {type(module).__name__}: pass the plain nn.Module to make_private")
        cls = wrapping if wrap_model else hooks_only
        if cls is None:
            raise ValueError(f"grad_sample_mode={grad_sample_mode!r} needs wrap_model=True")
        return cls(module, batch_first=batch_first, loss_reduction=loss_reduction,  # type: ignore[call-arg]
                   max_grad_norm=max_grad_norm)

    def prepare_criterion(*, module: Any, optimizer: Any, criterion: Any, loss_reduction: str = "mean",
                          **_: Any) -> TiedDPLoss:
        return TiedDPLoss(module, optimizer, criterion, loss_reduction)

    # For this call only: the engine's own steps, but building this package's classes.
    vars(engine)["_prepare_model"] = prepare_model
    vars(engine)["_prepare_criterion"] = prepare_criterion
    try:
        return engine.make_private(**kwargs)
    finally:
        for attr in ("_prepare_model", "_prepare_criterion"):
            vars(engine).pop(attr, None)
