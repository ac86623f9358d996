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


# ---------------------------------------------------------------------------------------------
# A one-layer tied GPT-2 (python/scripts/audit_opacus_example.py's): B = 4, T = 12, V = 19.

B, T, V = 4, 12, 19


def gpt2(dtype=torch.float32, vocab=V, seed=11):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=16, n_embd=12, n_layer=1, n_head=3, bos_token_id=0,
                                  eos_token_id=0, attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name or "ln_f" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.4 * torch.randn_like(p))
    assert model.lm_head.weight is model.transformer.wte.weight
    # Opacus records activations only in training mode; dropout is 0, so train == eval.
    return model.to(dtype).train()


def gpt2_ids():
    torch.manual_seed(12)
    ids = torch.randint(0, V, (B, T))
    ids[:, 3] = ids[:, 1]  # a repeated token
    return ids


def positions(ids):
    # Explicit B×T position ids: with the default 1×T, Opacus sums wpe's grad_sample over the
    # batch and its ghost clipping crashes.
    return torch.arange(ids.shape[1]).repeat(ids.shape[0], 1)


def causal_lm_loss(logits, ids):
    """Mean cross entropy of each example's next-token predictions: tensor[B]."""
    losses = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                               ids[:, 1:].reshape(-1), reduction="none")
    return losses.view(ids.shape[0], -1).mean(1)


def gpt2_loss(model, ids):
    return causal_lm_loss(model(ids, position_ids=positions(ids)).logits, ids)


# ---------------------------------------------------------------------------------------------
# A tiny tied Llama (HF LlamaForCausalLM) in float64, as Hugging Face computes it (its RMSNorms
# compute x̂ in float32: the exporter records the x̂ they used).


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


LB, LT, LV = 3, 9, 48


def llama():
    cfg = transformers.LlamaConfig(vocab_size=LV, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                   tie_word_embeddings=True, attn_implementation="eager", bos_token_id=0,
                                   eos_token_id=0)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float64).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(1.0 + 0.1 * r if "norm" in name else 0.35 * r)
    return model


def llama_ids():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, LV, (LB, LT), generator=g)
    ids[:, 4] = ids[:, 1]  # a repeated token
    return ids


def llama_loss(model, ids):
    return causal_lm_loss(model(ids).logits, ids)


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


def tied_case(model, ids, loss, tied):
    """A tied model with its batch, loss and exact torch.func norms; C at 0.8 × their median."""
    exact = func_norms(model, loss, ids)
    return types.SimpleNamespace(model=model, ids=ids, loss=loss, exact=exact,
                                 c=float(exact.median()) * 0.8, tied=tied,
                                 untie=(tied, "lm_head.weight"))


@pytest.fixture(scope="session")
def tied_gpt2():
    return tied_case(gpt2(), gpt2_ids(), gpt2_loss, "transformer.wte.weight")


@pytest.fixture(scope="session")
def tied_llama():
    return tied_case(llama(), llama_ids(), llama_loss, "model.embed_tokens.weight")


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
