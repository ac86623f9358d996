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

The step: `dp_step` runs a real `PrivacyEngine` step (hooks or ghost mode, one batch or several
micro-batches) on a copy of the model up to the update, and returns what `export_trace` needs to
write the step into the trace:

    step = ghost_oracle.opacus.dp_step(model, per_example_loss, [mb1, mb2], max_grad_norm=1.0,
                                       noise_multiplier=1.0, grad_sample_mode="hooks")
    export_trace(model, per_example_loss, step.inputs, "step.safetensors", clipper="opacus",
                 **step.export_kwargs())
"""
from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from opacus import GradSampleModule, PrivacyEngine
from opacus.grad_sample import GradSampleModuleFastGradientClipping

# Exact ghost clipping for tied parameters: PrivacyEngine.make_private with the tie kept.
from .tied import make_private

__all__ = ["Step", "dp_step", "ghost_norms", "make_private", "norms", "per_sample_norms"]

# The γ Opacus 1.6 adds to the norm in its clip factor min(1, C / (n + γ)), in hooks and ghost
# mode alike (DPOptimizer.clip_and_accumulate, get_clipping_coef).
OPACUS_CLIP_STABILIZER = 1e-6


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
        sq: torch.Tensor | None = None
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
            term: torch.Tensor = (gs.detach().reshape(gs.shape[0], -1).to(device="cpu", dtype=torch.float64)
                                  .pow(2).sum(1))
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
            norms: torch.Tensor = torch.stack([n.to(device) for n in per_param], dim=1).norm(2, dim=1)
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
        norms: torch.Tensor = gsm.get_norm_sample()  # Opacus is untyped: its tensors are Any here
        return norms.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
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


# ---------------------------------------------------------------------------------------------
# The step.


@dataclass
class Step:
    """One DP-SGD step as Opacus took it, up to the update (the weights left as they were).

    Per example (over the logical batch, the micro-batches in order), float64 on the CPU:
    `norms` are the norms Opacus clipped by and `coefficients` its clip factors
    (min(1, C / (n + 1e-6)), in the norms' dtype). Per trainable parameter (named as in
    `model.named_parameters()`, a tied parameter once), in the parameter's shape and dtype:
    `clipped_sum` is `p.summed_grad`, the clipped sum before noise, and `update` is `p.grad`
    after the noise and the division, (Σ c_i g_i + σ C ξ) / D. `batch_divisor` is the D Opacus
    divided by: `expected_batch_size × accumulated_iterations` as its optimizer computes them
    (1 for `loss_reduction="sum"`). `inputs` is the list of micro-batches the step ran on."""

    norms: torch.Tensor
    coefficients: torch.Tensor
    clipped_sum: dict[str, torch.Tensor]
    update: dict[str, torch.Tensor]
    batch_divisor: float
    max_grad_norm: float
    noise_multiplier: float
    expected_batch_size: int
    accumulated_iterations: int
    grad_sample_mode: str
    accumulation: str
    inputs: list[Any] = field(repr=False)
    clip_stabilizer: float = OPACUS_CLIP_STABILIZER

    def export_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `export_trace` that carry this step's claims."""
        return {
            "claimed_norms": self.norms,
            "claimed_coefficients": self.coefficients,
            "max_grad_norm": self.max_grad_norm,
            "noise_multiplier": self.noise_multiplier,
            "clipped_sum": self.clipped_sum,
            "update": self.update,
            "batch_divisor": self.batch_divisor,
            "clip_stabilizer": self.clip_stabilizer,
            "clipping": "flat",
        }


class _PerExampleLoss(torch.nn.Module):
    """The criterion handed to `make_private` in ghost mode: its input is already the B
    per-example losses; with `reduction="none"` (what Opacus's `DPLossFastGradientClipping`
    sets while calling it) it returns them as they are."""

    def __init__(self, reduction: str):
        super().__init__()
        self.reduction = reduction

    def forward(self, losses: torch.Tensor) -> torch.Tensor:
        if self.reduction == "none":
            return losses
        return losses.mean() if self.reduction == "mean" else losses.sum()


def _batch_size(inputs: Any) -> int:
    t = inputs
    if isinstance(inputs, dict):
        t = inputs.get("input_ids")
        if not torch.is_tensor(t):
            t = next((v for v in inputs.values() if torch.is_tensor(v) and v.dim() >= 1), None)
    if not torch.is_tensor(t) or t.dim() < 1:
        raise TypeError(f"a micro-batch must be a tensor of ids or a dict of tensors, got {type(inputs).__name__}")
    return int(t.shape[0])


def _losses(model: torch.nn.Module, per_example_loss: Callable[..., torch.Tensor], mb: Any, k: int) -> torch.Tensor:
    losses = per_example_loss(model, mb)
    b = _batch_size(mb)
    if not torch.is_tensor(losses) or losses.shape != (b,):
        shape = tuple(losses.shape) if torch.is_tensor(losses) else type(losses).__name__
        raise ValueError(f"micro-batch {k}: per_example_loss returned {shape}; expected a tensor of shape ({b},), "
                         "one loss per example")
    return losses


def dp_step(
    model: torch.nn.Module,
    per_example_loss: Callable[..., torch.Tensor],
    inputs: Any,
    *,
    max_grad_norm: float,
    noise_multiplier: float,
    grad_sample_mode: str = "hooks",
    accumulation: str = "skip_step",
    loss_reduction: str = "mean",
    expected_batch_size: int | None = None,
    seed: int = 0,
) -> Step:
    """Runs one Opacus 1.6 DP-SGD step on a deep copy of `model` (the model itself is left
    untouched) up to the update, and returns the step's norms, clip factors, clipped sum,
    update and divisor (`Step`; `step.export_kwargs()` are `export_trace`'s arguments).

    The step is Opacus's own: `PrivacyEngine(secure_mode=False).make_private(...)` with an SGD
    optimizer, `poisson_sampling=False`, flat clipping, the noise drawn from a `torch.Generator`
    seeded with `seed` (`noise_generator`), and `optimizer.pre_step()` for the last micro-batch
    (clip, accumulate, add noise, divide), never the weights' update itself.

    Args:
        model: the model, in train mode with dropout off (Opacus records activations only in
            training mode; the trace must see the same function).
        per_example_loss: `per_example_loss(model, batch) -> Tensor[b]`, each example's own loss.
            For Hugging Face position embeddings pass explicit b×T `position_ids` (with the
            default 1×T ones Opacus sums the position table's grad_sample over the batch).
        inputs: the batch, or a list of micro-batches making up the logical batch.
        grad_sample_mode: `"hooks"` (`GradSampleModule`: per-sample gradients, a tied parameter's
            uses summed) or `"ghost"` (ghost clipping; Opacus refuses tied parameters).
        accumulation: how several micro-batches make one step. `"skip_step"`: what
            `BatchMemoryManager` does, `optimizer.signal_skip_step(do_skip=True)` and
            `optimizer.step()` (clip and accumulate only) then `optimizer.zero_grad()` after every
            micro-batch but the last. `"backward"`: one `loss.backward()` per micro-batch and one
            step after the last (plain gradient accumulation). Ignored for one batch.
        loss_reduction: Opacus's `loss_reduction` (`"mean"` divides the noisy sum by D; `"sum"`
            does not).
        expected_batch_size: the `expected_batch_size` the optimizer gets (through the data loader
            handed to `make_private`: one of that many examples, in one batch). Default: the
            logical batch size, except with `accumulation="backward"`, where a data loader yields
            the micro-batches and the default is the first micro-batch's size.
        seed: seeds `torch.manual_seed` and the noise generator.
    """
    mbs, sizes, expected_batch_size = _step_arguments(inputs, grad_sample_mode, accumulation, loss_reduction,
                                                      expected_batch_size)
    torch.manual_seed(seed)
    gsm, optimizer, dp_criterion = _make_private_copy(
        model, grad_sample_mode=grad_sample_mode, loss_reduction=loss_reduction, seed=seed,
        expected_batch_size=expected_batch_size, max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier)
    recorder = _StepRecorder(gsm, optimizer, grad_sample_mode)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        optimizer.zero_grad(set_to_none=True)
        for k, mb in enumerate(mbs):
            last = k == len(mbs) - 1
            losses = _losses(gsm, per_example_loss, mb, k)
            if dp_criterion is not None:
                dp_criterion(losses).backward()  # Opacus's two backward passes
            else:
                (losses.mean() if loss_reduction == "mean" else losses.sum()).backward()
            if last:
                if not optimizer.pre_step():
                    raise RuntimeError("Opacus skipped the last step")  # pragma: no cover
            elif accumulation == "skip_step":
                optimizer.signal_skip_step(do_skip=True)
                optimizer.step()  # clip and accumulate; no noise, no update
                optimizer.zero_grad(set_to_none=True)

    clipped_sum, update = recorder.sums(gsm)
    norms_all = torch.cat([n.to(device="cpu", dtype=torch.float64) for n in recorder.norms])
    factors_all = torch.cat([c.to(device="cpu", dtype=torch.float64) for c in recorder.factors])
    if norms_all.shape[0] != sum(sizes):
        raise RuntimeError(f"Opacus clipped {norms_all.shape[0]} examples; the batch has {sum(sizes)}")
    if hasattr(gsm, "_close"):
        gsm._close()
    return Step(norms=norms_all, coefficients=factors_all, clipped_sum=clipped_sum, update=update,
                batch_divisor=recorder.divisor, max_grad_norm=float(max_grad_norm),
                noise_multiplier=float(noise_multiplier), expected_batch_size=int(optimizer.expected_batch_size),
                accumulated_iterations=recorder.accumulated_iterations, grad_sample_mode=grad_sample_mode,
                accumulation=accumulation if len(mbs) > 1 else "none", inputs=mbs)


def _step_arguments(inputs: Any, grad_sample_mode: str, accumulation: str, loss_reduction: str,
                    expected_batch_size: int | None) -> tuple[list[Any], list[int], int]:
    """`dp_step`'s arguments checked: the micro-batches, their sizes and the expected batch size
    (its default resolved)."""
    if grad_sample_mode not in ("hooks", "ghost"):
        raise ValueError(f"grad_sample_mode must be \"hooks\" or \"ghost\", got {grad_sample_mode!r}")
    if accumulation not in ("skip_step", "backward"):
        raise ValueError(f"accumulation must be \"skip_step\" or \"backward\", got {accumulation!r}")
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction must be \"mean\" or \"sum\", got {loss_reduction!r}")
    mbs = list(inputs) if isinstance(inputs, list) else [inputs]
    if not mbs:
        raise ValueError("inputs is an empty list: pass the batch, or the list of its micro-batches")
    sizes = [_batch_size(mb) for mb in mbs]
    if expected_batch_size is None:
        expected_batch_size = sizes[0] if accumulation == "backward" and len(mbs) > 1 else sum(sizes)
    if int(expected_batch_size) != expected_batch_size or expected_batch_size < 1:
        raise ValueError(f"expected_batch_size must be a positive integer, got {expected_batch_size}")
    return mbs, sizes, int(expected_batch_size)


def _make_private_copy(model: torch.nn.Module, *, grad_sample_mode: str, loss_reduction: str, seed: int,
                       expected_batch_size: int, max_grad_norm: float,
                       noise_multiplier: float) -> tuple[Any, Any, Any]:
    """A deep copy of `model` made private by Opacus's own `PrivacyEngine` with an SGD optimizer
    and seeded noise: (the wrapped module, the DP optimizer, the DP criterion in ghost mode or
    None)."""
    module = copy.deepcopy(model)
    module.zero_grad(set_to_none=True)
    device = next(module.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    # A data loader of one batch of `expected_batch_size` examples: make_private reads
    # expected_batch_size = len(dataset) / len(loader) from it; it is never iterated.
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(expected_batch_size)),
                                         batch_size=expected_batch_size)
    sgd = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=1.0)
    criterion = _PerExampleLoss(loss_reduction)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Secure RNG turned off")  # seeded noise, on purpose
        engine = PrivacyEngine(secure_mode=False)
        made = engine.make_private(module=module, optimizer=sgd, criterion=criterion, data_loader=loader,
                                   noise_multiplier=float(noise_multiplier), max_grad_norm=float(max_grad_norm),
                                   loss_reduction=loss_reduction, poisson_sampling=False,
                                   noise_generator=generator, grad_sample_mode=grad_sample_mode)
    if grad_sample_mode == "ghost":
        gsm, optimizer, dp_criterion, _ = made
        return gsm, optimizer, dp_criterion
    (gsm, optimizer, _) = made
    return gsm, optimizer, None


class _StepRecorder:
    """Records what an Opacus step computes, from inside it: the norms and clip factors of every
    micro-batch (by the optimizer's or the ghost module's own arithmetic), and the noisy sum and
    divisor just before the optimizer divides."""

    def __init__(self, gsm: Any, optimizer: Any, grad_sample_mode: str):
        self.norms: list[torch.Tensor] = []
        self.factors: list[torch.Tensor] = []
        self.noisy: dict[int, torch.Tensor] = {}
        self.accumulated_iterations = 0
        self.divisor = 1.0
        if grad_sample_mode == "hooks":
            clip_and_accumulate = optimizer.clip_and_accumulate

            def recording_clip_and_accumulate() -> None:
                # DPOptimizer.clip_and_accumulate's norms and factors, by its own arithmetic, read
                # from the same grad samples just before it runs.
                gs = optimizer.grad_samples
                per_param = [g.reshape(len(g), -1).norm(2, dim=-1) for g in gs]
                per_param = [n.to(per_param[0].device) for n in per_param]
                n = torch.stack(per_param, dim=1).norm(2, dim=1)
                self.norms.append(n.detach().clone())
                factor = (optimizer.max_grad_norm / (n + OPACUS_CLIP_STABILIZER)).clamp(max=1.0)
                self.factors.append(factor.detach())
                clip_and_accumulate()

            optimizer.clip_and_accumulate = recording_clip_and_accumulate
        else:
            get_clipping_coef = gsm.get_clipping_coef

            def recording_get_clipping_coef() -> torch.Tensor:
                coef: torch.Tensor = get_clipping_coef()  # sets per_sample_gradient_norms
                self.norms.append(gsm.per_sample_gradient_norms.detach().clone())
                self.factors.append(coef.detach().clone())
                return coef

            gsm.get_clipping_coef = recording_get_clipping_coef

        scale_grad = optimizer.scale_grad

        def recording_scale_grad() -> None:
            self.noisy = {id(p): p.grad.detach().clone() for p in optimizer.params}
            self.accumulated_iterations = int(optimizer.accumulated_iterations)
            self.divisor = (float(optimizer.expected_batch_size * optimizer.accumulated_iterations)
                            if optimizer.loss_reduction == "mean" else 1.0)
            scale_grad()

        optimizer.scale_grad = recording_scale_grad

    def sums(self, gsm: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Each trainable parameter's clipped sum and update after the step (a tied parameter
        once), the update checked to be the recorded noisy sum divided by the divisor."""
        clipped_sum, update = {}, {}
        for name, p in gsm._module.named_parameters():  # a tied parameter once
            if not p.requires_grad:
                continue
            if p.summed_grad is None or p.grad is None:
                raise ValueError(f"parameter `{name}`: Opacus left no clipped sum or update (it received no "
                                 "gradient)")
            clipped_sum[name] = p.summed_grad.detach().reshape(p.shape).clone()
            update[name] = p.grad.detach().clone()
            noisy = self.noisy[id(p)]
            if not torch.allclose(update[name].double() * self.divisor, noisy.double(), rtol=1e-5,
                                  atol=1e-30 + 1e-5 * float(noisy.abs().max())):
                raise RuntimeError(f"parameter `{name}`: the update is not the noisy sum divided by "
                                   f"{self.divisor}")  # pragma: no cover
        return clipped_sum, update
