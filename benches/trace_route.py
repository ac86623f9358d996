#!/usr/bin/env python3
"""The trace route at the sizes users train (docs/results.md, "The trace route at 1B-class sizes"):
a stock Hugging Face model with random weights (built from its config, no download), T = 128,
exported with `ghost_oracle.torch.export_trace` with exact per-example norms (an autograd loop)
as the claim, then judged by `ghost-oracle check`. Each phase runs in its own process so that its
peak RSS is its own; run it under `/usr/bin/time -v`:

    /usr/bin/time -v python3 benches/trace_route.py train  --shape llama-3.2-1b --batch 4 --dir /tmp/tr
    /usr/bin/time -v python3 benches/trace_route.py export --shape llama-3.2-1b --batch 4 --dir /tmp/tr
    /usr/bin/time -v target/release/ghost-oracle check /tmp/tr/llama-3.2-1b-b4-f32.safetensors

`train`: one plain training step on the batch (forward, backward, what the export is compared
with), then the exact per-example norms by one backward per example, saved for `export`.
`export`: the trace with those norms as the claim. `--dtype bf16`: bf16 weights.
"""
import argparse
import json
import os
import time

import torch

SHAPES = {
    # Llama-3.2-1B: 1.24 B parameters, tied, V 128256.
    "llama-3.2-1b": ("LlamaConfig", "LlamaForCausalLM", {
        "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
    # Qwen3-1.7B: 2.03 B parameters, tied, V 151936, per-head q/k norms.
    "qwen3-1.7b": ("Qwen3Config", "Qwen3ForCausalLM", {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    # Gemma 3 1B: 1.0 B parameters, tied, V 262144, scaled embedding, sliding windows.
    "gemma3-1b": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768, "sliding_window": 512, "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256}),
}
# Llama-3.2-3B (the stretch): 3.21 B parameters, tied; Llama-3.2-1B's vocabulary, positions and
# RoPE, wider and deeper.
SHAPES["llama-3.2-3b"] = ("LlamaConfig", "LlamaForCausalLM", dict(
    SHAPES["llama-3.2-1b"][2], hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, head_dim=128))


def build(shape, dtype, layers=None):
    import transformers

    cfg_name, cls_name, kw = SHAPES[shape]
    if layers is not None:  # the same embedding, head and block shapes, fewer blocks
        kw = dict(kw, num_hidden_layers=layers)
    cfg = getattr(transformers, cfg_name)(bos_token_id=0, eos_token_id=0, pad_token_id=0, **kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg).to(dtype)
    model.train()
    for m in model.modules():
        if hasattr(m, "dropout") and isinstance(m.dropout, float):
            m.dropout = 0.0
    return model, cfg


def batch(cfg, b, t):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, cfg.vocab_size, (b, t), generator=g)


def per_example_loss(model, ids):
    logits = model(input_ids=ids).logits[:, :-1].float()
    target = ids[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                             reduction="none")
    return loss.view(ids.shape[0], -1).mean(1)


def timed_stages():
    """Wraps the exporter's stages in timers (seconds each, in the dict returned)."""
    import ghost_oracle.torch.trace as trace

    stages = {}

    def timed(module, name):
        inner = getattr(module, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                stages[f"{name}_s"] = stages.get(f"{name}_s", 0.0) + time.perf_counter() - t0
        setattr(module, name, wrapper)

    for name in ("_record_batch", "_find_layouts", "self_check", "save_file"):
        timed(trace, name)
    return stages


def main():
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["train", "export"])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    p.add_argument("--dir", required=True)
    p.add_argument("--layers", type=int, default=None, help="fewer blocks than the model has (default: all)")
    a = p.parse_args()
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    os.makedirs(a.dir, exist_ok=True)
    depth = "" if a.layers is None else f"-l{a.layers}"
    stem = os.path.join(a.dir, f"{a.shape}{depth}-b{a.batch}-{a.dtype}")
    t0 = time.perf_counter()
    model, cfg = build(a.shape, dtype, a.layers)
    ids = batch(cfg, a.batch, a.seq)
    built = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    out = {"shape": a.shape, "layers": cfg.num_hidden_layers, "batch": a.batch, "seq": a.seq, "dtype": a.dtype,
           "parameters": n_params,
           "build_s": round(built, 2)}
    if a.phase == "train":
        t0 = time.perf_counter()
        per_example_loss(model, ids).mean().backward()
        out["train_step_s"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        norms = []
        for i in range(a.batch):
            model.zero_grad(set_to_none=True)
            per_example_loss(model, ids[i:i + 1]).sum().backward()
            sq = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None)
            norms.append(sq ** 0.5)
        out["per_example_loop_s"] = round(time.perf_counter() - t0, 2)
        out["norms"] = norms
        with open(stem + ".norms.json", "w") as f:
            json.dump(norms, f)
    else:
        from ghost_oracle.torch import export_trace

        with open(stem + ".norms.json") as f:
            norms = json.load(f)
        stages = timed_stages()
        t0 = time.perf_counter()
        export_trace(model, per_example_loss, ids, stem + ".safetensors", claimed_norms=norms, max_grad_norm=1.0)
        out["export_s"] = round(time.perf_counter() - t0, 2)
        # where the time went: the probes and the self-check, each timed by a wrapper; the
        # forward and the batch's backward are the recording's time less the probes'
        stages["forward+backward_s"] = stages.pop("_record_batch_s") - stages["_find_layouts_s"]
        out["stages"] = {k.strip("_"): round(v, 2) for k, v in stages.items()}
        out["trace_bytes"] = os.path.getsize(stem + ".safetensors")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
