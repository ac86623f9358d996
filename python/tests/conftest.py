"""Tiny tied models, their per-example losses, and exact and wrong per-example norms.

    pip install ./python pytest torch transformers opacus
    pytest python/tests
"""
import copy
import os
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "oracles" / "golden" / "traces"

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from torch.func import functional_call, grad, vmap  # noqa: E402


def pytest_configure(config):
    # Opacus's full backward hooks on models whose inputs are token ids: nothing to act on.
    config.addinivalue_line("filterwarnings", "ignore:Full backward hook is firing:UserWarning")


# The tiny tied models, their batches and losses, and the fixtures tied_gpt2 and tied_llama:
# ghost_oracle.testing (a pytest plugin once the package is installed; imported here too, so
# that the tests also run against a source checkout).
from ghost_oracle.pytest_plugin import tied_gemma3, tied_gpt2, tied_llama, tied_qwen3
from ghost_oracle.testing import GPT2_B as B
from ghost_oracle.testing import GPT2_T as T
from ghost_oracle.testing import GPT2_V as V
from ghost_oracle.testing import LLAMA_B as LB
from ghost_oracle.testing import LLAMA_T as LT
from ghost_oracle.testing import LLAMA_V as LV
from ghost_oracle.testing import causal_lm_loss, gpt2, gpt2_ids, gpt2_loss, llama, llama_ids, llama_loss, positions


def llama_rmsnorm_in_input_dtype(model):
    """Hugging Face's LlamaRMSNorm computes x̂ in float32 even in a float64 model. For a ground
    truth computed in float64 throughout (a float64 copy of a float32 model), every RMSNorm of
    `model` computes x̂ ⊙ w in its input's dtype instead. The exporter needs no such patch: it
    records the x̂ a norm really used."""
    for m in model.modules():
        if type(m).__name__ == "LlamaRMSNorm":
            eps = float(m.variance_epsilon)

            def forward(self, x, eps=eps):
                return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.weight

            m.forward = types.MethodType(forward, m)
    return model


# ---------------------------------------------------------------------------------------------
# Per-example norms by torch.func: exact, and with the tied cross term dropped.


def func_norms(model, loss, ids, untie=None):
    """‖∇ loss_i‖ per example: grad of each example's own loss, vmapped over the batch. With
    `untie=(embedding name, head name)` the head gets its own copy of the tied tensor, so the two
    uses' gradients are separate parameters: their squared norms add and the cross term is lost
    (what ghost clipping of an untied copy computes)."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    if untie:
        emb, head = untie
        params[head] = params[emb].clone()

    def one(p, x):
        return loss(lambda i, **kw: functional_call(model, p, (i,), kw, tie_weights=not untie), x.unsqueeze(0))[0]

    g = vmap(grad(one), in_dims=(None, 0))(params, ids)
    return sum((v.reshape(ids.shape[0], -1) ** 2).sum(1) for v in g.values()).sqrt().detach()


def untied_copy(model, emb, head):
    """The usual workaround for Opacus ghost clipping: the head a separate copy of the
    embedding (the function is the same; the tying is gone)."""
    m = copy.deepcopy(model)
    parent = m.get_submodule(head.rsplit(".", 1)[0])
    parent.weight = torch.nn.Parameter(m.get_parameter(emb).detach().clone())
    return m


@pytest.fixture
def tmp_trace(tmp_path):
    return os.fspath(tmp_path / "trace.safetensors")
