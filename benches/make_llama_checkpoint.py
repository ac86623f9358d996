#!/usr/bin/env python3
"""Writes a randomly initialized Llama-family checkpoint (LlamaForCausalLM, Qwen2ForCausalLM or
Qwen3ForCausalLM: config.json + model.safetensors, f32) and a batch, for benchmarks and
large-scale checks. The defaults are the shape of Qwen2.5-0.5B (V 151936, d 896, 24 layers, 14
heads, 2 key/value heads, intermediate 4864, tied head, q/k/v biases). With --expected, also
computes torch.func per-example norms in float64 (the definition of
oracles/golden/make_golden.py, float64 patches included) into DIR/expected.json; that is only
practical for small shapes.

The module is built on the meta device and each tensor drawn and written straight to the file, so
a 2 B-parameter checkpoint needs about its own size in memory, not twice it.

    python3 benches/make_llama_checkpoint.py /tmp/qwen05b --seq 128 --batch 2
    python3 benches/make_llama_checkpoint.py /tmp/llama1b --model-type llama --vocab 128256 \\
        --hidden 2048 --intermediate 8192 --layers 16 --heads 32 --kv-heads 8 --rope-theta 500000 \\
        --rope-scaling llama3 --max-positions 131072 --batch 4
    python3 benches/make_llama_checkpoint.py /tmp/qwen3-17b --model-type qwen3 --vocab 151936 \\
        --hidden 2048 --intermediate 6144 --layers 28 --heads 16 --kv-heads 8 --head-dim 128 --batch 2
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
p.add_argument("--model-type", choices=["qwen2", "qwen3", "llama"], default="qwen2")
p.add_argument("--vocab", type=int, default=151936)
p.add_argument("--hidden", type=int, default=896)
p.add_argument("--intermediate", type=int, default=4864)
p.add_argument("--layers", type=int, default=24)
p.add_argument("--heads", type=int, default=14)
p.add_argument("--kv-heads", type=int, default=2)
p.add_argument("--head-dim", type=int, default=None, help="default hidden / heads")
p.add_argument("--rope-theta", type=float, default=1000000.0)
p.add_argument("--rope-scaling", choices=["none", "llama3"], default="none",
               help="llama3: Llama 3.2's (factor 32, low 1, high 4, original context 8192)")
p.add_argument("--max-positions", type=int, default=32768)
p.add_argument("--seq", type=int, default=128)
p.add_argument("--batch", type=int, default=2)
p.add_argument("--init-std", type=float, default=0.02)
p.add_argument("--untied", action="store_true")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--expected", action="store_true", help="also write torch.func per-example norms (float64)")
a = p.parse_args()

import transformers

classes = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
config_cls, model_cls = (getattr(transformers, n) for n in classes[a.model_type])
rope = {"rope_type": "default", "rope_theta": a.rope_theta}
if a.rope_scaling == "llama3":
    rope.update(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)
extra = {"head_dim": a.head_dim} if a.head_dim else {}
if a.model_type == "qwen2":
    extra["use_sliding_window"] = False
cfg = config_cls(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                 num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                 max_position_embeddings=max(a.max_positions, a.seq), rope_parameters=rope, rms_norm_eps=1e-6,
                 tie_word_embeddings=not a.untied, bos_token_id=0, eos_token_id=0, **extra)
with torch.device("meta"):
    model = model_cls(cfg)
torch.manual_seed(a.seed)
tensors = {}
for name, t in model.state_dict().items():
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        continue  # tied: the checkpoint holds the embedding once, as HF's save_pretrained does
    if name.endswith("norm.weight"):
        tensors[name] = 1.0 + 0.1 * torch.randn(t.shape)
    elif name.endswith(".bias"):
        tensors[name] = 0.1 * torch.randn(t.shape)
    else:
        tensors[name] = torch.empty(t.shape).normal_(0.0, a.init_std)
count = sum(t.numel() for t in tensors.values())
os.makedirs(a.out, exist_ok=True)
save_file(tensors, os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})
cfg.dtype = "float32"
cfg.to_json_file(os.path.join(a.out, "config.json"))
ids = torch.randint(0, a.vocab, (a.batch, a.seq))
save_file({"input_ids": ids.contiguous()}, os.path.join(a.out, "batch.safetensors"))
print(f"wrote {a.out}: {count} parameters")

if a.expected:
    from torch.func import grad, vmap

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "oracles", "golden"))
    import make_golden

    del tensors
    torch.set_default_dtype(torch.float64)
    make_golden.float64_modules()
    model = model_cls.from_pretrained(a.out, dtype=torch.float64, attn_implementation="eager").eval()
    with torch.no_grad():
        make_golden.use_exact_rotary(model)
    params = {k: v.detach() for k, v in model.named_parameters()}
    def loss(p, x, y):
        return make_golden.per_example_loss(model, p, x, y, "mean", cfg.tie_word_embeddings)
    norms = []
    for i in range(a.batch):  # one example at a time keeps memory at one gradient
        g = vmap(grad(loss), in_dims=(None, 0, 0))(params, ids[i:i + 1], ids[i:i + 1])
        norms.append(sum(float((v ** 2).sum()) for v in g.values()) ** 0.5)
    with open(os.path.join(a.out, "expected.json"), "w") as fh:
        json.dump({"norms": norms}, fh)
    print("torch.func norms:", norms)
