"""Opacus ghost clipping that keeps a tied parameter's cross terms.

`TiedGhostClipping` is mixed into Opacus's own ghost-clipping classes (the wrapping
`GradSampleModuleFastGradientClipping`, the non-wrapping `GradSampleHooksFastGradientClipping`):
the modules holding a tied parameter are captured here (`capture.TiedParameter`), every other
module goes through Opacus's hooks and norm samplers unchanged. Opacus refuses a tied parameter
in `capture_activations_hook`; that refusal is never reached, because a tied module's hooks do
not call Opacus's.

Also here, because Opacus gets them wrong without a tie too:
- a position embedding called with 1 × T ids (Hugging Face's default `position_ids`): its output
  is broadcast over the batch, so the hooks would see one summed example; it is expanded to B
  rows first, so that each example's gradient is its own;
- several `backward()` calls before one `step()`: Opacus's loss wrapper zeroes the gradients
  between its two passes, dropping earlier micro-batches' clipped gradients; they are kept;
- a scaled embedding (Gemma's), whose only buffer is its constant scale, passes validation.
"""
from __future__ import annotations

from typing import Any

import torch
from opacus.grad_sample import (
    GradSampleHooksFastGradientClipping,
    GradSampleModuleFastGradientClipping,
)
from opacus.utils.fast_gradient_clipping_utils import (
    DPLossFastGradientClipping,
    DPTensorFastGradientClipping,
)
from opacus.utils.module_utils import requires_grad, trainable_modules
from torch import nn

from .capture import TiedParameter, find_tied_parameters, is_scaled_embedding

__all__ = ["TiedDPLoss", "TiedDPTensor", "TiedGhostClipping", "TiedGradSampleHooks", "TiedGradSampleModule"]


def _batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    for key in ("input_ids", "inputs_embeds"):
        value = kwargs.get(key)
        if torch.is_tensor(value) and value.dim() >= 1:
            return int(value.shape[0])
    for value in list(args) + list(kwargs.values()):
        if torch.is_tensor(value) and value.dim() >= 1:
            return int(value.shape[0])
    return None


class TiedGhostClipping:
    """The mixin. Class attribute `include_cross_terms`: False gives standard ghost clipping's
    wrong answer on a tied parameter (each use's own norm only), for tests that must catch it."""

    include_cross_terms: bool = True

    # Attributes of the Opacus class this is mixed into.
    _module: nn.Module
    hooks_enabled: bool
    batch_first: bool
    loss_reduction: str
    trainable_parameters: list[nn.Parameter]
    per_sample_gradient_norms: torch.Tensor

    def _setup_tied(self) -> None:
        self._tied: dict[nn.Parameter, TiedParameter] = {}
        names = {p: n for n, p in self._module.named_parameters()}
        self._parameter_names = names
        captured = find_tied_parameters(self._module)
        # An untied scaled embedding is captured here too, as a parameter with one use: Opacus has
        # no norm sampler for it and its functorch fallback refuses the scale buffer.
        for module_name, module in self._module.named_modules():
            if is_scaled_embedding(module) and module.weight.requires_grad and module.weight not in captured:
                captured[module.weight] = [(f"{module_name}.weight" if module_name else "weight", module)]
        for p, holders in captured.items():
            self._tied[p] = TiedParameter(name=names[p], param=p, holders=holders,
                                          include_cross_terms=self.include_cross_terms)
        # module -> (its name, the tied parameter it holds)
        self._tied_modules: dict[nn.Module, tuple[str, TiedParameter]] = {
            module: (qualified.rsplit(".", 1)[0], state)
            for state in self._tied.values() for qualified, module in state.holders}
        self._batch: int | None = None
        self._check_next_backward = True
        self._root_hook = self._module.register_forward_pre_hook(self._start_forward, with_kwargs=True)

    @classmethod
    def validate(cls, module: nn.Module, *, strict: bool = False) -> list[NotImplementedError]:
        """Opacus's check (no trainable layer with buffers), except for a scaled embedding: its one
        buffer is the constant it multiplies by, which this class accounts for."""
        errors = [NotImplementedError(f"Model contains a trainable layer with buffers that Opacus doesn't currently "
                                      f"support ({name}: {type(m).__name__})")
                  for name, m in trainable_modules(module)
                  if len(list(m.buffers(recurse=False))) > 0 and not is_scaled_embedding(m)]
        if strict and errors:
            raise NotImplementedError(errors)
        return errors

    def _get_module_type(self, module: nn.Module) -> Any:
        # Seen by Opacus's add_hooks: a scaled embedding needs no functorch preparation (which
        # refuses its buffer); its hooks are this class's.
        if is_scaled_embedding(module):
            return nn.Embedding
        return super()._get_module_type(module)  # type: ignore[misc]

    def _start_forward(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.hooks_enabled:
            return
        # A new forward pass of the whole model: uses left from a forward without backward go.
        for state in self._tied.values():
            state.reset()
        self._batch = _batch_size(args, kwargs) if self.batch_first else None

    def _broadcast(self, module: nn.Module, forward_input: Any, output: Any) -> tuple[Any, Any] | None:
        """An embedding looked up with one row of ids for a batch of B (1 × T position ids): its
        output and ids expanded to B rows, or None when there is nothing to expand."""
        batch = self._batch
        if (batch is None or batch == 1 or not isinstance(module, nn.Embedding) or not torch.is_tensor(output)
                or output.dim() < 2 or output.shape[0] != 1):
            return None
        ids = forward_input[0]
        if not torch.is_tensor(ids) or ids.dim() < 1 or ids.shape[0] != 1:
            return None
        expanded_ids = ids.expand(batch, *ids.shape[1:]).contiguous()  # Opacus views the ids
        return [expanded_ids, *forward_input[1:]], output.expand(batch, *output.shape[1:])

    def capture_activations_hook(self, module: nn.Module, forward_input: Any, forward_output: Any) -> Any:
        replaced = self._broadcast(module, forward_input, forward_output) if self.hooks_enabled else None
        if replaced is not None:
            forward_input, forward_output = replaced
        tied = self._tied_modules.get(module)
        if tied is None:
            super().capture_activations_hook(module, forward_input, forward_output)  # type: ignore[misc]
        elif requires_grad(module) and module.training and torch.is_grad_enabled() and self.hooks_enabled:
            name, state = tied
            state.record(name, module, forward_input[0])
        return forward_output if replaced is not None else None

    def capture_backprops_hook(self, module: nn.Module, _forward_input: Any, forward_output: Any,
                               loss_reduction: str, batch_first: bool) -> None:
        tied = self._tied_modules.get(module)
        if tied is None:
            super().capture_backprops_hook(module, _forward_input, forward_output,  # type: ignore[misc]
                                           loss_reduction, batch_first)
            return
        if not self.hooks_enabled:
            return
        if not batch_first:
            raise NotImplementedError(f"tied parameter `{tied[1].name}`: batch_first=False is not supported")
        name, state = tied
        use = state.pending_use(name)
        grad_output = forward_output[0].detach()
        scale = float(use.inputs.shape[0]) if loss_reduction == "mean" else 1.0
        state.arrive(use, grad_output, scale, check=self._check_next_backward)
        bias = getattr(module, "bias", None)
        if isinstance(bias, nn.Parameter) and bias.requires_grad:
            # An untied bias of a module whose weight is tied: ‖Σ_t δ_t‖.
            per_example = grad_output.reshape(use.inputs.shape[0], -1, grad_output.shape[-1]).sum(1) * scale
            wide = torch.float64 if bias.dtype == torch.float64 else torch.float32
            bias._norm_sample = per_example.to(wide).norm(dim=1)  # type: ignore[attr-defined]
        if state.complete:
            state.param._norm_sample = state.finish()  # type: ignore[attr-defined]

    def get_norm_sample(self) -> torch.Tensor:
        """The norm over all trainable parameters of their per-example norms, summed in float32
        (float64 for float64 parameters) whatever the parameters' dtype."""
        per_param = []
        for p in self.trainable_parameters:
            norm = getattr(p, "_norm_sample", None)
            if norm is None:
                raise RuntimeError(f"parameter `{self._parameter_names.get(p, tuple(p.shape))}` has no per-sample "
                                   "norm after the backward pass (is it on the loss's path, and its module hooked?)"
                                   + self._tied_name(p))
            per_param.append(norm)
        wide = torch.float64 if any(n.dtype == torch.float64 for n in per_param) else torch.float32
        device = per_param[0].device
        norm_sample: torch.Tensor = torch.stack([n.to(device=device, dtype=wide) for n in per_param],
                                                dim=0).norm(2, dim=0)
        self.per_sample_gradient_norms = norm_sample
        return norm_sample

    def _tied_name(self, p: nn.Parameter) -> str:
        state = self._tied.get(p)
        return f" (tied parameter `{state.name}`: not every use reached the backward pass)" if state else ""

    def check_tied_gradients(self) -> None:
        """After the first backward pass: every tied parameter's batch gradient equals the sum of
        the uses the hooks saw, else `RuntimeError` naming it. Later passes are not checked."""
        if not self._check_next_backward:
            return
        self._check_next_backward = False
        for state in self._tied.values():
            state.check_batch_gradient(state.param.grad, state.low_precision)


class TiedGradSampleModule(TiedGhostClipping, GradSampleModuleFastGradientClipping):  # type: ignore[misc]
    """`GradSampleModuleFastGradientClipping` (Opacus wraps the model) with exact tied norms."""

    def __init__(self, m: nn.Module, **kwargs: Any) -> None:
        super().__init__(m, **kwargs)
        self._setup_tied()


class TiedGradSampleHooks(TiedGhostClipping, GradSampleHooksFastGradientClipping):  # type: ignore[misc]
    """`GradSampleHooksFastGradientClipping` (`wrap_model=False`: hooks on the model as it is)
    with exact tied norms."""

    def __init__(self, m: nn.Module, **kwargs: Any) -> None:
        super().__init__(m, **kwargs)
        self._setup_tied()


class TiedDPTensor(DPTensorFastGradientClipping):  # type: ignore[misc]
    """Opacus's two backward passes (norms, then the loss reweighted by the clip factors), keeping
    what earlier `backward()` calls of the same step accumulated, and checking after the first
    pass that the hooks saw every use of each tied parameter."""

    def backward(self) -> None:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        earlier = {p: p.grad for p in params if p.grad is not None}
        for p in earlier:
            p.grad = None  # the first pass's gradients are the batch's alone (the check reads them)
        if self.loss_reduction == "mean":
            reduced = self.loss_per_sample.mean(dim=0)
        elif self.loss_reduction == "sum":
            reduced = self.loss_per_sample.sum(dim=0)
        else:
            raise ValueError(f"loss_reduction = {self.loss_reduction!r}: only 'sum' and 'mean' are supported")
        reduced.backward(retain_graph=True)
        if isinstance(self.module, TiedGhostClipping):
            self.module.check_tied_gradients()
        self.optimizer.zero_grad()
        coeff = self.module.get_clipping_coef()
        second = (coeff.to(self.loss_per_sample.device) * self.loss_per_sample).sum()
        self.module.disable_hooks()
        try:
            second.backward()
        finally:
            self.module.enable_hooks()
        for p, g in earlier.items():
            p.grad = g if p.grad is None else p.grad + g


    def _rewrap(self, result: DPTensorFastGradientClipping) -> TiedDPTensor:
        return TiedDPTensor(result.module, result.optimizer, result.loss_per_sample, result.loss_reduction)

    # Arithmetic on the loss (a division by the accumulation steps, a weighted sum) keeps this class.
    def __truediv__(self, other: Any) -> TiedDPTensor:
        return self._rewrap(super().__truediv__(other))

    def __mul__(self, other: Any) -> TiedDPTensor:
        return self._rewrap(super().__mul__(other))

    def __rmul__(self, other: Any) -> TiedDPTensor:
        return self._rewrap(super().__rmul__(other))

    def __add__(self, other: Any) -> TiedDPTensor:
        return self._rewrap(super().__add__(other))

    def __radd__(self, other: Any) -> TiedDPTensor:
        return self._rewrap(super().__radd__(other))

    def __sub__(self, other: Any) -> TiedDPTensor:
        return self._rewrap(super().__sub__(other))

    def __rsub__(self, other: Any) -> TiedDPTensor:
        return self._rewrap(super().__rsub__(other))

    def __neg__(self) -> TiedDPTensor:
        return self._rewrap(super().__neg__())


class TiedDPLoss(DPLossFastGradientClipping):  # type: ignore[misc]
    """Opacus's ghost-clipping loss wrapper, whose losses backpropagate as `TiedDPTensor`."""

    def __call__(self, *args: Any, shape: Any = None, **kwargs: Any) -> TiedDPTensor:
        wrapped = super().__call__(*args, shape=shape, **kwargs)
        return TiedDPTensor(wrapped.module, wrapped.optimizer, wrapped.loss_per_sample, wrapped.loss_reduction)
