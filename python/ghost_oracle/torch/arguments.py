"""The model and the batch checked before anything runs, so that bad input is named as such
instead of surfacing later as something else (an empty batch as a loss of the wrong shape,
NaN weights as a self-check mismatch, a meta-device model inside torch)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence

from .batch import Packing, packed_sequences
from .errors import TraceExportError


def check_model(model: object) -> None:
    """Raises, naming the parameter or module: a model that is not an `nn.Module`; parameters
    on the meta device (no values to trace); every parameter frozen (nothing to trace);
    parameters holding NaN or ±inf (the gradients are not numbers); a dropout module with p > 0
    in training mode (each call draws another mask, so the clipper's per-example gradients and
    the trace's are of different functions)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    params = list(model.named_parameters())
    for name, p in params:
        if p.is_meta:
            raise TraceExportError(f"parameter `{name}` is on the meta device: it holds no values to trace (load "
                                   "the weights first, e.g. model.to_empty(device='cpu') and load_state_dict)")
    if params and not any(p.requires_grad for _, p in params):
        raise TraceExportError("every parameter of the model is frozen (requires_grad=False): there is no "
                               "gradient to trace")
    for name, p in params:
        if p.requires_grad and p.is_floating_point() and not bool(torch.isfinite(p.detach()).all()):
            what = "NaN" if bool(torch.isnan(p.detach()).any()) else "±inf"
            raise ValueError(f"parameter `{name}` holds {what}: its per-example gradients are not numbers")
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training and m.p > 0:
            raise TraceExportError(
                f"module `{name}` ({type(m).__name__}, p={m.p}) is in training mode: each forward draws another "
                "dropout mask, so the trace's per-example gradients are not those the clipper saw; call "
                "model.eval() (or set p=0) before exporting")


def _floating_tensors(inputs: Any) -> list[tuple[str, torch.Tensor]]:
    """The batch's tensors of values, by name: a `PackedSequence`'s data, not its packing (its
    batch sizes and indices are integers that describe the batch, not inputs of the model)."""
    def named(name: str, v: Any) -> list[tuple[str, torch.Tensor]]:
        if isinstance(v, PackedSequence):
            return [(f"{name}.data", v.data)]
        return [(name, v)] if torch.is_tensor(v) else []

    if torch.is_tensor(inputs) or isinstance(inputs, PackedSequence):
        return named("inputs", inputs)
    if isinstance(inputs, Mapping):
        return [pair for k, v in inputs.items() for pair in named(f"inputs[{k!r}]", v)]
    if isinstance(inputs, (tuple, list)):
        return [pair for k, v in enumerate(inputs) for pair in named(f"inputs[{k}]", v)]
    return []


def check_inputs(inputs: Any, b: int | None, batch_axis: int) -> None:
    """Raises for an empty batch (named as such, whatever the loss would do with it), for
    inputs on the meta device, for floating-point inputs holding NaN or ±inf, and for a
    `PackedSequence` whose packing is not one (`batch.Packing.of` names what is wrong)."""
    for packed in packed_sequences(inputs):
        Packing.of(packed)
    if b == 0:
        raise ValueError(f"inputs: the batch is empty (0 examples along batch_axis {batch_axis}): there is no "
                         "example to trace")
    for name, t in _floating_tensors(inputs):
        if t.is_meta:
            raise ValueError(f"{name} is on the meta device: it holds no values")
        if t.is_floating_point() or t.is_complex():
            if t.is_complex():
                raise TypeError(f"{name} is complex ({t.dtype}): per-example gradient norms are of real models")
            bad = ~torch.isfinite(t.detach())
            if bool(bad.any()):
                idx = [int(i) for i in bad.nonzero()[0].tolist()]
                what = "NaN" if bool(torch.isnan(t.detach()).any()) else "±inf"
                raise ValueError(f"{name} holds {what} (first at index {idx}): the losses and gradients are not "
                                 "numbers")



def integer_input_error(error: RuntimeError, model: torch.nn.Module, inputs: Any) -> TraceExportError | None:
    """The error to raise instead of torch's when `per_example_loss` failed because integer
    inputs met a module that computes in floating point (a Linear fed token ids, say): it names
    the module, found as the innermost module whose forward the failing call was in. None where
    the failure is not that (the user's exception then propagates unchanged)."""
    integer = [(name, t) for name, t in _floating_tensors(inputs)
               if not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)]
    text = str(error)
    if not integer or not any(w in text for w in ("dtype", "scalar type", "Long", "Int")):
        return None
    names = {id(m): name for name, m in model.named_modules()}
    module = None
    tb = error.__traceback__
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if isinstance(candidate, torch.nn.Module) and id(candidate) in names:
            module = candidate
        tb = tb.tb_next
    if module is None:
        return None
    dtypes = sorted({p.dtype for p in module.parameters(recurse=False)} - {torch.bool}, key=str)
    if not dtypes or not all(d.is_floating_point for d in dtypes):
        return None
    what, t = integer[0]
    return TraceExportError(f"module `{names[id(module)]}` ({type(module).__name__}) computes in "
                            f"{', '.join(str(d) for d in dtypes)} but {what} is {t.dtype}: pass floating-point "
                            f"inputs (torch's error: {text.splitlines()[0]})")
