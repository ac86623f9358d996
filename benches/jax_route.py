#!/usr/bin/env python3
"""The JAX program route at the sizes users train (docs/results.md, "Gemma 3 1B through the JAX
program route"): Gemma 3's text model written in plain `jnp` to compute what Hugging Face's
`Gemma3ForCausalLM` computes (transformers' modeling_gemma3.py: √d-scaled tied embedding,
(1 + w) RMSNorms before and after attention and the MLP and on q and k, RoPE with base 1e4 on
sliding-window layers and 1e6 on global ones, GQA, GeGLU with tanh-GELU, the tied head `h @ E.T`),
its params pytree filled from that model's state dict, so that both routes judge the same weights.
`fun(params, ids)` is the mean next-token cross-entropy of the examples in `ids`, the function
jax_privacy clips; `ghost_oracle.jax.export_trace` reads it from its jaxpr.

Each stage runs in its own process, so that its peak RSS (printed as `peak_rss_gb`) is its own:

    python3 benches/jax_route.py weights --layers 1 --dir /tmp/jr   # HF model (seed 0) -> safetensors
    python3 benches/jax_route.py norms   --layers 1 --dir /tmp/jr   # exact norms, a jax.grad per example
    python3 benches/jax_route.py export  --layers 1 --dir /tmp/jr   # the trace, those norms claimed
    python3 benches/jax_route.py check   --layers 1 --dir /tmp/jr   # target/release/ghost-oracle check
                                                                     # (--trace torch: the torch stage's)
    python3 benches/jax_route.py torch   --layers 1 --dir /tmp/jr   # the same weights, PyTorch's export
    python3 benches/jax_route.py parity  --layers 1 --dir /tmp/jr   # both traces' true norms compared

`--dtype x64` holds everything in float64 (JAX with jax_enable_x64; the HF model with its
float32 islands, RMSNorm, rotary angles and softmax, removed as oracles/golden/make_golden.py
does), so that the two routes' true norms agree to float64 rounding; `--dtype f32` is the
training precision, both sides computing in float32 where HF does.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclass(frozen=True)
class Gemma3Shape:
    vocab: int
    d: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    window: int
    eps: float = 1e-6
    query_pre_attn_scalar: float = 256.0
    local_base: float = 10_000.0
    global_base: float = 1_000_000.0
    sliding_window_pattern: int = 6  # every sixth layer global, as HF's default layer_types
    pad_id: int | None = 0  # nn.Embedding's padding_idx: its lookups pass no gradient to the row

    def is_sliding(self, layer: int) -> bool:
        return (layer + 1) % self.sliding_window_pattern != 0


GEMMA3_1B = Gemma3Shape(vocab=262144, d=1152, layers=26, heads=4, kv_heads=1, head_dim=256, hidden=6912,
                        window=512)


def shape_of_config(cfg) -> Gemma3Shape:
    """The shape of an HF Gemma3TextConfig, refusing what the jnp forward does not model."""
    if cfg.final_logit_softcapping is not None or cfg.attn_logit_softcapping is not None:
        raise ValueError("soft-capping is not modelled by the jnp Gemma 3 (Gemma 3 has none)")
    if cfg.hidden_activation != "gelu_pytorch_tanh" or cfg.attention_bias or not cfg.tie_word_embeddings:
        raise ValueError("the jnp Gemma 3 models tanh-GELU, bias-free projections and a tied head only")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError("the jnp Gemma 3 is causal")
    rp = cfg.rope_parameters
    for kind in ("sliding_attention", "full_attention"):
        if rp[kind]["rope_type"] != "default":
            raise ValueError(f"rope type {rp[kind]['rope_type']!r} on {kind} layers is not modelled")
    shape = Gemma3Shape(vocab=cfg.vocab_size, d=cfg.hidden_size, layers=cfg.num_hidden_layers,
                        heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                        hidden=cfg.intermediate_size, window=cfg.sliding_window, eps=cfg.rms_norm_eps,
                        query_pre_attn_scalar=cfg.query_pre_attn_scalar,
                        local_base=rp["sliding_attention"]["rope_theta"],
                        global_base=rp["full_attention"]["rope_theta"],
                        sliding_window_pattern=getattr(cfg, "_sliding_window_pattern", 6), pad_id=cfg.pad_token_id)
    want = ["sliding_attention" if shape.is_sliding(i) else "full_attention" for i in range(shape.layers)]
    if list(cfg.layer_types) != want:
        raise ValueError(f"layer_types {cfg.layer_types} differ from the pattern the jnp Gemma 3 assumes")
    return shape


# ---------------------------------------------------------------------------------------------
# The jnp forward: HF's modeling_gemma3.py, operation for operation.


def _rms_norm(x, w, eps):
    import jax.numpy as jnp

    return x * (1.0 / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)) * (1.0 + w)


def _rope_tables(shape: Gemma3Shape, t: int, base: float, dtype):
    """cos, sin of shape (t, head_dim): HF's default rotary, `cat((freqs, freqs))`."""
    inv_freq = 1.0 / (base ** (np.arange(0, shape.head_dim, 2, dtype=np.float64) / shape.head_dim))
    inv_freq = inv_freq.astype(dtype)  # HF's buffer holds it in the model's dtype (float32 in f32)
    freqs = np.arange(t, dtype=dtype)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(dtype), np.sin(emb).astype(dtype)


def _rotate_half(x):
    import jax.numpy as jnp

    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def logits_fn(shape: Gemma3Shape, params, ids, head=None):
    """The logits (B, T, V) of `Gemma3ForCausalLM(input_ids=ids)`; params keyed by HF's names.
    `head`: a (V, d) matrix for the output layer in place of the tied embedding (an untied twin,
    whose two uses of E are differentiated apart)."""
    import jax
    import jax.numpy as jnp

    m = params["model"]
    emb = m["embed_tokens"]["weight"]
    dtype = emb.dtype
    b, t = ids.shape
    # HF: Gemma3TextScaledWordEmbedding multiplies the lookup by √d held in the weight's dtype
    h = jnp.take(emb, ids, axis=0)
    if shape.pad_id is not None:  # torch's padding_idx: the row's lookups are constants to autograd
        h = jnp.where((ids == shape.pad_id)[..., None], jax.lax.stop_gradient(h), h)
    h = h * jnp.asarray(shape.d ** 0.5, dtype)
    pos = np.arange(t)
    causal = pos[None, :] <= pos[:, None]  # (q, kv)
    sliding = causal & (pos[None, :] > pos[:, None] - shape.window)
    tables = {base: _rope_tables(shape, t, base, np.dtype(dtype)) for base in (shape.local_base, shape.global_base)}
    group = shape.heads // shape.kv_heads
    scale = jnp.asarray(shape.query_pre_attn_scalar ** -0.5, dtype)
    for i, layer in enumerate(m["layers"]):
        local = shape.is_sliding(i)
        cos, sin = tables[shape.local_base if local else shape.global_base]
        mask = sliding if local else causal
        a = layer["self_attn"]
        x = _rms_norm(h, layer["input_layernorm"]["weight"], shape.eps)
        q = (x @ a["q_proj"]["weight"].T).reshape(b, t, shape.heads, shape.head_dim).transpose(0, 2, 1, 3)
        k = (x @ a["k_proj"]["weight"].T).reshape(b, t, shape.kv_heads, shape.head_dim).transpose(0, 2, 1, 3)
        v = (x @ a["v_proj"]["weight"].T).reshape(b, t, shape.kv_heads, shape.head_dim).transpose(0, 2, 1, 3)
        q = _rms_norm(q, a["q_norm"]["weight"], shape.eps)
        k = _rms_norm(k, a["k_norm"]["weight"], shape.eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = jnp.repeat(k, group, axis=1)  # HF's repeat_kv: kv head j serves query heads j*group..
        v = jnp.repeat(v, group, axis=1)
        s = (q @ k.transpose(0, 1, 3, 2)) * scale
        s = jnp.where(mask, s, jnp.finfo(dtype).min)
        p = jax.nn.softmax(s, axis=-1)
        o = (p @ v).transpose(0, 2, 1, 3).reshape(b, t, shape.heads * shape.head_dim)
        o = o @ a["o_proj"]["weight"].T
        h = h + _rms_norm(o, layer["post_attention_layernorm"]["weight"], shape.eps)
        mlp = layer["mlp"]
        x = _rms_norm(h, layer["pre_feedforward_layernorm"]["weight"], shape.eps)
        gate = jax.nn.gelu(x @ mlp["gate_proj"]["weight"].T, approximate=True)  # gelu_pytorch_tanh
        y = (gate * (x @ mlp["up_proj"]["weight"].T)) @ mlp["down_proj"]["weight"].T
        h = h + _rms_norm(y, layer["post_feedforward_layernorm"]["weight"], shape.eps)
    h = _rms_norm(h, m["norm"]["weight"], shape.eps)
    return h @ (emb if head is None else head).T  # lm_head.weight is embed_tokens.weight


def per_example_loss(shape: Gemma3Shape, params, ids):
    """Each example's mean next-token cross-entropy, (B,): benches/trace_route.py's loss."""
    import jax
    import jax.numpy as jnp

    logits = logits_fn(shape, params, ids)[:, :-1]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0].mean(1)


def batch_loss(shape: Gemma3Shape):
    """fun(params, ids): the mean of the examples' losses, what jax_privacy's clipped_grad takes."""

    def fun(params, ids):
        return per_example_loss(shape, params, ids).mean()

    return fun


LAYER_KEYS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
              "post_feedforward_layernorm")
ATTN_KEYS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
MLP_KEYS = ("gate_proj", "up_proj", "down_proj")


def params_from_state(state, layers: int, convert=lambda a: a):
    """HF's state dict (name -> array) as the nested pytree `logits_fn` reads; key paths are HF's
    names (`model.layers.0.self_attn.q_proj.weight`). `lm_head.weight` is the tied embedding."""
    def w(name):
        return {"weight": convert(state[name + ".weight"])}

    out = {"model": {"embed_tokens": w("model.embed_tokens"), "norm": w("model.norm"), "layers": []}}
    for i in range(layers):
        p = f"model.layers.{i}"
        layer = {k: w(f"{p}.{k}") for k in LAYER_KEYS}
        layer["self_attn"] = {k: w(f"{p}.self_attn.{k}") for k in ATTN_KEYS}
        layer["mlp"] = {k: w(f"{p}.mlp.{k}") for k in MLP_KEYS}
        out["model"]["layers"].append(layer)
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{k}.weight" for i in range(layers) for k in
        LAYER_KEYS + tuple(f"self_attn.{a}" for a in ATTN_KEYS) + tuple(f"mlp.{a}" for a in MLP_KEYS)}
    extra = set(state) - expected - {"lm_head.weight"}
    if extra:
        raise ValueError(f"state dict entries the jnp Gemma 3 does not read: {sorted(extra)[:5]}")
    return out


# ---------------------------------------------------------------------------------------------
# The HF side: benches/trace_route.py's build (seed 0), in float64 without HF's float32 islands.


def hf_model(layers: int | None, dtype: str, **over):
    import torch

    sys.path.insert(0, HERE)
    import trace_route

    if dtype == "x64":
        sys.path.insert(0, os.path.join(ROOT, "oracles", "golden"))
        import make_golden

        make_golden.float64_modules()
    if over:
        cfg_name, cls_name, kw = trace_route.SHAPES["gemma3-1b"]
        trace_route.SHAPES["gemma3-custom"] = (cfg_name, cls_name, dict(kw, **over))
        model, cfg = trace_route.build("gemma3-custom", torch.float32, layers)
    else:
        model, cfg = trace_route.build("gemma3-1b", torch.float32, layers)
    if dtype == "x64":
        model = model.to(torch.float64)
        with torch.no_grad():
            make_golden.use_exact_rotary(model)
            model.model.embed_tokens.embed_scale.fill_(cfg.hidden_size ** 0.5)
    return model, cfg


def torch_per_example_loss(model, ids):
    import torch

    logits = model(input_ids=ids).logits[:, :-1]
    target = ids[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                             reduction="none")
    return loss.view(ids.shape[0], -1).mean(1)


def batch_ids(vocab: int, b: int, t: int) -> np.ndarray:
    """benches/trace_route.py's batch: torch.randint under seed 1."""
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (b, t), generator=g).numpy().astype(np.int32)


# ---------------------------------------------------------------------------------------------


def peak_rss_gb(who=resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss * 1024 / 1e9


def stem_of(a) -> str:
    depth = "" if a.layers is None else f"-l{a.layers}"
    return os.path.join(a.dir, f"gemma3-1b{depth}-b{a.batch}-t{a.seq}-{a.dtype}")


def load_jax_side(a):
    """(shape, params, ids) from the weights stage's files, in the run's dtype."""
    import jax

    if a.dtype == "x64":
        jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    stem = stem_of(a)
    with open(stem + ".shape.json") as f:
        shape = Gemma3Shape(**json.load(f))
    state = load_file(stem + ".weights.safetensors")
    want = np.float64 if a.dtype == "x64" else np.float32
    names = list(state)
    converted = {}
    for n in names:  # one leaf at a time, so that the numpy copy is freed as it goes
        converted[n] = jnp.asarray(state.pop(n).astype(want, copy=False))
    params = params_from_state(converted, shape.layers)
    ids = jnp.asarray(np.load(stem + ".ids.npy"))
    return shape, params, ids


def main():
    p = argparse.ArgumentParser()
    p.add_argument("stage", choices=["weights", "norms", "export", "check", "torch", "parity"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dtype", choices=["f32", "x64"], default="f32")
    p.add_argument("--layers", type=int, default=None, help="fewer blocks than the model's 26 (default: all)")
    p.add_argument("--dir", required=True)
    p.add_argument("--trace", choices=["jax", "torch"], default="jax", help="which route's trace `check` judges")
    a = p.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    stem = stem_of(a)
    out = {"stage": a.stage, "shape": "gemma3-1b", "layers": a.layers or GEMMA3_1B.layers, "batch": a.batch,
           "seq": a.seq, "dtype": a.dtype}
    t0 = time.perf_counter()
    if a.stage == "weights":
        from safetensors.numpy import save_file

        model, cfg = hf_model(a.layers, "f32")
        shape = shape_of_config(cfg)
        state = {k: v.detach().numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        save_file(state, stem + ".weights.safetensors")
        with open(stem + ".shape.json", "w") as f:
            json.dump(shape.__dict__, f)
        np.save(stem + ".ids.npy", batch_ids(shape.vocab, a.batch, a.seq))
        out["parameters"] = sum(v.size for v in state.values())
    elif a.stage == "norms":
        import jax

        shape, params, ids = load_jax_side(a)
        grad = jax.jit(jax.grad(lambda prm, x: per_example_loss(shape, prm, x)[0]))
        norms = []
        for i in range(a.batch):
            g = grad(params, ids[i:i + 1])
            norms.append(float(sum(np.sum(np.asarray(v, dtype=np.float64) ** 2)
                                   for v in jax.tree_util.tree_leaves(g))) ** 0.5)
            del g
        out["norms"] = norms
        with open(stem + ".jax-norms.json", "w") as f:
            json.dump(norms, f)
    elif a.stage == "export":
        from ghost_oracle.jax import export_trace

        shape, params, ids = load_jax_side(a)
        out["load_s"] = round(time.perf_counter() - t0, 2)
        with open(stem + ".jax-norms.json") as f:
            norms = json.load(f)
        t1 = time.perf_counter()
        export_trace(batch_loss(shape), params, ids, stem + ".jax.safetensors", claimed_norms=norms,
                     max_grad_norm=1.0)
        out["export_s"] = round(time.perf_counter() - t1, 2)
        out["trace_bytes"] = os.path.getsize(stem + ".jax.safetensors")
    elif a.stage == "check":
        binary = os.path.join(ROOT, "target", "release", "ghost-oracle")
        run = subprocess.run([binary, "check", f"{stem}.{a.trace}.safetensors"], capture_output=True, text=True)
        out["trace"] = a.trace
        out["rc"] = run.returncode
        out["check_peak_rss_gb"] = round(peak_rss_gb(resource.RUSAGE_CHILDREN), 3)
        out["stdout_tail"] = run.stdout[-1500:]
        if run.returncode != 0:
            out["stderr_tail"] = run.stderr[-1500:]
    elif a.stage == "torch":
        import torch

        from ghost_oracle.torch import export_trace

        model, cfg = hf_model(a.layers, a.dtype)
        ids = torch.from_numpy(np.load(stem + ".ids.npy")).long()
        from safetensors.numpy import load_file

        held = load_file(stem + ".weights.safetensors")  # the weights stage's, bit for bit
        for k, v in model.state_dict().items():
            if k != "lm_head.weight" and not np.array_equal(v.float().numpy(), held[k]):
                raise ValueError(f"{k}: the rebuilt HF model differs from the weights stage's file")
        del held
        norms = []
        for i in range(a.batch):
            model.zero_grad(set_to_none=True)
            torch_per_example_loss(model, ids[i:i + 1]).sum().backward()
            norms.append(sum(float(q.grad.double().pow(2).sum()) for q in model.parameters()
                             if q.grad is not None) ** 0.5)
        model.zero_grad(set_to_none=True)
        out["norms"] = norms
        t1 = time.perf_counter()
        export_trace(model, torch_per_example_loss, ids, stem + ".torch.safetensors", claimed_norms=norms,
                     max_grad_norm=1.0)
        out["export_s"] = round(time.perf_counter() - t1, 2)
    elif a.stage == "parity":
        import ghost_oracle

        jr = ghost_oracle.check(stem + ".jax.safetensors")
        tr = ghost_oracle.check(stem + ".torch.safetensors")
        j = np.asarray(jr.true_norms, dtype=np.float64)
        t = np.asarray(tr.true_norms, dtype=np.float64)
        out["jax_true_norms"] = j.tolist()
        out["torch_true_norms"] = t.tolist()
        out["max_rel_diff"] = float(np.max(np.abs(j - t) / np.abs(t)))
        out["verdicts"] = [str(jr.verdict), str(tr.verdict)]
    out["seconds"] = round(time.perf_counter() - t0, 2)
    out["peak_rss_gb"] = round(peak_rss_gb(), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
