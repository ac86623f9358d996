"""Per-example gradient norms taken straight from Opacus (1.6), to audit them with `assert_norms`.

    from opacus import GradSampleModule
    from ghost_oracle.torch import assert_norms
    import ghost_oracle.opacus

    gsm = GradSampleModule(copy.deepcopy(model), loss_reduction="sum")
    assert_norms(model, per_example_loss, ids, max_grad_norm=1.0,
                 claimed_norms=ghost_oracle.opacus.norms(gsm, per_example_loss, ids))

- `GradSampleModule` (hooks): the norm of every example's gradient from the parameters'
  `grad_sample`. Opacus 1.6 sums a tied parameter's uses into one `grad_sample` (the hooks of
  both modules add into `_current_grad_sample` until the parameter's forward count reaches zero),
  so each parameter is counted once, with its summed per-sample gradient. By default the norms
  are taken in float64 from the grad samples as stored; `as_optimizer=True` takes them as
  `DPOptimizer.clip_and_accumulate` does, in the grad samples' own dtype (per parameter, then
  over parameters): in bf16 or f16 these are the norms the optimizer really clips by, rounded
  twice to the low precision.
- `GradSampleModuleFastGradientClipping` (ghost clipping): `get_norm_sample()`, the norms its
  clipping coefficients come from.

Pass `per_example_loss` and `inputs` and the helper runs one forward and backward pass through
the wrapped module itself (the loss reduced as the module's `loss_reduction` expects, so the
norms are those of each example's own loss), reads the norms and clears the per-sample state.
Without them it reads the state of the backward pass you ran.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from opacus import GradSampleModule
from opacus.grad_sample import GradSampleModuleFastGradientClipping

__all__ = ["ghost_norms", "norms", "per_sample_norms"]


def _clear(gsm: GradSampleModule) -> None:
    gsm.zero_grad(set_to_none=True)  # p.grad and p.grad_sample
    for p in gsm._module.parameters():
        for attr in ("_norm_sample", "_current_grad_sample"):
            if hasattr(p, attr):
                delattr(p, attr)


def _backward(gsm: GradSampleModule, per_example_loss: Callable[..., torch.Tensor], inputs: Any) -> int:
    """One forward/backward pass through `gsm` whose per-sample results are those of each
    example's own loss. Returns B."""
    _clear(gsm)
    losses = per_example_loss(gsm, inputs)
    if not torch.is_tensor(losses) or losses.dim() != 1:
        shape = tuple(losses.shape) if torch.is_tensor(losses) else type(losses).__name__
        raise ValueError(f"per_example_loss returned {shape}; expected a tensor of shape (B,), one loss per example")
    # Opacus multiplies the backprops by B for loss_reduction="mean": a mean loss then gives
    # each example's own gradient, and so does a summed loss for "sum".
    reduction = getattr(gsm, "loss_reduction", "mean")
    with warnings.catch_warnings():
        # Opacus's full backward hooks on a model whose inputs are token ids: nothing to act on.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        (losses.mean() if reduction == "mean" else losses.sum()).backward()
    return int(losses.shape[0])


def _needs_both(per_example_loss: object, inputs: object) -> None:
    if (per_example_loss is None) != (inputs is None):
        raise ValueError("pass both per_example_loss and inputs (to run the backward pass here), or neither "
                         "(to read the backward pass you ran)")


def per_sample_norms(
    gsm: GradSampleModule,
    per_example_loss: Callable[..., torch.Tensor] | None = None,
    inputs: Any = None,
    *,
    as_optimizer: bool = False,
) -> torch.Tensor:
    """‖g_i‖ of every example from a `GradSampleModule`'s `grad_sample`s: each trainable
    parameter once (a tied parameter's `grad_sample` already sums its uses), float64 on the CPU.

    With `as_optimizer=True` the arithmetic is `DPOptimizer.clip_and_accumulate`'s: each
    parameter's per-sample norm in its grad sample's dtype, then the norm over the parameters
    (in the module's parameter order, that of an optimizer built from `model.parameters()`) in
    the dtype they promote to; the result is converted to float64 afterwards. Without it, the
    grad samples are converted to float64 first.
    """
    _needs_both(per_example_loss, inputs)
    batch = None
    if per_example_loss is not None:
        batch = _backward(gsm, per_example_loss, inputs)
    try:
        sq = None
        per_param: list[torch.Tensor] = []
        sizes: dict[str, int] = {}
        for name, p in gsm._module.named_parameters():  # a tied parameter once
            if not p.requires_grad:
                continue
            gs = getattr(p, "grad_sample", None)
            if gs is None:
                if p.grad is None:
                    continue  # not on the loss path: zero per-example gradients
                raise ValueError(f"parameter `{name}` has a gradient but no grad_sample: Opacus computed no "
                                 "per-sample gradient for it (is its module supported, and the model in train mode?)")
            if isinstance(gs, list):
                raise ValueError(f"parameter `{name}`: grad_sample holds {len(gs)} accumulated batches; call "
                                 "zero_grad() before the backward pass of the batch to audit")
            sizes[name] = int(gs.shape[0])
            if as_optimizer:
                per_param.append(gs.detach().reshape(len(gs), -1).norm(2, dim=-1))
            term = gs.detach().reshape(gs.shape[0], -1).to(device="cpu", dtype=torch.float64).pow(2).sum(1)
            if sq is not None and term.shape != sq.shape:
                other = next(iter(sizes))
                raise ValueError(
                    f"parameter `{name}`: grad_sample has batch size {gs.shape[0]} but `{other}`'s has "
                    f"{sizes[other]}: Opacus summed one of them over the batch (with Hugging Face models, pass "
                    "explicit B×T position_ids: the default 1×T ones make the position embedding's grad_sample "
                    "batch size 1)")
            sq = term if sq is None else sq + term
        if sq is None:
            raise ValueError("no parameter has a grad_sample: run a backward pass through the GradSampleModule "
                             "first, or pass per_example_loss and inputs")
        if batch is not None and sq.shape[0] != batch:
            raise ValueError(f"grad_sample has batch size {sq.shape[0]} for a batch of {batch}")
        if as_optimizer:
            device = per_param[0].device
            norms = torch.stack([n.to(device) for n in per_param], dim=1).norm(2, dim=1)
            return norms.to(device="cpu", dtype=torch.float64)
        return sq.sqrt()
    finally:
        if per_example_loss is not None:
            _clear(gsm)


def ghost_norms(
    gsm: GradSampleModuleFastGradientClipping,
    per_example_loss: Callable[..., torch.Tensor] | None = None,
    inputs: Any = None,
) -> torch.Tensor:
    """The per-example norms Opacus's ghost clipping computed (`get_norm_sample()`), float64 on
    the CPU."""
    _needs_both(per_example_loss, inputs)
    if per_example_loss is not None:
        _backward(gsm, per_example_loss, inputs)
    try:
        if not any(hasattr(p, "_norm_sample") for p in gsm._module.parameters()):
            raise ValueError("no per-sample norms recorded: run a backward pass through the "
                             "GradSampleModuleFastGradientClipping first, or pass per_example_loss and inputs")
        return gsm.get_norm_sample().detach().to(device="cpu", dtype=torch.float64).reshape(-1)
    finally:
        if per_example_loss is not None:
            _clear(gsm)


def norms(
    gsm: GradSampleModule,
    per_example_loss: Callable[..., torch.Tensor] | None = None,
    inputs: Any = None,
    *,
    as_optimizer: bool = False,
) -> torch.Tensor:
    """The per-example gradient norms an Opacus module clips by: `ghost_norms` for a
    `GradSampleModuleFastGradientClipping` (its norms are the ones its clipping uses, whatever
    `as_optimizer`), `per_sample_norms` for any other `GradSampleModule`."""
    if isinstance(gsm, GradSampleModuleFastGradientClipping):
        return ghost_norms(gsm, per_example_loss, inputs)
    if isinstance(gsm, GradSampleModule):
        return per_sample_norms(gsm, per_example_loss, inputs, as_optimizer=as_optimizer)
    raise TypeError(f"expected an Opacus GradSampleModule or GradSampleModuleFastGradientClipping, "
                    f"got {type(gsm).__name__}")
