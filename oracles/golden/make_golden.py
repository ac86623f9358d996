#!/usr/bin/env python3
"""Regenerates the PyTorch golden files the reference is tested against.

Each case is a directory with an HF checkpoint (config.json + model.safetensors, written by
save_pretrained or, for the original hub naming, by safetensors directly), a batch file and
expected.json: per-example norms, per-parameter norms and the tied split, computed in float64
with torch.func (vmap over grad of each example's own loss).

    pip install torch transformers safetensors
    python3 oracles/golden/make_golden.py      # rewrites oracles/golden/cases/*

Weights are drawn larger than HF's init (std `init_std` instead of 0.02) so that the tied cross
term is a visible part of the norm; LayerNorm parameters are randomized too.
"""
import json
import os
import shutil

import torch
from safetensors.torch import save_file
from torch.func import functional_call, grad, vmap
from transformers import GPT2Config, GPT2LMHeadModel

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "cases")
IGNORE = -100

# name, config overrides, init_std, batch (B, T), seed, options
CASES = [
    ("tied_l1_h2_t2", dict(vocab_size=17, n_positions=8, n_embd=8, n_layer=1, n_head=2), 0.4, (3, 2), 1, {}),
    ("tied_l2_h4_t33", dict(vocab_size=32, n_positions=40, n_embd=16, n_layer=2, n_head=4), 0.3, (2, 33), 2, {}),
    ("untied_l2_h3_t8", dict(vocab_size=24, n_positions=12, n_embd=12, n_layer=2, n_head=3, tie_word_embeddings=False), 0.3, (3, 8), 3, {}),
    ("untied_l1_h2_t2", dict(vocab_size=19, n_positions=4, n_embd=8, n_layer=1, n_head=2, tie_word_embeddings=False), 0.4, (2, 2), 4, {}),
    ("tied_ignored_labels", dict(vocab_size=13, n_positions=16, n_embd=8, n_layer=2, n_head=2), 0.4, (3, 12), 5, {"ignore": True}),
    ("tied_sum_reduction", dict(vocab_size=13, n_positions=16, n_embd=8, n_layer=1, n_head=4), 0.4, (2, 10), 6, {"reduction": "sum"}),
    ("tied_f32_hub_names", dict(vocab_size=21, n_positions=16, n_embd=12, n_layer=1, n_head=3), 0.35, (2, 9), 7, {"dtype": "f32", "hub_names": True}),
    ("tied_bf16", dict(vocab_size=15, n_positions=10, n_embd=8, n_layer=1, n_head=2), 0.4, (2, 7), 8, {"dtype": "bf16"}),
    ("tied_f16_inverse_layer_idx", dict(vocab_size=15, n_positions=10, n_embd=8, n_layer=2, n_head=2, scale_attn_by_inverse_layer_idx=True), 0.4, (2, 7), 9, {"dtype": "f16"}),
]

DTYPES = {"f64": torch.float64, "f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def build(cfg_over, init_std, seed, dtype):
    torch.manual_seed(seed)
    cfg = GPT2Config(**cfg_over, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    model = GPT2LMHeadModel(cfg).to(torch.float64).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name or "ln_f" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            else:
                p.copy_(init_std * torch.randn_like(p))
            # Round through the stored dtype so the f64 model is exactly what the file holds.
            p.copy_(p.to(DTYPES[dtype]).to(torch.float64))
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


def run_case(name, cfg_over, init_std, shape, seed, opts):
    dtype = opts.get("dtype", "f64")
    reduction = opts.get("reduction", "mean")
    model = build(cfg_over, init_std, seed, dtype)
    cfg = model.config
    ids, labels = batch_for(cfg, shape, seed, opts.get("ignore", False))
    tied = cfg.tie_word_embeddings

    params = {k: v.detach() for k, v in model.named_parameters()}
    f = lambda p, x, y: per_example_loss(model, p, x, y, reduction, True)
    grads = vmap(grad(f), in_dims=(None, 0, 0))(params, ids, labels)
    losses = vmap(f, in_dims=(None, 0, 0))(params, ids, labels)

    split = None
    if tied:
        # Untie for the split: the embedding and the head get separate copies of wte.
        wte = params["transformer.wte.weight"]
        p2 = dict(params)
        p2["lm_head.weight"] = wte.clone()
        f2 = lambda p, x, y: per_example_loss(model, p, x, y, reduction, False)
        g2 = vmap(grad(f2), in_dims=(None, 0, 0))(p2, ids, labels)
        split = (g2["transformer.wte.weight"], g2["lm_head.weight"])

    examples = []
    for i in range(shape[0]):
        pnorms = {}
        total = 0.0
        for k, g in grads.items():
            sq = float((g[i] ** 2).sum())
            total += sq
            key = k[len("transformer."):] if opts.get("hub_names") and k.startswith("transformer.") else k
            pnorms[key] = sq ** 0.5
        ex = {"loss": float(losses[i]), "norm": total ** 0.5, "params": pnorms, "shared": {}}
        if split is not None:
            gi, go = split[0][i], split[1][i]
            key = "wte.weight" if opts.get("hub_names") else "transformer.wte.weight"
            ex["shared"][key] = {
                "input_sq": float((gi ** 2).sum()),
                "output_sq": float((go ** 2).sum()),
                "cross": float((gi * go).sum()),
            }
        examples.append(ex)

    d = os.path.join(OUT, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    stored = model.to(DTYPES[dtype])
    if opts.get("hub_names"):
        sd = {k: v.contiguous() for k, v in stored.transformer.state_dict().items()}
        save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        stored.config.to_json_file(os.path.join(d, "config.json"))
    else:
        stored.save_pretrained(d, safe_serialization=True)
    for extra in os.listdir(d):
        if extra not in ("config.json", "model.safetensors"):
            os.remove(os.path.join(d, extra))
    save_file({"input_ids": ids.contiguous(), "labels": labels.contiguous()}, os.path.join(d, "batch.safetensors"))
    with open(os.path.join(d, "expected.json"), "w") as fh:
        json.dump({"reduction": reduction, "torch": torch.__version__, "examples": examples}, fh, indent=1)
    cross = [e["shared"] for e in examples]
    print(f"{name}: norms {[round(e['norm'], 6) for e in examples]} shared {cross and cross[0]}")


if __name__ == "__main__":
    torch.set_default_dtype(torch.float64)
    for case in CASES:
        run_case(*case)
