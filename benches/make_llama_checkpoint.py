#!/usr/bin/env python3
"""Writes a randomly initialized Llama-family checkpoint (LlamaForCausalLM or Qwen2ForCausalLM,
save_pretrained, f32) and a batch, for benchmarks and large-scale checks. The defaults are the
shape of Qwen2.5-0.5B (V 151936, d 896, 24 layers, 14 heads, 2 key/value heads, intermediate
4864, tied head, q/k/v biases). With --expected, also computes torch.func per-example norms in
float64 (the definition of oracles/golden/make_golden.py, float64 patches included) into
DIR/expected.json; that is only practical for small shapes.

    python3 benches/make_llama_checkpoint.py /tmp/qwen05b --seq 128 --batch 2
    python3 benches/make_llama_checkpoint.py /tmp/tiny-llama --model-type llama --vocab 512 \\
        --hidden 64 --intermediate 128 --layers 2 --heads 4 --kv-heads 2 --untied --expected
"""
import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--model-type", choices=["qwen2", "llama"], default="qwen2")
p.add_argument("--vocab", type=int, default=151936)
p.add_argument("--hidden", type=int, default=896)
p.add_argument("--intermediate", type=int, default=4864)
p.add_argument("--layers", type=int, default=24)
p.add_argument("--heads", type=int, default=14)
p.add_argument("--kv-heads", type=int, default=2)
p.add_argument("--rope-theta", type=float, default=1000000.0)
p.add_argument("--seq", type=int, default=128)
p.add_argument("--batch", type=int, default=2)
p.add_argument("--init-std", type=float, default=0.02)
p.add_argument("--untied", action="store_true")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--expected", action="store_true", help="also write torch.func per-example norms (float64)")
a = p.parse_args()

from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[a.model_type]
torch.manual_seed(a.seed)
cfg = config_cls(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                 num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                 max_position_embeddings=max(32768, a.seq), rope_theta=a.rope_theta, rms_norm_eps=1e-6,
                 tie_word_embeddings=not a.untied, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
model = model_cls(cfg).float().eval()
with torch.no_grad():
    for name, t in model.named_parameters():
        if name.endswith("norm.weight"):
            t.copy_(1.0 + 0.1 * torch.randn_like(t))
        elif name.endswith(".bias"):
            t.copy_(0.1 * torch.randn_like(t))
        else:
            t.normal_(0.0, a.init_std)
os.makedirs(a.out, exist_ok=True)
model.save_pretrained(a.out, safe_serialization=True)
for extra in os.listdir(a.out):
    if extra not in ("config.json", "model.safetensors"):
        os.remove(os.path.join(a.out, extra))
ids = torch.randint(0, a.vocab, (a.batch, a.seq))
save_file({"input_ids": ids.contiguous()}, os.path.join(a.out, "batch.safetensors"))
print(f"wrote {a.out}: {sum(t.numel() for t in model.parameters())} parameters")

if a.expected:
    from torch.func import grad, vmap

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "oracles", "golden"))
    import make_golden

    torch.set_default_dtype(torch.float64)
    make_golden.float64_llama_family()
    model = model.double()
    with torch.no_grad():
        model.model.rotary_emb.inv_freq = make_golden.inv_freq_f64(model.config)
    params = {k: v.detach() for k, v in model.named_parameters()}
    loss = lambda p, x, y: make_golden.per_example_loss(model, p, x, y, "mean", True)
    norms = []
    for i in range(a.batch):  # one example at a time keeps memory at one gradient
        g = vmap(grad(loss), in_dims=(None, 0, 0))(params, ids[i:i + 1], ids[i:i + 1])
        norms.append(sum(float((v ** 2).sum()) for v in g.values()) ** 0.5)
    with open(os.path.join(a.out, "expected.json"), "w") as fh:
        json.dump({"norms": norms}, fh)
    print("torch.func norms:", norms)
