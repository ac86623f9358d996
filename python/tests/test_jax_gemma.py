"""A tiny Gemma 3 of the `gemma` package (random weights, tied embedding): Einsum layers with
N-D kernels, Embedder.encode (scaled by √d) and decode (the tied head), per-head q/k RMSNorms
with x̂ ⊙ (1 + scale), final-logit soft-capping; jax_privacy's norms, clipped sum and noisy
update pass, in f32 and in x64 (f64 weights and compute, every factor of the trace in f64)."""
import json
import zlib

import pytest
from safetensors import safe_open

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
gm = pytest.importorskip("gemma.gm")
pytest.importorskip("jax_privacy")

import jax.numpy as jnp
import numpy as np
from jax_models import true_norms

from ghost_oracle import jax_privacy as gj

VOCAB = 32


def tiny_gemma3(dtype):
    config = gm.nn.config.TransformerConfig(
        num_embed=VOCAB, embed_dim=16, hidden_dim=32, num_heads=2, head_dim=8, num_kv_heads=1,
        final_logit_softcap=5.0, use_post_attn_norm=True, use_post_ffw_norm=True, use_qk_norm=True,
        attention_types=(gm.nn.config.AttentionType.LOCAL_SLIDING, gm.nn.config.AttentionType.GLOBAL),
        sliding_window_size=3, transpose_gating_einsum=True)
    return gm.nn.Transformer(config=config, dtype=dtype, tokens="tokens")


def gemma_loss(apply, tokens):
    logits = apply(tokens).logits
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))  # f32, or f64 in an x64 model
    logp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0].mean(1)


def tiny_gemma3_case(dtype):
    """The model, 3 × 6 tokens and random weights in `dtype` (Flax's param_dtype is f32 even under
    x64: the params are cast)."""
    model = tiny_gemma3(dtype)
    tokens = jax.random.randint(jax.random.key(0), (3, 6), 1, VOCAB)
    params = model.init(jax.random.key(1), tokens)["params"]
    # random weights: the zero-initialized norm scales and a normal embedding would make a
    # nearly linear model; a spread of scales exercises x̂ ⊙ (1 + scale). Each tensor's key comes
    # from its path by a checksum (str hashes differ from process to process).
    params = jax.tree_util.tree_map_with_path(
        lambda p, v: (v + 0.3 * jax.random.normal(jax.random.key(zlib.crc32(str(p).encode())), v.shape, v.dtype))
        .astype(dtype), params)
    return model, params, tokens


@pytest.mark.parametrize("x64", [False, True], ids=["f32", "x64"])
def test_tiny_gemma3_tied_norms_and_step_pass(tmp_path, x64):
    with jax.enable_x64(x64):
        dtype = jnp.float64 if x64 else jnp.float32
        model, params, tokens = tiny_gemma3_case(dtype)
        assert {v.dtype for v in jax.tree_util.tree_leaves(params)} == {np.dtype(dtype)}
        norms = true_norms(model, params, gemma_loss, tokens)
        c = float(norms.min()) / 2
        # One export serves both claims: jax_privacy's norms and its noisy step, judged together.
        path = tmp_path / "gemma3.safetensors"
        report = gj.assert_update(model, params, gemma_loss, tokens, l2_clip_norm=c, noise_multiplier=1.0,
                                  normalize_by=3.0, trace_path=path)
    assert report.passed, report.explain()
    np.testing.assert_allclose(report.true_norms, norms, rtol=1e-9 if x64 else 1e-4)
    with safe_open(str(path), "np") as f:
        specs = json.loads(f.metadata()["sites"])
        assert f.metadata()["compute_dtype"] == ("f64" if x64 else "f32")
        stored = {f.get_tensor(k).dtype for k in f.keys() if not k.endswith(".ids")}
    if x64:
        assert stored == {np.dtype(np.float64)}  # every factor and claim in f64, none rounded to f32
    else:
        assert np.dtype(np.float32) in stored
    table = [s for s in specs if s["param"] == "embedder.input_embedding"]
    assert [s["kind"] for s in table] == ["embedding", "linear"]  # encode and the tied decode
    assert any(s["param"].endswith("attn.kv_einsum.w") for s in specs)  # the C×K×D×H kernel
