#!/usr/bin/env python3
"""Audits Opacus's per-sample gradient norms on a tiny tied GPT-2 with ghost-oracle.

Writes traces into oracles/golden/traces/ (committed; the Rust tests check them):

- opacus_per_sample.safetensors: Opacus GradSampleModule (hooks) norms. Opacus adds the grad
  samples of the two uses of the tied wte, so these are exact -> `check --gate` passes.
- opacus_ghost_untied.safetensors: Opacus ghost clipping (GradSampleModuleFastGradientClipping)
  refuses the tied model ("Parameter tying is not supported with Ghost Clipping"); the usual
  workaround runs it on a copy whose head is a separate parameter, which drops the cross term
  -> flagged.
- embedding_only.safetensors: the tied wte counted by its embedding use only (fastDP's
  last-writer overwrite) -> privacy-violation.
- batch_mean_loss.safetensors: norms of the batch-mean loss -> privacy-violation.

    pip install torch transformers opacus safetensors
    python3 python/scripts/audit_opacus_example.py
    cargo run --release -- check oracles/golden/traces/opacus_per_sample.safetensors --gate
"""
import copy
import os
import warnings

import torch
from opacus import GradSampleModule
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from torch.func import functional_call, grad, vmap

from ghost_oracle.testing import gpt2, gpt2_loss  # noqa: E402
from ghost_oracle.testing import positions as gpt2_positions  # noqa: E402
from ghost_oracle.torch import export_trace  # noqa: E402

warnings.filterwarnings("ignore")
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "oracles", "golden", "traces")
B, T, V = 4, 12, 19


# The tiny tied GPT-2 of the package's test fixtures (ghost_oracle.testing), its positions and
# its per-example loss.
build, positions, per_example_loss = gpt2, gpt2_positions, gpt2_loss


def opacus_per_sample_norms(model, ids):
    m = copy.deepcopy(model)
    gsm = GradSampleModule(m, loss_reduction="sum")
    per_example_loss(gsm, ids).sum().backward()
    sq = sum((p.grad_sample.reshape(ids.shape[0], -1) ** 2).sum(1) for p in m.parameters())
    return sq.sqrt().detach()


def opacus_ghost_norms_untied(model, ids):
    m = copy.deepcopy(model)
    try:
        GradSampleModuleFastGradientClipping(m, max_grad_norm=1.0, use_ghost_clipping=True, loss_reduction="sum")
    except Exception as e:  # the tied model is refused
        print(f"Opacus ghost clipping on the tied model: {type(e).__name__}: {e}")
    m = copy.deepcopy(model)
    m.lm_head.weight = torch.nn.Parameter(m.transformer.wte.weight.detach().clone())  # untie
    gsm = GradSampleModuleFastGradientClipping(m, max_grad_norm=1.0, use_ghost_clipping=True, loss_reduction="sum")
    per_example_loss(gsm, ids).sum().backward()
    return gsm.get_norm_sample().detach()


def func_norms(model, ids, untie=False, drop_head=False, scale=1.0):
    params = {k: v.detach() for k, v in model.named_parameters()}
    if untie:
        params["lm_head.weight"] = params["transformer.wte.weight"].clone()

    def loss(p, x):
        return scale * per_example_loss(lambda i, position_ids: functional_call(
            model, p, (i,), {"position_ids": position_ids}, tie_weights=not untie), x.unsqueeze(0))[0]

    g = vmap(grad(loss), in_dims=(None, 0))(params, ids)
    sq = sum((v.reshape(ids.shape[0], -1) ** 2).sum(1)
             for k, v in g.items() if not (drop_head and k == "lm_head.weight"))
    return sq.sqrt()


def main():
    os.makedirs(OUT, exist_ok=True)
    model = build()
    torch.manual_seed(12)
    ids = torch.randint(0, V, (B, T))
    ids[:, 3] = ids[:, 1]  # a repeated token
    exact = func_norms(model, ids)
    c = float(exact.median()) * 0.8
    claims = {
        "opacus_per_sample": ("opacus-grad-sample", opacus_per_sample_norms(model, ids)),
        "opacus_ghost_untied": ("opacus-ghost-untied", opacus_ghost_norms_untied(model, ids)),
        "embedding_only": ("embedding-only", func_norms(model, ids, untie=True, drop_head=True)),
        "batch_mean_loss": ("batch-mean-loss", func_norms(model, ids, scale=1.0 / B)),
    }
    for name, (clipper, norms) in claims.items():
        path = os.path.join(OUT, f"{name}.safetensors")
        export_trace(model, per_example_loss, ids, path, claimed_norms=norms, max_grad_norm=c, clipper=clipper)
        rel = ((norms - exact).abs() / exact).max().item()
        print(f"{path}: max relative difference from torch.func exact norms {rel:.3e}")


if __name__ == "__main__":
    main()
