"""Norms: y = x̂ ⊙ w (+ b) or x̂ ⊙ (1 + w) (+ b), x̂ a normalization of x over its last axis that
does not depend on w or b. A layernorm site (activations: x̂; backprops: the output's gradient;
dL/dw = Σ over rows of δ ⊙ x̂ for both forms) and a bias site.

- `nn.LayerNorm`, `nn.RMSNorm`, any module whose class name ends in `RMSNorm` with a `weight`
  and an `eps` or `variance_epsilon`, and the classes declared `"layernorm"`;
- x̂ is what the module's own forward computes (replayed with the weight set to the identity of
  its form), so a norm that upcasts to float32 inside a float64 model (every Hugging Face
  RMSNorm) is traced with the float32 x̂ it really used; the site's precision is the one in
  which the module multiplies x̂ by its weight (`_normalized`);
- a norm without affine parameters (`elementwise_affine=False`), or with them frozen, reads no
  trainable parameter and has no site; one with only a trainable bias (or a frozen weight) has
  only the bias site;
- a LayerNorm's row of equal values (one feature, or a constant row) has x̂ = 0 exactly;
- a norm over the last axis of B×T×H×k (Qwen3's and Gemma 3's per-head q/k norms, whose one
  weight is shared by every head and position) is one site with T·H rows per example.

Its functional forms: `F.layer_norm` and `F.rms_norm`, x̂ the same call without its weight and
bias.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..precision import DTYPE_NAMES, PRECISIONS
from . import base
from .base import FunctionHandler, Handler, Operands, Site, Use, arg


def cancelled_rounding(n: int, dtype: torch.dtype, eps: float, terms: torch.Tensor) -> torch.Tensor:
    """The rounding autograd's backward adds to a weight gradient whose exact value is 0: a norm's
    group of `n` equal values, where x̂ = x − mean is 0 exactly (the site holds 0 there) but
    neither the forward nor autograd gets 0 (the mean of n equal values is not always that
    value, the backward forms Σ δ·x − Σ δ·mean and multiplies it by 1/√(var + ε), up to 1/√ε).
    `terms` is Σ |δ|·|x| over those groups, per weight entry; absolute, per entry."""
    u = torch.finfo(dtype).eps / 2
    return 8.0 * (n + 2) * u / math.sqrt(max(eps, torch.finfo(torch.float64).tiny)) * terms


def _replay(use: Use, x: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """The module's own forward on `x` with its direct parameters `params` substituted, under the
    autocast the recorded forward ran in, without autograd."""
    ac = use.autocast
    ctx = torch.autocast(ac[0], dtype=ac[1]) if ac is not None else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        y: Any = torch.func.functional_call(use.module, params, (x,))
    if not torch.is_tensor(y) or y.shape != x.shape:
        shape = list(y.shape) if torch.is_tensor(y) else type(y).__name__
        raise use.error(f"traced as a norm, its forward on an input of shape {list(x.shape)} returns {shape}, not a "
                        "tensor of that shape")
    return y


def _normalized(use: Use, x: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    """(x̂, precision) of a norm's use: x̂ as the module's own forward computes it (its upcasts,
    formula and ε, cast back as it casts its output), and the precision in which it multiplies
    x̂ by its weight, which is the precision of the weight's gradient.

    Hugging Face's RMSNorms compute x̂ in float32 even in a float64 model: Llama's then
    multiplies the float32 x̂, cast back to float64, by w in float64, while Gemma's multiplies x̂
    by (1 + w) in float32. Neither is known by name. x̂ is the forward with the weight set to
    the identity of its form (w = 1 for x̂ ⊙ w, w = 0 for x̂ ⊙ (1 + w); bias 0), which is exact;
    the form and the precision are the first pair in which x̂ ⊙ w' (+ b') reproduces the forward
    with a probe weight w' (and bias b'), finest precision first. A module that is neither form
    is refused."""
    m = use.module
    w = m.weight
    extra = [k for k, v in m._parameters.items() if v is not None and k not in ("weight", "bias")]
    if extra:
        raise use.error(f"traced as a norm (y = x̂ ⊙ w + b), it holds other parameters too ({', '.join(extra)}), "
                        "which that form has no place for")
    k = tuple(w.shape)
    if w.dim() < 1 or tuple(x.shape[x.dim() - w.dim():]) != k:
        raise use.error(
            f"traced as a norm, its weight has shape {list(w.shape)}; the exporter models one weight over the "
            f"input's last axes ({list(x.shape[x.dim() - w.dim():])} here), shared by every position and head")
    bias = m._parameters.get("bias")
    gen = torch.Generator().manual_seed(20240607)
    w_probe = (0.5 + 0.5 * torch.rand(k, generator=gen, dtype=torch.float64)).to(device=w.device, dtype=w.dtype)
    params: dict[str, torch.Tensor] = {"weight": w_probe}
    if bias is not None:
        b_probe = (0.25 * torch.rand(k, generator=gen, dtype=torch.float64) - 0.125).to(device=bias.device,
                                                                                       dtype=bias.dtype)
        params["bias"] = b_probe
    y = _replay(use, x, params)
    dts = {w.dtype, x.dtype, y.dtype, torch.float32} | ({bias.dtype} if bias is not None else set())
    candidates = [d for d in PRECISIONS if d in dts]
    for form, identity in (("w", torch.ones_like(w)), ("1+w", torch.zeros_like(w))):
        ident: dict[str, torch.Tensor] = {"weight": identity}
        if bias is not None:
            ident["bias"] = torch.zeros_like(bias)
        xhat = _replay(use, x, ident)
        scale = w_probe if form == "w" else 1.0 + w_probe
        for d in candidates:
            want = xhat.to(d) * scale.to(d)
            mag = want.abs()
            if bias is not None:
                want = want + params["bias"].to(d)
                mag = mag + params["bias"].to(d).abs()
            err = (y.to(torch.float64) - want.to(y.dtype).to(torch.float64)).abs()
            u = torch.finfo(d).eps / 2
            if bool((err <= 8.0 * u * mag.to(torch.float64) + torch.finfo(d).tiny).all()):
                # A product in a finer precision than the output is rounded to the output's,
                # and so is the weight's gradient (a bf16 Llama's norm: bf16 × bf16 products
                # are exact in float32, so that candidate matches too).
                return xhat, max(d, y.dtype, key=lambda t: torch.finfo(t).eps)
    raise use.error(
        f"traced as a norm, its forward is neither y = x̂ ⊙ w nor y = x̂ ⊙ (1 + w)"
        f"{' (+ b)' if bias is not None else ''} with x̂ independent of the weight, in any of "
        f"{', '.join(DTYPE_NAMES[d] for d in candidates)}: the exporter has no model of it")


def _features_last(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A norm over several axes (`LayerNorm([Z, W])`): its normalized axes as one feature axis,
    in the weight's row-major order."""
    return t.flatten(t.dim() - weight.dim()) if weight.dim() > 1 else t


class Norm(Handler):
    kind: str = "layernorm"

    def normalized(self, use: Use) -> tuple[torch.Tensor, torch.dtype]:
        """(x̂, the precision of the product with the weight): the module's forward, replayed."""
        return _normalized(use, use.input)

    def centred(self, use: Use) -> float | None:
        """ε of a norm known to subtract the mean (`nn.LayerNorm`), whose x̂ is 0 exactly on a row
        of equal values; None for the others (an RMSNorm's x̂ there is ±1)."""
        m = use.module
        return float(m.eps) if type(m) is torch.nn.LayerNorm else None

    def sites(self, use: Use) -> Iterator[Site[torch.Tensor]]:
        weight = use.weight("layernorm")
        if not use.reads_trainable("weight", "bias"):
            return  # no affine parameters (elementwise_affine=False), or frozen ones: nothing to trace
        traced = use.trainable(weight)
        rounding: torch.Tensor | None = None
        if traced:
            xhat, use.dtype = self.normalized(use)
        # the normalized axes, as the affine parameter that is there lays them out
        affine = weight if weight is not None else use.param("bias")
        g = use.per_example(_features_last(use.grad, affine), "output gradient")
        if traced:
            xhat = use.per_example(_features_last(xhat, affine), "input")
            eps = self.centred(use)
            if eps is not None:
                # A row of equal values (one feature, or a constant row) has x − mean = 0 and x̂ = 0
                # exactly, which the forward rounds (and 1/√ε amplifies): 0 there, with that
                # rounding of autograd's own gradient allowed by the self-check.
                x = use.per_example(_features_last(use.input, affine), "input")
                const = (x.amax(-1) == x.amin(-1)).unsqueeze(-1).to(xhat.device)  # B×R×1
                if bool(const.any()):
                    xhat = xhat.masked_fill(const, 0)
                    terms = (g.abs().to(torch.float64) * x.abs().to(torch.float64) * const).sum((0, 1))
                    rounding = cancelled_rounding(x.shape[-1], use.dtype, eps, terms)
            g = g.to(use.store)  # the weight's and the bias's backprops: one tensor, written once
            yield use.site("weight", "layernorm", {"activations": xhat.to(use.store), "backprops": g},
                           autograd_rounding=rounding)
        yield from use.bias_site(g)


class FnLayerNorm(FunctionHandler, Norm):
    """`F.layer_norm(x, shape, w, b, eps)`: x̂ is the same call without its weight and bias, and
    the product with the weight runs in the output's precision."""

    def operands(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Operands | None:
        return Operands(arg(args, kwargs, 0, "input"), {"weight": arg(args, kwargs, 2, "weight"),
                                                         "bias": arg(args, kwargs, 3, "bias")})

    def normalized(self, use: Use) -> tuple[torch.Tensor, torch.dtype]:
        assert use.call is not None and use.out_dtype is not None  # a use of a function handler is a call
        return use.call.without_affine(2), use.out_dtype

    def centred(self, use: Use) -> float | None:
        assert use.call is not None
        eps = use.call.arg(4, "eps")
        return 1e-5 if eps is None else float(eps)


class FnRmsNorm(FnLayerNorm):
    """`F.rms_norm(x, shape, w, eps)`."""

    def centred(self, use: Use) -> float | None:
        return None  # x / rms(x) is ±1 on a row of equal values, not 0

    def operands(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Operands | None:
        return Operands(arg(args, kwargs, 0, "input"), {"weight": arg(args, kwargs, 2, "weight")})


def _hf_rmsnorm(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None),
                                                                    torch.nn.Parameter) and (
        hasattr(module, "eps") or hasattr(module, "variance_epsilon"))


_norm = base.declarable(Norm())
base.builtin(torch.nn.LayerNorm, _norm)
if hasattr(torch.nn, "RMSNorm"):
    base.builtin(torch.nn.RMSNorm, _norm)
base.builtin_test("Hugging Face RMSNorms (a class name ending in RMSNorm, with a weight and an eps or "
             "variance_epsilon)", _hf_rmsnorm, _norm)
base.builtin_function("F.layer_norm", F.layer_norm, FnLayerNorm())
if hasattr(F, "rms_norm"):
    base.builtin_function("F.rms_norm", F.rms_norm, FnRmsNorm())
