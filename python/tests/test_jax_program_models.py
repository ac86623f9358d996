"""The program route on an untied MLP (two batched arguments), a small conv model, and a linen
model through nn.Module.apply wrapped as fun (the same true norms as the linen route), in x64
and f32; truth: jax.vmap(jax.grad(...)) of each example's own loss."""
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp
import numpy as np
from jax_programs import B, D, H, V, conv_net, conv_params, lm_ids, mlp, mlp_params, per_example_norms

import ghost_oracle
from ghost_oracle.jax import assert_norms, export_trace


def judged(fun, params, batch, norms, dtype_is_x64):
    c = float(np.median(norms))
    report = assert_norms(fun, params, batch, norms, max_grad_norm=c)
    np.testing.assert_allclose(report.true_norms, norms, rtol=1e-9 if dtype_is_x64 else 1e-4)
    low = norms.copy()
    low[0] *= 1 - 1e-3
    with pytest.raises(ghost_oracle.ClippingCheckFailed):
        assert_norms(fun, params, batch, low, max_grad_norm=c)


@pytest.mark.parametrize("x64", [True, False], ids=["f64", "f32"])
def test_untied_mlp_with_two_batched_arguments(x64):
    with jax.enable_x64(x64):
        dtype = jnp.float64 if x64 else jnp.float32
        params = mlp_params(dtype)
        x = jax.random.normal(jax.random.key(3), (B, 5), dtype)
        y = jax.random.normal(jax.random.key(4), (B, 3), dtype)
        grads = jax.vmap(jax.grad(mlp), in_axes=(None, 0))(params, (x[:, None], y[:, None]))
        norms = np.sqrt(sum(np.sum(np.asarray(g, np.float64).reshape(B, -1) ** 2, 1)
                            for g in jax.tree_util.tree_leaves(grads)))
        judged(mlp, params, (x, y), norms, x64)


@pytest.mark.parametrize("x64", [True, False], ids=["f64", "f32"])
def test_conv_model(x64, tmp_path):
    with jax.enable_x64(x64):
        dtype = jnp.float64 if x64 else jnp.float32
        params = conv_params(dtype)
        img = jax.random.normal(jax.random.key(5), (B, 4, 6, 2), dtype)
        norms = per_example_norms(conv_net, params, img)
        judged(conv_net, params, img, norms, x64)
        specs = export_trace(conv_net, params, img, tmp_path / "conv.safetensors", max_grad_norm=1.0)
    assert [(s["name"], s["kind"]) for s in specs] == [("conv.kernel", "conv1d"), ("conv.bias", "bias"),
                                                       ("head", "conv1d")]


def test_linen_model_as_fun_gives_the_linen_routes_true_norms():
    """A linen model through nn.Module.apply wrapped as fun: the same true norms as the linen route."""
    nn = pytest.importorskip("flax.linen")

    class Lm(nn.Module):
        @nn.compact
        def __call__(self, ids):
            embed = nn.Embed(V, D, name="embed")
            h = nn.RMSNorm(name="norm")(embed(ids))
            h = h + nn.Dense(D, name="down")(jax.nn.gelu(nn.Dense(H, name="up")(h)))
            return embed.attend(nn.LayerNorm(name="final")(h))

    def lm_loss(apply, ids):
        logp = jax.nn.log_softmax(apply(ids)[:, :-1])
        return -jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0].mean(1)

    with jax.enable_x64(True):
        ids = lm_ids()
        model = Lm()
        params = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64),
                                        model.init(jax.random.key(1), ids)["params"])

        def fun(p, batch):
            return lm_loss(lambda x: model.apply({"params": p}, x), batch).mean()

        norms = per_example_norms(fun, params, ids)
        linen = assert_norms(model, params, lm_loss, ids, norms, max_grad_norm=1.0)
        program = assert_norms(fun, params, ids, norms, max_grad_norm=1.0)
    np.testing.assert_allclose(program.true_norms, norms, rtol=1e-9)
    np.testing.assert_allclose(program.true_norms, linen.true_norms, rtol=1e-10)
