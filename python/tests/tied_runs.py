"""Runs of the tied ghost-clipping plug-in (`ghost_oracle.opacus.make_private`) for the tests,
and the truth they are held to, computed independently: an autograd loop over the examples."""
import copy
import math
import types
import warnings
from dataclasses import dataclass

import torch
from opacus import PrivacyEngine

import ghost_oracle.opacus as dpo

STABILIZER = 1e-6  # Opacus's γ in min(1, C / (n + γ))


def rmsnorms_in_input_dtype(model):
    """Hugging Face's Llama, Qwen3 and Gemma 3 RMSNorms compute in float32 whatever the model's
    dtype, so a "float64" model's per-example gradients are float32-accurate and the batch's
    backward pass (gradients scaled by 1/B, by the clip factors) rounds differently from an
    example's own (~1e-7). For a float64 ground truth, every such norm of `model` computes in its
    input's dtype instead: x̂ ⊙ w (Llama, Qwen3) or x̂ ⊙ (1 + w) (Gemma 3)."""
    for m in model.modules():
        name = type(m).__name__
        if name in ("LlamaRMSNorm", "Qwen3RMSNorm"):
            def forward(self, x):
                return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * self.weight
        elif name == "Gemma3RMSNorm":
            def forward(self, x):
                return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)
        else:
            continue
        m.forward = types.MethodType(forward, m)
    return model


class PerExampleLoss(torch.nn.Module):
    """The criterion handed to make_private: its input is already the B per-example losses."""

    def __init__(self, reduction):
        super().__init__()
        self.reduction = reduction

    def forward(self, losses):
        if self.reduction == "none":
            return losses
        return losses.mean() if self.reduction == "mean" else losses.sum()


@dataclass
class PluginStep:
    norms: torch.Tensor  # float64, over the logical batch
    update: dict
    clipped_sum: dict
    batch_divisor: float
    inputs: list
    gsm: object


def plugin_step(model, loss, inputs, *, c, sigma, reduction="mean", seed=0, wrap_model=True):
    """One DP-SGD step of the plug-in on a copy of `model`: one `backward()` per micro-batch in
    `inputs` (a list, or one batch), then `optimizer.pre_step()` (clip sum, noise, division)."""
    mbs = inputs if isinstance(inputs, list) else [inputs]
    total = sum(len(mb) for mb in mbs)
    module = copy.deepcopy(model)
    module.zero_grad(set_to_none=True)
    sgd = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=1.0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(total)), batch_size=total)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        gsm, optimizer, criterion, _ = dpo.make_private(
            PrivacyEngine(secure_mode=False), module=module, optimizer=sgd, criterion=PerExampleLoss(reduction),
            data_loader=loader, noise_multiplier=float(sigma), max_grad_norm=float(c), loss_reduction=reduction,
            poisson_sampling=False, noise_generator=torch.Generator().manual_seed(seed), grad_sample_mode="ghost",
            wrap_model=wrap_model)
    runner = gsm if wrap_model else module
    norms = []
    optimizer.zero_grad(set_to_none=True)
    for mb in mbs:
        criterion(loss(runner, mb)).backward()
        norms.append(gsm.per_sample_gradient_norms.detach().double())
    assert optimizer.pre_step()
    names = {n: p for n, p in module.named_parameters() if p.requires_grad}
    update = {n: p.grad.detach().clone() for n, p in names.items()}
    clipped = {n: p.summed_grad.detach().clone() for n, p in names.items()}
    return PluginStep(norms=torch.cat(norms), update=update, clipped_sum=clipped,
                      batch_divisor=float(optimizer.expected_batch_size), inputs=mbs, gsm=gsm)


def plugin_norms(model, loss, ids, *, reduction="mean", wrap_model=True):
    """The norms the plug-in clips by on one batch (C huge: nothing is clipped)."""
    return plugin_step(model, loss, ids, c=1e30, sigma=0.0, reduction=reduction, wrap_model=wrap_model).norms


def loop_clipped_sum(model, loss, inputs, c):
    """Σ_i min(1, C / (n_i + γ)) g_i by an autograd loop (each example's loss differentiated
    alone), float64, with the loop's norms.

    c_i g_i is taken as the gradient of c_i · loss_i, as the plug-in's second pass takes it: the
    Hugging Face RMSNorms compute in float32 inside a float64 model, and scaling before or after
    their backward rounds differently (~1e-7)."""
    mbs = inputs if isinstance(inputs, list) else [inputs]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    total = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in named}
    norms = []
    for mb in mbs:
        losses = loss(model, mb)
        for i in range(losses.shape[0]):
            grads = torch.autograd.grad(losses[i], [p for _, p in named], retain_graph=True, allow_unused=True)
            grads = [torch.zeros(p.shape, dtype=torch.float64) if g is None else g.double()
                     for (_, p), g in zip(named, grads, strict=True)]
            n = math.sqrt(sum(float((g ** 2).sum()) for g in grads))
            norms.append(n)
            coef = min(1.0, c / (n + STABILIZER))
            scaled = torch.autograd.grad(coef * losses[i], [p for _, p in named], retain_graph=True,
                                         allow_unused=True)
            for (name, _), g in zip(named, scaled, strict=True):
                if g is not None:
                    total[name] += g.double()
    return total, torch.tensor(norms, dtype=torch.float64)


def max_rel(a: dict, b: dict) -> float:
    """The largest ‖a − b‖ / ‖b‖ over the parameters."""
    return max(float((a[k].double() - b[k]).norm() / b[k].norm()) for k in b)
