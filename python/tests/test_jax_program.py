"""The program route of ghost_oracle.jax (any `fun(params, batch)`, captured from its jaxpr):
a plain-jnp tiny tied LM (lookup, RMS gain x̂ ⊙ (1 + w), MLP, head h @ E.T), an untied MLP and a
small conv model, in x64 and f32. Ground truth: jax.vmap(jax.grad(...)) of each example's own
loss; the tied LM's cross term dropped from an untied twin of the same weights."""
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp
import numpy as np

import ghost_oracle
from ghost_oracle.jax import assert_norms, export_trace

V, D, H, T, B = 13, 6, 10, 5, 4


def rms(h):
    return h / jnp.sqrt((h * h).mean(-1, keepdims=True) + 1e-6)


def lm_params(dtype):
    k = jax.random.split(jax.random.key(0), 5)
    return {"embed": jax.random.normal(k[0], (V, D), dtype),
            "norm": 0.1 * jax.random.normal(k[1], (D,), dtype),
            "mlp": {"up": jax.random.normal(k[2], (D, H), dtype) / np.sqrt(D),
                    "bias": 0.1 * jax.random.normal(k[3], (H,), dtype),
                    "down": jax.random.normal(k[4], (H, D), dtype) / np.sqrt(H)}}


def lm_body(p, ids, head):
    h = rms(p["embed"][ids]) * (1 + p["norm"])
    h = h + jax.nn.gelu(h @ p["mlp"]["up"] + p["mlp"]["bias"]) @ p["mlp"]["down"]
    logp = jax.nn.log_softmax((rms(h) @ head.T)[:, :-1])
    return -jnp.take_along_axis(logp, ids[:, 1:, None], -1).mean()


def tied_lm(p, ids):  # B×T ids; the loss of the batch, the mean of its examples'
    return lm_body(p, ids, p["embed"])


def untied_lm(p, ids):  # the same weights with the head a parameter of its own
    return lm_body(p, ids, p["head"])


def lm_ids():
    return jax.random.randint(jax.random.key(7), (B, T), 0, V)


def per_example_norms(fun, params, batch):
    """The truth: each example's own gradient, fun on batch[i:i+1]."""
    grads = jax.vmap(jax.grad(fun), in_axes=(None, 0))(params, batch[:, None])
    return np.sqrt(sum(np.sum(np.asarray(g, np.float64).reshape(len(batch), -1) ** 2, 1)
                       for g in jax.tree_util.tree_leaves(grads)))


@pytest.mark.parametrize("x64", [True, False], ids=["f64", "f32"])
def test_tied_lm_exact_norms_pass_and_dropped_cross_term_and_low_norm_fail(x64):
    with jax.enable_x64(x64):
        dtype = jnp.float64 if x64 else jnp.float32
        params, ids = lm_params(dtype), lm_ids()
        norms = per_example_norms(tied_lm, params, ids)
        report = assert_norms(tied_lm, params, ids, norms, max_grad_norm=float(np.median(norms)))
        np.testing.assert_allclose(report.true_norms, norms, rtol=1e-9 if x64 else 1e-4)
        untied = per_example_norms(untied_lm, {**params, "head": params["embed"]}, ids)
        assert np.max(np.abs(untied - norms) / norms) > 1e-3  # the cross term matters here
        with pytest.raises(ghost_oracle.ClippingCheckFailed):
            assert_norms(tied_lm, params, ids, untied, max_grad_norm=float(np.median(norms)))
        low = norms.copy()
        low[1] *= 1 - 1e-3
        with pytest.raises(ghost_oracle.ClippingCheckFailed):
            assert_norms(tied_lm, params, ids, low, max_grad_norm=float(np.median(norms)))


def test_tied_lm_sites_named_by_key_path(tmp_path):
    with jax.enable_x64(True):
        params, ids = lm_params(jnp.float64), lm_ids()
        specs = export_trace(tied_lm, params, ids, tmp_path / "lm.safetensors", max_grad_norm=1.0)
    assert [(s["name"], s["kind"]) for s in specs] == [
        ("embed", "embedding"), ("norm", "layernorm"), ("mlp.up", "conv1d"), ("mlp.bias", "bias"),
        ("mlp.down", "conv1d"), ("embed@1", "linear")]
