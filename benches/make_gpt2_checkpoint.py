#!/usr/bin/env python3
"""Writes a randomly initialized GPT-2 checkpoint (save_pretrained) and a batch, for benchmarks
and large-scale checks. With --expected, also computes torch.func per-example norms in float64
(the same definition as oracles/golden/make_golden.py) into DIR/expected.json.

    python3 benches/make_gpt2_checkpoint.py /tmp/distilgpt2 --layers 6 --seq 128 --batch 4
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--vocab", type=int, default=50257)
p.add_argument("--hidden", type=int, default=768)
p.add_argument("--layers", type=int, default=6)
p.add_argument("--heads", type=int, default=12)
p.add_argument("--seq", type=int, default=128)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--init-std", type=float, default=0.02)
p.add_argument("--untied", action="store_true")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--expected", action="store_true", help="also write torch.func per-example norms (float64)")
a = p.parse_args()

torch.manual_seed(a.seed)
cfg = GPT2Config(vocab_size=a.vocab, n_positions=max(1024, a.seq), n_embd=a.hidden, n_layer=a.layers, n_head=a.heads,
                 tie_word_embeddings=not a.untied, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
model = GPT2LMHeadModel(cfg).to(torch.float64).eval()
with torch.no_grad():
    for name, t in model.named_parameters():
        if ".ln_" in name or "ln_f" in name:
            t.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(t))
        else:
            t.copy_(a.init_std * torch.randn_like(t))
        t.copy_(t.float().double())  # stored in f32: the f64 model is exactly the file
os.makedirs(a.out, exist_ok=True)
model.float().save_pretrained(a.out, safe_serialization=True)
ids = torch.randint(0, a.vocab, (a.batch, a.seq))
save_file({"input_ids": ids.contiguous()}, os.path.join(a.out, "batch.safetensors"))
print(f"wrote {a.out}: {sum(t.numel() for t in model.parameters())} parameters")

if a.expected:
    from torch.func import functional_call, grad, vmap
    model = model.double()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x):
        logits = functional_call(model, p, (x.unsqueeze(0),)).logits[0]
        return torch.nn.functional.cross_entropy(logits[:-1], x[1:])

    norms = []
    for i in range(a.batch):  # one example at a time keeps memory at one gradient
        g = vmap(grad(loss), in_dims=(None, 0))(params, ids[i:i + 1])
        norms.append(sum(float((v ** 2).sum()) for v in g.values()) ** 0.5)
    with open(os.path.join(a.out, "expected.json"), "w") as fh:
        json.dump({"norms": norms}, fh)
    print("torch.func norms:", norms)
