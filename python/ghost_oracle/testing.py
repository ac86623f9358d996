"""Test helpers and pytest fixtures for a DP library's own test suite: tiny tied language models
(GPT-2, Llama, Qwen3, Gemma 3) with a batch, a per-example loss, and their exact per-example
gradient norms by an autograd loop (each example's loss differentiated alone).

Installed with the package, `ghost_oracle.pytest_plugin` is a pytest plugin (the `pytest11`
entry point) whose fixtures build these: a test asks for `tied_gpt2`, `tied_llama`,
`tied_qwen3` or `tied_gemma3` and gets a `TiedCase`, with no model-building code of its own:

    from ghost_oracle.torch import assert_norms

    def test_my_clipper(tied_llama):
        m = tied_llama
        norms = my_clipper_norms(m.model, m.loss, m.ids)
        assert_norms(m.model, m.loss, m.ids, claimed_norms=norms, max_grad_norm=m.c)

The models are built by Hugging Face's own classes with seeded weights drawn large enough that
every path, and the tied head's share of the embedding's gradient, carries signal. GPT-2 is in
float32 and in training mode (Opacus records activations only there; its dropout is 0); the
others are float64 in eval mode.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TiedCase", "causal_lm_loss", "exact_norms", "gpt2", "gpt2_ids", "gpt2_loss", "llama", "llama_ids",
           "llama_loss", "positions", "qwen3", "gemma3", "lm_ids", "lm_loss", "tied_case"]


def causal_lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of each example's next-token predictions: tensor[B]."""
    losses = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                               ids[:, 1:].reshape(-1), reduction="none")
    return losses.view(ids.shape[0], -1).mean(1)


def exact_norms(model: torch.nn.Module, per_example_loss: Callable[[torch.nn.Module, Any], torch.Tensor],
                inputs: Any) -> torch.Tensor:
    """‖∇θ loss_i‖ over the trainable parameters for every example, float64: the batch's losses
    computed once and each example's loss differentiated alone (a tied parameter's uses add up
    in its one gradient, cross term included)."""
    params = [p for p in model.parameters() if p.requires_grad]
    losses = per_example_loss(model, inputs)
    out = []
    for i in range(losses.shape[0]):
        grads = torch.autograd.grad(losses[i], params, retain_graph=True, allow_unused=True)
        out.append(math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads if g is not None)))
    return torch.tensor(out, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# A one-layer tied GPT-2: B = 4, T = 12, V = 19.

GPT2_B, GPT2_T, GPT2_V = 4, 12, 19
# The fixture models' attention: the eager implementation. transformers takes it through a
# config's **kwargs, which its typed signatures do not list.
_EAGER: dict[str, Any] = {"attn_implementation": "eager"}


def gpt2(dtype: torch.dtype = torch.float32, vocab: int = GPT2_V, seed: int = 11) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=16, n_embd=12, n_layer=1, n_head=3, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **_EAGER)
    lm = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if ".ln_" in name or "ln_f" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.4 * torch.randn_like(p))
    assert lm.lm_head.weight is lm.transformer.wte.weight
    model: torch.nn.Module = lm
    # Opacus records activations only in training mode; dropout is 0, so train == eval.
    return model.to(dtype).train()


def gpt2_ids() -> torch.Tensor:
    torch.manual_seed(12)
    ids = torch.randint(0, GPT2_V, (GPT2_B, GPT2_T))
    ids[:, 3] = ids[:, 1]  # a repeated token
    return ids


def positions(ids: torch.Tensor) -> torch.Tensor:
    """Explicit B×T position ids: with the default 1×T, Opacus sums wpe's grad_sample over the
    batch and its ghost clipping crashes."""
    return torch.arange(ids.shape[1]).repeat(ids.shape[0], 1)


def gpt2_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return causal_lm_loss(model(ids, position_ids=positions(ids)).logits, ids)


def _stock(cls: Any, cfg: Any, seed: int = 3) -> torch.nn.Module:
    """A Hugging Face model in float64, eval mode, its weights redrawn from a seeded generator:
    norms' weights around their initial value, every other weight at scale 0.35."""
    torch.manual_seed(seed)
    model: torch.nn.Module = cls(cfg).to(torch.float64).eval()
    g = torch.Generator().manual_seed(seed + 4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(p + 0.1 * r if "norm" in name else 0.35 * r)
    return model


# ---------------------------------------------------------------------------------------------
# A two-layer tied Llama in float64 (GQA), B = 3, T = 9, V = 48.

LLAMA_B, LLAMA_T, LLAMA_V = 3, 9, 48


def llama() -> torch.nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=LLAMA_V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                   tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, **_EAGER)
    model = _stock(transformers.LlamaForCausalLM, cfg)
    lm: Any = model
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    return model


def _ids_with_a_repeat(low: int, vocab: int, b: int, t: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(low, vocab, (b, t), generator=g)
    ids[:, 4] = ids[:, 1]  # a repeated token
    return ids


def llama_ids() -> torch.Tensor:
    return _ids_with_a_repeat(0, LLAMA_V, LLAMA_B, LLAMA_T)


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss of each example of a causal LM (Llama, Qwen3, Gemma 3)."""
    return causal_lm_loss(model(ids).logits, ids)


llama_loss = lm_loss


# ---------------------------------------------------------------------------------------------
# Stock Qwen3 and Gemma 3 (per-head q/k norms; Gemma's scaled embedding and (1 + w) norms,
# sliding and full attention), float64, B = 3, T = 7, V = 48.

LM_B, LM_T, LM_V = 3, 7, 48
_LAYERS: dict[str, Any] = dict(max_position_embeddings=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
               vocab_size=LM_V, attn_implementation="eager", bos_token_id=0, eos_token_id=0, pad_token_id=0)


def qwen3() -> torch.nn.Module:
    import transformers

    return _stock(transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
        num_attention_heads=4, num_key_value_heads=2, head_dim=4, tie_word_embeddings=True, **_LAYERS))


def gemma3() -> torch.nn.Module:
    import transformers

    return _stock(transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True, **_LAYERS))


def lm_ids() -> torch.Tensor:
    return _ids_with_a_repeat(1, LM_V, LM_B, LM_T)


# ---------------------------------------------------------------------------------------------
# The cases and their fixtures.


@dataclass
class TiedCase:
    """A tied model with its batch, its per-example loss, the exact norms (`exact`, float64), C
    at 0.8 × their median (`c`: most examples are clipped), the tied parameter's name (`tied`)
    and the (embedding, head) names that untie it (`untie`)."""

    model: torch.nn.Module
    ids: torch.Tensor
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    exact: torch.Tensor
    c: float
    tied: str
    untie: tuple[str, str]


def tied_case(model: torch.nn.Module, ids: torch.Tensor, loss: Callable[[torch.nn.Module, Any], torch.Tensor],
              tied: str) -> TiedCase:
    exact = exact_norms(model, loss, ids)
    return TiedCase(model=model, ids=ids, loss=loss, exact=exact, c=float(exact.median()) * 0.8, tied=tied,
                    untie=(tied, "lm_head.weight"))
