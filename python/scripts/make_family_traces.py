#!/usr/bin/env python3
"""Traces of tiny random Hugging Face models of thirteen families, with exact per-example norms
as the claim: `ghost-oracle check --gate` must pass every one of them.

For each family (GPT-2, GPT-Neo, GPT-NeoX, Phi, OPT, Llama, Qwen2, Gemma, and the tied models of
2025: Qwen3, Gemma 2, Gemma 3, VaultGemma, Qwen3-MoE; the embedding tied to the head where the
family ties it, and for Qwen2 as its small checkpoints do) a model with vocab 64, hidden 16, 2
layers, in float64, weights drawn large enough that the tied cross term is a visible part of the
norm; a batch B = 3, T = 7 with a repeated token. The models are stock: Hugging Face's norms,
rotary tables and eager softmax keep their float32 islands, which the exporter models (a
Gemma-family norm, which multiplies by its weight in float32, is a float32 site of an otherwise
float64 trace). The Gemma 2, Gemma 3 and VaultGemma models soft-cap their logits at caps the
tiny model reaches and attend through a sliding window shorter than T; Qwen3's and Gemma 3's
q/k norms are per-head sites (one row per position and head). Qwen3-MoE's experts are fused 3-D
tensors the exporter refuses: its trace is of the dense parts, with the experts and the router
frozen.

The claim is the exact per-example norm from torch.func (vmap over grad of each example's own
loss, the same loss whose backprops the trace holds; for Qwen3-MoE, whose routing vmap cannot
batch, autograd of each example's loss in turn). export_trace.py checks each trace against
autograd before writing it.

    pip install torch transformers safetensors
    python3 python/scripts/make_family_traces.py
    cargo run --release -- check oracles/golden/traces/families/llama.safetensors --gate
"""
import os
import warnings

import torch
import transformers
from torch.func import functional_call, grad, vmap

from ghost_oracle.torch import export_trace  # noqa: E402

warnings.filterwarnings("ignore")
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "oracles", "golden", "traces", "families")
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
        "qwen3": (t.Qwen3ForCausalLM, t.Qwen3Config(
            max_position_embeddings=16, hidden_size=D, intermediate_size=FF, num_hidden_layers=L,
            num_attention_heads=4, num_key_value_heads=2, head_dim=4, tie_word_embeddings=True, **COMMON)),
        "gemma2": (t.Gemma2ForCausalLM, t.Gemma2Config(
            max_position_embeddings=16, hidden_size=D, intermediate_size=FF, num_hidden_layers=L,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8,
            sliding_window=4, layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0, pad_token_id=0, tie_word_embeddings=True, **COMMON)),
        "gemma3_text": (t.Gemma3ForCausalLM, t.Gemma3TextConfig(
            max_position_embeddings=16, hidden_size=D, intermediate_size=FF, num_hidden_layers=L,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8,
            sliding_window=4, layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=3.0,
            pad_token_id=0, tie_word_embeddings=True, **COMMON)),
        "vaultgemma": (t.VaultGemmaForCausalLM, t.VaultGemmaConfig(
            max_position_embeddings=16, hidden_size=D, intermediate_size=FF, num_hidden_layers=L,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8,
            sliding_window=4, layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0, pad_token_id=0, tie_word_embeddings=True, **COMMON)),
        "qwen3_moe": (t.Qwen3MoeForCausalLM, t.Qwen3MoeConfig(
            max_position_embeddings=16, hidden_size=D, intermediate_size=FF, num_hidden_layers=L,
            num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=8, mlp_only_layers=[0], experts_implementation="eager", tie_word_embeddings=True,
            **COMMON)),
    }


def randomize(model):
    """Weights large enough that every path, the tied head's included, carries a visible part
    of the gradient: matrices N(0, 0.35²), biases N(0, 0.1²), norm scales their initial value
    (1 for x̂ ⊙ w, 0 for Gemma's x̂ ⊙ (1 + w)) + N(0, 0.1²). Frozen parameters stay frozen and
    are drawn all the same."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in model.modules():
            norm = type(m).__name__.endswith("RMSNorm") or isinstance(m, torch.nn.LayerNorm)
            for pname, p in m.named_parameters(recurse=False):
                r = torch.randn(p.shape, generator=g, dtype=torch.float64)
                if norm:
                    p.copy_(p + 0.1 * r)
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


def exact_norms(model, ids, batched=True):
    """‖∇ loss_i‖ for every example over the trainable parameters: torch.func grad of each
    example's own loss, vmapped (a tied parameter is one entry of `params`, so its gradient sums
    both uses); with `batched=False`, autograd of each example's loss in turn."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    if not batched:
        trainable = [p for p in model.parameters() if p.requires_grad]
        out = []
        for i in range(ids.shape[0]):
            gs = torch.autograd.grad(per_example_loss(model, ids[i:i + 1])[0], trainable)
            out.append(sum((g.double() ** 2).sum() for g in gs).sqrt())
        return torch.stack(out)

    def loss(p, x):
        return per_example_loss(lambda i: functional_call(model, p, (i,), tie_weights=True), x.unsqueeze(0))[0]

    g = vmap(grad(loss), in_dims=(None, 0))(params, ids)
    return sum((v.reshape(ids.shape[0], -1) ** 2).sum(1) for v in g.values()).sqrt()


def build(family):
    cls, cfg = configs()[family]
    torch.manual_seed(3)
    model = cls(cfg).to(torch.float64).eval()
    randomize(model)
    if family == "qwen3_moe":
        for name, p in model.named_parameters():
            if ".mlp.experts." in name or ".mlp.gate." in name:
                p.requires_grad_(False)
    return model


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
        model = build(family)
        norms = exact_norms(model, ids, batched=family != "qwen3_moe")
        c = float(norms.median()) * 0.8
        path = os.path.join(OUT, f"{family}.safetensors")
        specs = export_trace(model, lambda m, x: per_example_loss(m, x), ids, path, claimed_norms=norms,
                             max_grad_norm=c, clipper=f"torch.func-exact-{family}")
        tied = {s["param"] for s in specs if sum(t["param"] == s["param"] for t in specs) > 1}
        f32 = [s["name"] for s in specs if s.get("compute_dtype") == "f32"]
        print(f"{family:10s} {os.path.getsize(path) / 1024:6.1f} KB  {len(specs)} sites  tied {sorted(tied)}  "
              f"f32 sites {len(f32)}  norms {[round(float(n), 4) for n in norms]}")


if __name__ == "__main__":
    main()
