#!/usr/bin/env python3
"""Three Opacus 1.6 bugs its own tests miss, reproduced on the models that show them, each with
what the oracle says of the same model (docs/results.md, "Opacus bugs found by the peer suite").

    pip install ./python opacus
    python3 python/scripts/opacus_bugs.py
"""
import copy
import warnings

import torch
from opacus import GradSampleModule
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.layers import DPMultiheadAttention

import ghost_oracle.opacus
from ghost_oracle.torch import assert_norms

B = 4


class Embed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(13, 4)

    def forward(self, x):
        return torch.tanh(self.emb(x))


class Dense(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 5)

    def forward(self, x):
        return torch.tanh(self.fc(x))


def ghost(model, batch_first):
    return GradSampleModuleFastGradientClipping(copy.deepcopy(model), batch_first=batch_first, max_grad_norm=1.0,
                                                use_ghost_clipping=True, loss_reduction="sum")


def attempt(what, f):
    try:
        return f()
    except Exception as e:  # noqa: BLE001 (the bug is the exception)
        print(f"  {what}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        return None


def main():
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)

    print("1. ghost mode, an Embedding fed seq-first ids (batch_first=False):")
    model, x = Embed().double(), torch.randint(0, 13, (5, B))

    def loss(m, ids):
        return (m(ids) ** 2).sum((0, 2))

    attempt("Opacus ghost mode", lambda: ghost_oracle.opacus.norms(ghost(model, False), loss, x))
    hooks = ghost_oracle.opacus.norms(GradSampleModule(copy.deepcopy(model), batch_first=False,
                                                       loss_reduction="sum"), loss, x)
    report = assert_norms(model, loss, x, hooks, max_grad_norm=float(hooks.median()), batch_axis=1)
    print(f"  oracle on Opacus's hooks-mode norms of the same model (batch_axis=1): {report.verdict}")

    print("2. ghost mode, a Linear on 4-D input (B×2×3×6):")
    model, x = Dense().double(), torch.randn(B, 2, 3, 6, dtype=torch.float64)

    def loss4(m, v):
        return (m(v) ** 2).flatten(1).sum(1)

    gsm = ghost(model, True)
    attempt("Opacus ghost mode, first batch", lambda: ghost_oracle.opacus.norms(gsm, loss4, x))
    attempt("Opacus ghost mode, next batch", lambda: ghost_oracle.opacus.norms(gsm, loss4, x))
    hooks = ghost_oracle.opacus.norms(GradSampleModule(copy.deepcopy(model), loss_reduction="sum"), loss4, x)
    report = assert_norms(model, loss4, x, hooks, max_grad_norm=float(hooks.median()))
    print(f"  oracle on Opacus's hooks-mode norms of the same model: {report.verdict}")

    print("3. DPMultiheadAttention(batch_first=True) with a T×T causal mask:")
    attn = DPMultiheadAttention(8, 2, batch_first=True)
    mask = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
    attempt(f"B = {B}, T = 5", lambda: attn(*[torch.randn(B, 5, 8)] * 3, attn_mask=mask))
    out = attempt("B = T = 5", lambda: attn(*[torch.randn(5, 5, 8)] * 3, attn_mask=mask))
    if out is not None:
        print("  B = T = 5: runs (the mask is checked against the batch size, not the sequence length)")
    print("  oracle: nothing to judge; the model does not run at B != T")


if __name__ == "__main__":
    main()
