#!/usr/bin/env python3
"""Random-init Hugging Face checkpoints at real model shapes (one layer each) and their batches,
for measuring the low-precision rounding bound in units of the norm (docs/results.md, "The bf16
bound on HF-shaped models").

Every file goes under OUT (a temporary directory; nothing here belongs in the repository): one
directory per shape with config.json and model.safetensors (save_pretrained, float32,
HF's default init, initializer_range 0.02) and batch-T<T>.safetensors (`input_ids`, int64
B×T, uniform random ids in [0, vocab)) for each sequence length of the shape.

    python3 python/scripts/make_bound_shapes.py /tmp/bound-shapes            # every shape
    python3 python/scripts/make_bound_shapes.py /tmp/bound-shapes gpt2_d768  # some of them
    cargo run --release -- audit --model /tmp/bound-shapes/gpt2_d768 \
        --batch /tmp/bound-shapes/gpt2_d768/batch-T128.safetensors --dtype bf16 \
        --clipper ghost-tied --clipper materialize --json out.json
"""
import argparse
import os

import torch
import transformers
from safetensors.torch import save_file


def shapes():
    """name -> (model class, config, sequence lengths, batch size)."""
    t = transformers
    common = dict(bos_token_id=0, eos_token_id=0, initializer_range=0.02, attn_implementation="eager")
    return {
        # GPT-2 small's widths, tied embedding and head.
        "gpt2_d768": (t.GPT2LMHeadModel, t.GPT2Config(
            vocab_size=50257, n_positions=1024, n_embd=768, n_layer=1, n_head=12,
            tie_word_embeddings=True, **common), [128, 1024], 2),
        # Llama 3.2-1B's widths (hidden 2048, 32 heads, 8 kv heads, intermediate 8192), tied,
        # with Llama 2's 32000-token vocabulary.
        "llama_d2048": (t.LlamaForCausalLM, t.LlamaConfig(
            vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=1,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
            tie_word_embeddings=True, **common), [512, 2048], 1),
        # Qwen2.5-0.5B's widths: hidden 896, 14 heads, 2 kv heads, intermediate 4864, biases on
        # q/k/v, tied.
        "qwen2_d896": (t.Qwen2ForCausalLM, t.Qwen2Config(
            vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=1,
            num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048,
            tie_word_embeddings=True, **common), [512], 1),
        # Llama 2-7B's widths (hidden 4096, intermediate 11008, 32 heads, untied).
        "llama_d4096": (t.LlamaForCausalLM, t.LlamaConfig(
            vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=1,
            num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048,
            tie_word_embeddings=False, **common), [256, 2048], 1),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="directory to write into (a temporary one)")
    p.add_argument("names", nargs="*", help="shapes to write (default: all)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    table = shapes()
    for name in a.names or table:
        cls, cfg, seqs, batch = table[name]
        torch.manual_seed(a.seed)
        model = cls(cfg).to(torch.float32).eval()  # HF's own _init_weights: N(0, 0.02), norms 1
        d = os.path.join(a.out, name)
        os.makedirs(d, exist_ok=True)
        model.save_pretrained(d, safe_serialization=True)
        g = torch.Generator().manual_seed(a.seed + 1)
        for t in seqs:
            ids = torch.randint(0, cfg.vocab_size, (batch, t), generator=g, dtype=torch.int64)
            save_file({"input_ids": ids.contiguous()}, os.path.join(d, f"batch-T{t}.safetensors"))
        n = sum(v.numel() for v in model.parameters())
        print(f"wrote {d}: {n} parameters, batches B={batch} T={seqs}", flush=True)
        del model


if __name__ == "__main__":
    main()
