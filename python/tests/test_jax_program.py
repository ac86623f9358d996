"""The program route of ghost_oracle.jax (any `fun(params, batch)`, captured from its jaxpr):
a plain-jnp tiny tied LM (lookup, RMS gain x̂ ⊙ (1 + w), MLP, head h @ E.T) in x64 and f32, and
how fun's arguments are read (batch_argnums, keep_batch_dim). Ground truth:
jax.vmap(jax.grad(...)) of each example's own loss; the tied LM's cross term dropped from an
untied twin of the same weights."""
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp
import numpy as np
from jax_programs import B, lm_ids, lm_params, mlp_params, per_example_norms, tied_lm, untied_lm

import ghost_oracle
from ghost_oracle.jax import assert_norms, export_trace


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


def test_keep_batch_dim_false_and_batch_argnums_tuple():
    """keep_batch_dim=False: fun sees one example without its batch axis (clipped_grad vmaps it);
    batch_argnums=(1,): batch is the tuple of fun's arguments after params; an argument not
    listed is passed whole (here a scale, shared by every example)."""
    with jax.enable_x64(True):
        params = mlp_params(jnp.float64)
        x = jax.random.normal(jax.random.key(3), (B, 5), jnp.float64)
        y = jax.random.normal(jax.random.key(4), (B, 3), jnp.float64)
        scale = jnp.float64(0.5)

        def one(p, example, s):  # one example: x (5,), y (3,)
            h = jnp.tanh(example[0] @ p["layers"][0]["w"] + p["layers"][0]["b"])
            return s * jnp.sum((h @ p["layers"][1]["w"] + p["layers"][1]["b"] - example[1]) ** 2)

        grads = jax.vmap(jax.grad(one), in_axes=(None, 0, None))(params, (x, y), scale)
        norms = np.sqrt(sum(np.sum(np.asarray(g).reshape(B, -1) ** 2, 1) for g in jax.tree_util.tree_leaves(grads)))
        report = assert_norms(one, params, ((x, y), scale), norms, max_grad_norm=1.0, batch_argnums=(1,),
                              keep_batch_dim=False)
        np.testing.assert_allclose(report.true_norms, norms, rtol=1e-9)

