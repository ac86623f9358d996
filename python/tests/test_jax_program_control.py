"""The program route through JAX's control flow and transformations: a scan over stacked layers
(each layer a parameter `name[l]`, the claimed step given stacked), a per-example cond, remat,
custom_jvp (jax.nn.relu, gelu) and custom_vjp, jit, fori_loop with static bounds, and a fun
that vmaps over the sequence (the Equinox idiom). Truth: jax.vmap(jax.grad(...)) of each
example's own loss, all in x64."""
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax_programs import B, V, lm_ids, per_example_norms

from ghost_oracle.jax import assert_norms, assert_update, export_trace

L, D = 3, 4


def stacked_params():
    k = jax.random.split(jax.random.key(11), 4)
    return {"embed": jax.random.normal(k[0], (V, D), jnp.float64),
            "layers": {"w": jax.random.normal(k[1], (L, D, D), jnp.float64) / 2,
                       "gain": 0.1 * jax.random.normal(k[2], (L, D), jnp.float64)}}


def rms(h):
    return h / jnp.sqrt((h * h).mean(-1, keepdims=True) + 1e-6)


def lm_head_loss(p, h, ids):
    logp = jax.nn.log_softmax((h @ p["embed"].T)[..., :-1, :])
    return -jnp.take_along_axis(logp, ids[..., 1:, None], -1).mean()


def scanned(p, ids):
    def layer(h, lp):
        return h + jax.nn.relu(rms(h) * (1 + lp["gain"]) @ lp["w"]), None

    h, _ = lax.scan(layer, p["embed"][ids], p["layers"])
    return lm_head_loss(p, h, ids)


def test_scan_over_stacked_layers_names_each_layer_and_takes_the_step_stacked(tmp_path):
    with jax.enable_x64(True):
        params, ids = stacked_params(), lm_ids()
        norms = per_example_norms(scanned, params, ids)
        specs = export_trace(scanned, params, ids, tmp_path / "scan.safetensors", max_grad_norm=1.0)
        assert [s["param"] for s in specs] == (["embed"] + [f"layers.{n}[{i}]" for i in range(L)
                                                            for n in ("gain", "w")] + ["embed"])
        c = float(np.median(norms))
        grads = jax.vmap(jax.grad(scanned), in_axes=(None, 0))(params, ids[:, None])
        scale = np.minimum(1.0, c / norms)
        clipped = jax.tree_util.tree_map(lambda g: jnp.tensordot(jnp.asarray(scale), g, 1), grads)
        update = jax.tree_util.tree_map(lambda s: s / B, clipped)
        report = assert_update(scanned, params, ids, update, max_grad_norm=c, noise_multiplier=0.0, batch_divisor=B,
                               clipped_sum=clipped, claimed_norms=norms)
        np.testing.assert_allclose(report.true_norms, norms, rtol=1e-9)
        # the same step keyed by the trace's names, layer by layer
        by_name = {"embed": update["embed"], **{f"layers.{n}[{i}]": update["layers"][n][i] for i in range(L)
                                                 for n in ("gain", "w")}}
        assert_update(scanned, params, ids, by_name, max_grad_norm=c, noise_multiplier=0.0, batch_divisor=B,
                      claimed_norms=norms)
        wrong = jax.tree_util.tree_map(lambda u: u, update)
        wrong["layers"]["w"] = wrong["layers"]["w"].at[1, 0, 0].add(1e-3)
        with pytest.raises(AssertionError):
            assert_update(scanned, params, ids, wrong, max_grad_norm=c, noise_multiplier=0.0, batch_divisor=B,
                          clipped_sum=clipped, claimed_norms=norms)


@jax.custom_vjp
def matmul(x, w):
    return x @ w


matmul.defvjp(lambda x, w: (x @ w, (x, w)),
              lambda res, g: (g @ res[1].T, jnp.einsum("...i,...j->ij", res[0], g)))


@jax.custom_jvp
def scaled(x, w):
    return x * w


scaled.defjvp(lambda primals, tangents: (scaled(*primals), tangents[0] * primals[1] + primals[0] * tangents[1]))


def transformed(p, ids):
    """One sequence (keep_batch_dim=False: clipped_grad vmaps fun over the examples): a cond on
    the example's first id, remat, jit, custom_vjp and custom_jvp around parameter uses,
    gelu/relu, a fori_loop over layers."""
    h = p["embed"][ids]
    w = p["layers"]["w"]

    @jax.checkpoint
    def block(h):
        return h + jax.nn.gelu(matmul(rms(h), w[0]))

    h = block(h)
    h = jax.jit(lambda h, w1: jax.nn.relu(scaled(h, 1 + p["layers"]["gain"][0]) @ w1))(h, w[1])
    h = lax.cond(ids[0] % 2 == 0, lambda h: h @ w[2], lambda h: jnp.tanh(h) * p["layers"]["gain"][2], h)
    h = lax.fori_loop(0, 2, lambda i, h: rms(h) * (1 + p["layers"]["gain"][i]), h)  # static bounds: a scan
    return lm_head_loss(p, h, ids)


def test_cond_remat_jit_custom_rules_and_a_static_fori_loop():
    with jax.enable_x64(True):
        params, ids = stacked_params(), lm_ids()
        assert len({int(i) % 2 for i in ids[:, 0]}) == 2  # both branches taken in the batch
        grads = jax.vmap(jax.grad(transformed), in_axes=(None, 0))(params, ids)
        norms = np.sqrt(sum(np.sum(np.asarray(g).reshape(B, -1) ** 2, 1) for g in jax.tree_util.tree_leaves(grads)))
        report = assert_norms(transformed, params, ids, norms, max_grad_norm=float(np.median(norms)),
                              keep_batch_dim=False)
        np.testing.assert_allclose(report.true_norms, norms, rtol=1e-9)


def vmapped(p, ids):
    """The Equinox idiom: the model sees one sequence position at a time under vmap."""
    def position(i):
        h = rms(p["embed"][i]) * (1 + p["layers"]["gain"][0])
        return h + jnp.tanh(h @ p["layers"]["w"][0])

    h = jax.vmap(jax.vmap(position))(ids)
    return lm_head_loss(p, h, ids)


def test_fun_that_vmaps_over_the_sequence():
    with jax.enable_x64(True):
        params, ids = stacked_params(), lm_ids()
        norms = per_example_norms(vmapped, params, ids)
        with pytest.warns(UserWarning, match=r"`layers.w\[1\]` received no gradient"):  # layer 0 alone is used
            report = assert_norms(vmapped, params, ids, norms, max_grad_norm=1.0)
        np.testing.assert_allclose(report.true_norms, norms, rtol=1e-9)
