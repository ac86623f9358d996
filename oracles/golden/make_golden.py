#!/usr/bin/env python3
"""Regenerates the PyTorch golden files the reference is tested against.

Each case is a directory with an HF checkpoint (config.json + model.safetensors, written by
save_pretrained or, for the original hub naming, by safetensors directly), a batch file and
expected.json: per-example norms, per-parameter norms and the tied split, computed in float64
with torch.func (vmap over grad of each example's own loss).

    pip install torch transformers safetensors
    python3 oracles/golden/make_golden.py             # rewrites oracles/golden/cases/*
    python3 oracles/golden/make_golden.py llama qwen2  # only the cases whose name starts so
    python3 oracles/golden/make_golden.py --out DIR    # writes elsewhere, e.g. to compare

Weights are drawn larger than HF's init (std `init_std` instead of 0.02) so that the tied cross
term is a visible part of the norm; LayerNorm / RMSNorm parameters are randomized too.

Every case runs the same way (`run_case`): the family's model class (`FAMILIES`: GPT2LMHeadModel,
LlamaForCausalLM, Qwen2/3ForCausalLM, the Gemmas' and VaultGemma's) built by `build`, its
gradients taken by `per_example_loss`. HF's RMSNorm families compute three things in float32 even
in a float64 model: RMSNorm (`hidden_states.to(torch.float32)`), the rotary inverse frequencies
and cos/sin tables (`dtype=torch.float`), and the attention softmax (`softmax(...,
dtype=torch.float32)`). Golden files at 1e-9 need the whole model in float64, so
`float64_modules()` replaces exactly those three computations by the same formulas evaluated in
the input's dtype (float64), and `use_exact_rotary()` the float32 inverse frequencies by float64
ones. GPT-2 has no such island.
"""
import argparse
import importlib
import json
import math
import os
import shutil
from dataclasses import dataclass

import torch
from safetensors.torch import save_file
from torch.func import functional_call, grad, vmap

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "cases")
IGNORE = -100


@dataclass(frozen=True)
class Family:
    """What the generator needs to know of one HF model family."""

    module: str  # transformers.models.<module>
    prefix: str  # of its module classes: <prefix>RMSNorm, <prefix>RotaryEmbedding
    config: str  # its config class
    model: str  # its causal-LM class
    embedding: str  # the token embedding's parameter name: the tied parameter
    special_token: int  # bos/eos id, unless a case sets its own
    norm_names: tuple[str, ...]  # a parameter whose name holds one of these is a norm's
    bias_std: float | None  # the projections' biases' std; None: drawn like the weights
    rms_norm: bool  # RMSNorm, rotary and eager attention with float32 islands (float64_modules)
    gemma: bool  # Gemma's conventions: RMSNorm by (1 + w), its weights around 0; the lookup times sqrt(d)


def rms_family(module, prefix, config, model, special_token, gemma):
    return Family(module, prefix, config, model, "model.embed_tokens.weight", special_token,
                  norm_names=("norm.weight",), bias_std=0.1, rms_norm=True, gemma=gemma)


# model_type: its family
FAMILIES = {
    "gpt2": Family("gpt2", "GPT2", "GPT2Config", "GPT2LMHeadModel", "transformer.wte.weight", special_token=0,
                   norm_names=(".ln_", "ln_f"), bias_std=None, rms_norm=False, gemma=False),
    "llama": rms_family("llama", "Llama", "LlamaConfig", "LlamaForCausalLM", 0, gemma=False),
    "qwen2": rms_family("qwen2", "Qwen2", "Qwen2Config", "Qwen2ForCausalLM", 0, gemma=False),
    "qwen3": rms_family("qwen3", "Qwen3", "Qwen3Config", "Qwen3ForCausalLM", 1, gemma=False),
    "gemma": rms_family("gemma", "Gemma", "GemmaConfig", "GemmaForCausalLM", 1, gemma=True),
    "gemma2": rms_family("gemma2", "Gemma2", "Gemma2Config", "Gemma2ForCausalLM", 1, gemma=True),
    "gemma3_text": rms_family("gemma3", "Gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", 1, gemma=True),
    "vaultgemma": rms_family("vaultgemma", "VaultGemma", "VaultGemmaConfig", "VaultGemmaForCausalLM", 1, gemma=True),
}

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}

# name, model_type, config overrides, init_std, batch (B, T), seed, options
CASES = [
    # GPT-2 (GPT2LMHeadModel)
    ("tied_l1_h2_t2", "gpt2", dict(vocab_size=17, n_positions=8, n_embd=8, n_layer=1, n_head=2), 0.4, (3, 2), 1, {}),
    ("tied_l2_h4_t33", "gpt2",
     dict(vocab_size=32, n_positions=40, n_embd=16, n_layer=2, n_head=4), 0.3, (2, 33), 2, {}),
    ("untied_l2_h3_t8", "gpt2",
     dict(vocab_size=24, n_positions=12, n_embd=12, n_layer=2, n_head=3, tie_word_embeddings=False),
     0.3, (3, 8), 3, {}),
    ("untied_l1_h2_t2", "gpt2",
     dict(vocab_size=19, n_positions=4, n_embd=8, n_layer=1, n_head=2, tie_word_embeddings=False), 0.4, (2, 2), 4, {}),
    ("tied_ignored_labels", "gpt2", dict(vocab_size=13, n_positions=16, n_embd=8, n_layer=2, n_head=2), 0.4, (3, 12), 5,
     {"ignore": True}),
    ("tied_sum_reduction", "gpt2", dict(vocab_size=13, n_positions=16, n_embd=8, n_layer=1, n_head=4), 0.4, (2, 10), 6,
     {"reduction": "sum"}),
    ("tied_f32_hub_names", "gpt2", dict(vocab_size=21, n_positions=16, n_embd=12, n_layer=1, n_head=3), 0.35, (2, 9), 7,
     {"dtype": "f32", "hub_names": True}),
    ("tied_bf16", "gpt2", dict(vocab_size=15, n_positions=10, n_embd=8, n_layer=1, n_head=2), 0.4, (2, 7), 8,
     {"dtype": "bf16"}),
    ("tied_f16_inverse_layer_idx", "gpt2",
     dict(vocab_size=15, n_positions=10, n_embd=8, n_layer=2, n_head=2, scale_attn_by_inverse_layer_idx=True),
     0.4, (2, 7), 9, {"dtype": "f16"}),
    # Llama and Qwen2
    ("llama_tied_gqa_t2", "llama",
     dict(vocab_size=17, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=8, tie_word_embeddings=True), 0.4, (3, 2), 21, {}),
    ("llama_tied_gqa_l2_t33", "llama",
     dict(vocab_size=32, hidden_size=16, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True), 0.3, (2, 33), 22, {}),
    ("llama_untied_mha_biases_t8", "llama",
     dict(vocab_size=24, hidden_size=12, intermediate_size=20, num_hidden_layers=2, num_attention_heads=3,
          num_key_value_heads=3, max_position_embeddings=16, tie_word_embeddings=False, attention_bias=True,
          mlp_bias=True), 0.3, (3, 8), 23, {}),
    ("llama_untied_ignored_labels_sum", "llama",
     dict(vocab_size=19, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
          num_key_value_heads=1, max_position_embeddings=16, tie_word_embeddings=False), 0.4, (3, 12), 24,
     {"ignore": True, "reduction": "sum"}),
    ("llama3_rope_tied_t40", "llama",
     dict(vocab_size=29, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rope_theta=10000.0,
          rope_scaling=LLAMA3, tie_word_embeddings=True), 0.3, (2, 40), 25, {"legacy_config": True}),
    ("llama_bf16_tied", "llama",
     dict(vocab_size=15, hidden_size=8, intermediate_size=12, num_hidden_layers=1, num_attention_heads=2,
          num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=True), 0.4, (2, 7), 26,
     {"dtype": "bf16"}),
    ("qwen2_tied_biases_t12", "qwen2",
     dict(vocab_size=21, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=1, max_position_embeddings=32, rope_theta=1000000.0, tie_word_embeddings=True),
     0.4, (3, 12), 27, {"ignore": True}),
    ("qwen2_untied_f32_t32", "qwen2",
     dict(vocab_size=20, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
          num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False), 0.4, (2, 32), 28,
     {"dtype": "f32"}),
    # Qwen3 and the Gemma family
    ("qwen3_tied_gqa_t2", "qwen3",
     dict(vocab_size=17, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
          num_key_value_heads=2, head_dim=8, max_position_embeddings=8, tie_word_embeddings=True), 0.4, (3, 2), 31, {}),
    ("qwen3_untied_bias_ignored_t33", "qwen3",
     dict(vocab_size=23, hidden_size=12, intermediate_size=20, num_hidden_layers=2, num_attention_heads=2,
          num_key_value_heads=1, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
          attention_bias=True, rope_theta=1000.0), 0.4, (2, 33), 32, {"ignore": True}),
    ("qwen3_tied_f32_t12", "qwen3",
     dict(vocab_size=19, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=1, head_dim=4, max_position_embeddings=16, tie_word_embeddings=True,
          pad_token_id=0), 0.4, (2, 12), 33, {"dtype": "f32", "pad": True}),
    ("gemma_tied_pad_t12", "gemma",
     dict(vocab_size=19, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=1, head_dim=4, max_position_embeddings=16), 0.4, (3, 12), 34, {"pad": True}),
    ("gemma_untied_t2_sum", "gemma",
     dict(vocab_size=13, hidden_size=8, intermediate_size=12, num_hidden_layers=1, num_attention_heads=2,
          num_key_value_heads=2, head_dim=4, max_position_embeddings=4, tie_word_embeddings=False), 0.4, (2, 2), 35,
     {"reduction": "sum"}),
    ("gemma2_tied_window_softcap_t34", "gemma2",
     dict(vocab_size=21, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, head_dim=8, max_position_embeddings=64, query_pre_attn_scalar=12,
          sliding_window=5, attn_logit_softcapping=2.0, final_logit_softcapping=4.0), 0.4, (2, 34), 36,
     {"pad": True}),
    ("gemma2_untied_t2", "gemma2",
     dict(vocab_size=15, hidden_size=8, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2,
          num_key_value_heads=1, head_dim=4, max_position_embeddings=8, tie_word_embeddings=False,
          query_pre_attn_scalar=4, sliding_window=1, pad_token_id=None), 0.4, (3, 2), 37, {}),
    ("gemma3_tied_window_t40", "gemma3_text",
     dict(vocab_size=29, hidden_size=16, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
          num_key_value_heads=2, head_dim=8, max_position_embeddings=64, query_pre_attn_scalar=8,
          sliding_window=6, final_logit_softcapping=5.0, attn_logit_softcapping=1.0,
          layer_types=["sliding_attention", "full_attention", "sliding_attention"],
          rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}),
     0.4, (2, 40), 38, {"ignore": True, "pad": True}),
    ("gemma3_untied_bf16_t8", "gemma3_text",
     dict(vocab_size=17, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
          num_key_value_heads=1, head_dim=4, max_position_embeddings=16, query_pre_attn_scalar=6,
          sliding_window=3, tie_word_embeddings=False,
          layer_types=["sliding_attention", "full_attention"],
          rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 500.0},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 20.0}}),
     0.4, (2, 8), 39, {"dtype": "bf16", "legacy_gemma3_config": True}),
    ("vaultgemma_tied_window_softcap_t33", "vaultgemma",
     dict(vocab_size=17, hidden_size=12, intermediate_size=20, num_hidden_layers=2, num_attention_heads=2,
          num_key_value_heads=1, head_dim=8, max_position_embeddings=64, query_pre_attn_scalar=8,
          sliding_window=4, attn_logit_softcapping=2.5, final_logit_softcapping=3.0), 0.4, (2, 33), 40,
     {"ignore": True}),
    ("vaultgemma_untied_t2", "vaultgemma",
     dict(vocab_size=11, hidden_size=8, intermediate_size=12, num_hidden_layers=1, num_attention_heads=2,
          num_key_value_heads=2, head_dim=4, max_position_embeddings=4, query_pre_attn_scalar=4,
          tie_word_embeddings=False, layer_types=["full_attention"]), 0.4, (2, 2), 41, {}),
]

DTYPES = {"f64": torch.float64, "f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def float64_modules():
    """Removes the float32 islands of the RMSNorm families (see the module docstring).

    Each replacement is HF's own forward with the float32 casts removed; nothing else changes:
    - `<Family>RMSNorm.forward`: HF computes `x.float()`; Llama, Qwen2 and Qwen3 scale by w, the
      Gemmas by (1 + w);
    - `<Family>RotaryEmbedding.forward`: HF forms the angles and cos/sin in float32 (Gemma 3's
      takes the layer type and reads that type's buffer);
    - `eager_attention_forward`: HF's softmax runs with `dtype=torch.float32`; the Gemma 2, 3 and
      VaultGemma versions soft-cap the scores before the mask (the others pass no `softcap`).
    """

    def rms_by_w(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    def rms_by_1_plus_w(self, x):
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)) * (1.0 + self.weight)

    def rotary(self, x, position_ids, layer_type=None):
        prefix = f"{layer_type}_" if layer_type is not None else ""
        inv_freq = getattr(self, prefix + "inv_freq")
        scaling = getattr(self, prefix + "attention_scaling")
        freqs = position_ids[..., None].to(x.dtype) * inv_freq.to(device=x.device, dtype=x.dtype)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * scaling, emb.sin() * scaling

    def make_eager(repeat_kv):
        def eager(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
            if scaling is None:
                scaling = module.head_dim ** -0.5
            key_states = repeat_kv(key, module.num_key_value_groups)
            value_states = repeat_kv(value, module.num_key_value_groups)
            attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
            if softcap is not None:
                attn_weights = torch.tanh(attn_weights / softcap) * softcap
            if attention_mask is not None:
                attn_weights = attn_weights + attention_mask
            attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1)
            attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
            return attn_output, attn_weights
        return eager

    for family in FAMILIES.values():
        if not family.rms_norm:
            continue
        mod = importlib.import_module(f"transformers.models.{family.module}.modeling_{family.module}")
        getattr(mod, family.prefix + "RMSNorm").forward = rms_by_1_plus_w if family.gemma else rms_by_w
        getattr(mod, family.prefix + "RotaryEmbedding").forward = rotary
        mod.eager_attention_forward = make_eager(mod.repeat_kv)


def inv_freq_f64(rope_parameters, dim):
    """HF's default and llama3 inverse frequencies (modeling_rope_utils), evaluated in float64."""
    rp = rope_parameters
    base = rp["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float64) / dim))
    if rp["rope_type"] == "default":
        return inv_freq
    assert rp["rope_type"] == "llama3", rp
    factor, low, high = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
    old_context_len = rp["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def use_exact_rotary(model):
    """Replaces the rotary embedding's float32 inverse frequencies by float64 ones: one buffer, or
    one per layer type where `rope_parameters` is keyed by layer type (Gemma 3)."""
    cfg = model.config
    rotary = model.model.rotary_emb
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rp = cfg.rope_parameters
    if "rope_type" in rp:
        buffers = {"inv_freq": rp}
    else:
        buffers = {f"{layer_type}_inv_freq": rp[layer_type] for layer_type in set(cfg.layer_types)}
    for buffer, parameters in buffers.items():
        exact = inv_freq_f64(parameters, dim)
        # Same formula as HF's float32 buffer, to float32 accuracy.
        held = getattr(rotary, buffer)
        assert torch.allclose(exact, held.to(torch.float64), rtol=1e-6, atol=0), (buffer, exact, held)
        setattr(rotary, buffer, exact)


def build(model_type, cfg_over, init_std, seed, dtype):
    family = FAMILIES[model_type]
    mod = importlib.import_module(f"transformers.models.{family.module}")
    torch.manual_seed(seed)
    over = dict(cfg_over)
    over.setdefault("bos_token_id", family.special_token)
    over.setdefault("eos_token_id", family.special_token)
    cfg = getattr(mod, family.config)(**over, attn_implementation="eager")
    model = getattr(mod, family.model)(cfg).to(torch.float64).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(n in name for n in family.norm_names):
                # A norm's weight sits around 1 (Gemma's (1 + w): around 0), its bias (LayerNorm) around 0.
                centre = 0.0 if family.gemma or not name.endswith("weight") else 1.0
                p.copy_(centre + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias") and family.bias_std is not None:
                p.copy_(family.bias_std * torch.randn_like(p))
            else:
                p.copy_(init_std * torch.randn_like(p))
            # Round through the stored dtype so the f64 model is exactly what the file holds.
            p.copy_(p.to(DTYPES[dtype]).to(torch.float64))
        if family.rms_norm:
            use_exact_rotary(model)
        if family.gemma:
            # Gemma multiplies the lookup by sqrt(d), which must be float64 too.
            scale = model.model.embed_tokens.embed_scale
            assert scale.dtype == torch.float64 and float(scale) == cfg.hidden_size ** 0.5, scale
    return model


def batch_for(cfg, shape, seed, ignore):
    g = torch.Generator().manual_seed(100 + seed)
    b, t = shape
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    # Make repeats certain: position 3 repeats position 1, and a target also occurs as an input.
    if t > 3:
        ids[:, 3] = ids[:, 1]
    labels = ids.clone()
    if ignore:
        mask = torch.rand((b, t), generator=g) < 0.35
        mask[:, 1] = False  # every example keeps at least one target
        labels[mask] = IGNORE
    return ids, labels


def per_example_loss(model, params, ids, labels, reduction, tie):
    logits = functional_call(model, params, (ids.unsqueeze(0),), tie_weights=tie).logits[0]
    lg, tg = logits[:-1], labels[1:]
    keep = tg != IGNORE
    losses = torch.nn.functional.cross_entropy(lg, tg.clamp(min=0), reduction="none")
    total = (losses * keep).sum()
    return total / keep.sum() if reduction == "mean" else total


def legacy_rope_config(cfg):
    """A transformers-5 config.json (`rope_parameters`) in the transformers-4 layout (`rope_theta`
    + `rope_scaling`) that hub checkpoints such as Llama 3.2 carry."""
    rp = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rp.pop("rope_theta")
    cfg["rope_scaling"] = rp if rp.get("rope_type", "default") != "default" else None


def legacy_gemma3_config(cfg):
    """Gemma 3's per-layer-type `rope_parameters` in the layout of the hub's Gemma 3 configs:
    `rope_theta`, `rope_scaling` null and `rope_local_base_freq`."""
    rp = cfg.pop("rope_parameters")
    assert rp["full_attention"]["rope_type"] == "default"
    cfg["rope_theta"] = rp["full_attention"]["rope_theta"]
    cfg["rope_local_base_freq"] = rp["sliding_attention"]["rope_theta"]
    cfg["rope_scaling"] = None


# option: how it rewrites the saved config.json
CONFIG_LAYOUTS = {"legacy_config": legacy_rope_config, "legacy_gemma3_config": legacy_gemma3_config}


def run_case(name, model_type, cfg_over, init_std, shape, seed, opts):
    dtype = opts.get("dtype", "f64")
    reduction = opts.get("reduction", "mean")
    model = build(model_type, cfg_over, init_std, seed, dtype)
    cfg = model.config
    ids, labels = batch_for(cfg, shape, seed, opts.get("ignore", False))
    if opts.get("pad"):
        # The padding token as an input, twice, so that its row's missing gradient shows.
        assert cfg.pad_token_id is not None
        ids[:, 2] = cfg.pad_token_id
        ids[0, -1] = cfg.pad_token_id
        keep = labels != IGNORE
        labels = ids.clone()
        labels[~keep] = IGNORE
    tied = cfg.tie_word_embeddings
    emb = FAMILIES[model_type].embedding
    # The original hub files name GPT-2's tensors without `transformer.`.
    hub_names = opts.get("hub_names", False)

    def saved_name(k):
        return k[len("transformer."):] if hub_names and k.startswith("transformer.") else k

    params = {k: v.detach() for k, v in model.named_parameters()}
    assert ("lm_head.weight" in params) != tied, list(params)
    def f(p, x, y):
        return per_example_loss(model, p, x, y, reduction, True)
    grads = vmap(grad(f), in_dims=(None, 0, 0))(params, ids, labels)
    losses = vmap(f, in_dims=(None, 0, 0))(params, ids, labels)

    split = None
    if tied:
        # Untie for the split: the embedding and the head get separate copies of the table.
        p2 = dict(params)
        p2["lm_head.weight"] = params[emb].clone()
        def f2(p, x, y):
            return per_example_loss(model, p, x, y, reduction, False)
        g2 = vmap(grad(f2), in_dims=(None, 0, 0))(p2, ids, labels)
        split = (g2[emb], g2["lm_head.weight"])
        # The split adds up to the tied gradient.
        assert torch.allclose(split[0] + split[1], grads[emb], rtol=1e-10, atol=1e-13)

    examples = []
    for i in range(shape[0]):
        pnorms = {saved_name(k): float((g[i] ** 2).sum()) ** 0.5 for k, g in grads.items()}
        total = sum(float((g[i] ** 2).sum()) for g in grads.values())
        ex = {"loss": float(losses[i]), "norm": total ** 0.5, "params": pnorms, "shared": {}}
        if split is not None:
            gi, go = split[0][i], split[1][i]
            ex["shared"][saved_name(emb)] = {
                "input_sq": float((gi ** 2).sum()),
                "output_sq": float((go ** 2).sum()),
                "cross": float((gi * go).sum()),
            }
        examples.append(ex)

    d = os.path.join(OUT, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    stored = model.to(DTYPES[dtype])
    if hub_names:
        sd = {k: v.contiguous() for k, v in stored.transformer.state_dict().items()}
        save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        stored.config.to_json_file(os.path.join(d, "config.json"))
    else:
        stored.save_pretrained(d, safe_serialization=True)
    for extra in os.listdir(d):
        if extra not in ("config.json", "model.safetensors"):
            os.remove(os.path.join(d, extra))
    for option, rewrite in CONFIG_LAYOUTS.items():
        if opts.get(option):
            path = os.path.join(d, "config.json")
            with open(path) as fh:
                saved = json.load(fh)
            rewrite(saved)
            with open(path, "w") as fh:
                json.dump(saved, fh, indent=2, sort_keys=True)
    save_file({"input_ids": ids.contiguous(), "labels": labels.contiguous()}, os.path.join(d, "batch.safetensors"))
    with open(os.path.join(d, "expected.json"), "w") as fh:
        json.dump({"reduction": reduction, "torch": torch.__version__, "examples": examples}, fh, indent=1)
    cross = [e["shared"] for e in examples]
    print(f"{name}: norms {[round(e['norm'], 6) for e in examples]} shared {cross and cross[0]}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prefixes", nargs="*", help="only the cases whose name starts with one of these")
    ap.add_argument("--out", default=OUT, help="directory the case directories are written to")
    args = ap.parse_args()
    OUT = args.out
    torch.set_default_dtype(torch.float64)
    float64_modules()
    for case in CASES:
        if not args.prefixes or any(case[0].startswith(p) for p in args.prefixes):
            run_case(*case)
