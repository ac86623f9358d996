#!/usr/bin/env python3
"""Traces of tiny random Hugging Face models of eight families, with exact per-example norms as
the claim: `ghost-oracle check --gate` must pass every one of them.

For each family (GPT-2, GPT-Neo, GPT-NeoX, Phi, OPT, Llama, Qwen2, Gemma; the embedding tied to
the head where the family ties it, and for Qwen2 as its small checkpoints do) a model with
vocab 64, hidden 16, 2 layers, in float64, weights drawn large enough that the tied cross
term is a visible part of the norm; a batch B = 3, T = 7 with a repeated token. The claim is
the exact per-example norm from torch.func (vmap over grad of each example's own loss, the same
loss whose backprops the trace holds). export_trace.py checks each trace against autograd before
writing it.

    pip install torch transformers safetensors
    python3 oracles/python/make_family_traces.py
    cargo run --release -- check oracles/golden/traces/families/llama.safetensors --gate
"""
import copy
import os
import sys
import types
import warnings

import torch
import transformers
from torch.func import functional_call, grad, vmap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from export_trace import export_trace  # noqa: E402

warnings.filterwarnings("ignore")
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "golden", "traces", "families")
B, T, V, D, FF, L = 3, 7, 64, 16, 32, 2
COMMON = dict(vocab_size=V, attn_implementation="eager", bos_token_id=0, eos_token_id=0)


def configs():
    """family -> (model class, config)."""
    t = transformers
    return {
        "gpt2": (t.GPT2LMHeadModel, t.GPT2Config(
            n_positions=16, n_embd=D, n_inner=FF, n_layer=L, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, tie_word_embeddings=True, **COMMON)),
        "gpt_neo": (t.GPTNeoForCausalLM, t.GPTNeoConfig(
            max_position_embeddings=16, hidden_size=D, intermediate_size=FF, num_layers=L, num_heads=2,
            attention_types=[[["global", "local"], 1]], window_size=4, embed_dropout=0.0,
            attention_dropout=0.0, resid_dropout=0.0, tie_word_embeddings=True, **COMMON)),
        "gpt_neox": (t.GPTNeoXForCausalLM, t.GPTNeoXConfig(
            max_position_embeddings=16, hidden_size=D, intermediate_size=FF, num_hidden_layers=L,
            num_attention_heads=2, hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False,
            **COMMON)),
        "phi": (t.PhiForCausalLM, t.PhiConfig(
            max_position_embeddings=16, hidden_size=D, intermediate_size=FF, num_hidden_layers=L,
            num_attention_heads=2, partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0,
            attention_dropout=0.0, tie_word_embeddings=False, **COMMON)),
        "opt": (t.OPTForCausalLM, t.OPTConfig(
            max_position_embeddings=16, hidden_size=D, word_embed_proj_dim=D, ffn_dim=FF, num_hidden_layers=L,
            num_attention_heads=2, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
            pad_token_id=1, tie_word_embeddings=True, **COMMON)),
        "llama": (t.LlamaForCausalLM, t.LlamaConfig(
            max_position_embeddings=16, hidden_size=D, intermediate_size=FF, num_hidden_layers=L,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, **COMMON)),
        "qwen2": (t.Qwen2ForCausalLM, t.Qwen2Config(
            max_position_embeddings=16, hidden_size=D, intermediate_size=FF, num_hidden_layers=L,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **COMMON)),
        "gemma": (t.GemmaForCausalLM, t.GemmaConfig(
            max_position_embeddings=16, hidden_size=D, intermediate_size=FF, num_hidden_layers=L,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, pad_token_id=0,
            tie_word_embeddings=True, **COMMON)),
    }


def _rms_forms(module):
    """Which function of x̂ = x / rms(x) and w a class's own forward computes: 'w' (x̂ ⊙ w, Llama)
    or '1+w' (x̂ ⊙ (1 + w), Gemma). Decided by running the forward, not by the class name."""
    probe = copy.deepcopy(module).float()
    with torch.no_grad():
        probe.weight.copy_(0.3 * torch.randn(probe.weight.shape))
    x = torch.randn(5, module.weight.shape[0], dtype=torch.float32)
    with torch.no_grad():
        y = type(module).forward(probe, x)
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
        xhat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        w = probe.weight
        for form, want in (("w", xhat * w), ("1+w", xhat * (1 + w))):
            if torch.allclose(y, want, rtol=1e-5, atol=1e-6):
                return form
    raise RuntimeError(f"{type(module).__name__}: forward is neither x̂ ⊙ w nor x̂ ⊙ (1 + w)")


def patch_rmsnorms(model):
    """Hugging Face's RMSNorms cast to float32 inside forward even in a float64 model, which
    would make this float64 model compute its norms in float32 (and the exporter's self-check
    refuse the trace). For these float64 golden models, every RMSNorm computes in its input's
    dtype instead, in the form its class uses. Returns {class name: form}."""
    forms = {}
    for m in model.modules():
        if not type(m).__name__.endswith("RMSNorm"):
            continue
        form = forms.setdefault(type(m).__name__, _rms_forms(m))
        eps = float(getattr(m, "variance_epsilon", getattr(m, "eps", 1e-6)))

        def forward(self, x, eps=eps, form=form):
            xhat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            return xhat * (1 + self.weight if form == "1+w" else self.weight)

        m.forward = types.MethodType(forward, m)
    return forms


def randomize(model, forms):
    """Weights large enough that every path, the tied head's included, carries a visible part
    of the gradient: matrices N(0, 0.35²), biases N(0, 0.1²), norm scales 1 + N(0, 0.1²)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for mod_name, m in model.named_modules():
            cls = type(m).__name__
            for pname, p in m.named_parameters(recurse=False):
                r = torch.randn(p.shape, generator=g, dtype=torch.float64)
                if cls.endswith("RMSNorm") or isinstance(m, torch.nn.LayerNorm):
                    one = 0.0 if forms.get(cls) == "1+w" or pname == "bias" else 1.0
                    p.copy_(one + 0.1 * r)
                elif pname == "bias":
                    p.copy_(0.1 * r)
                else:
                    p.copy_(0.35 * r)


def logits_of(forward, ids):
    out = forward(ids)
    return out.logits if hasattr(out, "logits") else out[0]


def per_example_loss(forward, ids):
    """Mean causal-LM cross entropy of each example (logits at t predict ids at t + 1)."""
    logits = logits_of(forward, ids)
    losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    return losses.view(ids.shape[0], -1).mean(1)


def exact_norms(model, ids):
    """‖∇ loss_i‖ for every example: torch.func grad of each example's own loss, vmapped; a tied
    parameter is one entry of `params`, so its gradient sums both uses."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x):
        return per_example_loss(lambda i: functional_call(model, p, (i,), tie_weights=True), x.unsqueeze(0))[0]

    g = vmap(grad(loss), in_dims=(None, 0))(params, ids)
    return sum((v.reshape(ids.shape[0], -1) ** 2).sum(1) for v in g.values()).sqrt()


def build(family):
    cls, cfg = configs()[family]
    torch.manual_seed(3)
    model = cls(cfg).to(torch.float64).eval()
    forms = patch_rmsnorms(model)
    randomize(model, forms)
    return model, forms


def batch():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[:, 4] = ids[:, 1]  # a repeated token
    ids[0, 2] = 1  # OPT's padding id: that row of its table gets no gradient from the lookup
    ids[1, 3] = 0  # Gemma's
    return ids


def main():
    os.makedirs(OUT, exist_ok=True)
    ids = batch()
    for family in configs():
        model, forms = build(family)
        norms = exact_norms(model, ids)
        c = float(norms.median()) * 0.8
        path = os.path.join(OUT, f"{family}.safetensors")
        specs = export_trace(model, lambda m, x: per_example_loss(m, x), ids, path, claimed_norms=norms,
                             max_grad_norm=c, clipper=f"torch.func-exact-{family}")
        tied = {s["param"] for s in specs if sum(t["param"] == s["param"] for t in specs) > 1}
        print(f"{family:9s} {os.path.getsize(path) / 1024:6.1f} KB  {len(specs)} sites  tied {sorted(tied)}  "
              f"rmsnorm forms {forms}  norms {[round(float(n), 4) for n in norms]}")


if __name__ == "__main__":
    main()
