"""How the program route lays a parameter out in its sites: a lookup of one row by a scalar id
(dynamic_slice) and a clamping gather (mode="clip"), an NCHW/OIHW convolution with padding,
stride and dilation, and an einsum whose kernel's free axes straddle its contracted one (the
Gemma `BTD,NDH->BTNH` projection: a linear site through a permutation of the kernel, the
claimed step permuted the same way). Truth: jax.vmap(jax.grad(...)), x64."""
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

import ghost_oracle
from ghost_oracle.jax import assert_update, export_trace

B = 4


def norms_of(grads):
    return np.sqrt(sum(np.sum(np.asarray(g).reshape(B, -1) ** 2, 1) for g in jax.tree_util.tree_leaves(grads)))


def checked(fun, params, batch, path, **kw):
    keep = kw.get("keep_batch_dim", True)
    examples = jax.tree_util.tree_map(lambda a: a[:, None], batch) if keep else batch
    norms = norms_of(jax.vmap(jax.grad(fun), in_axes=(None, 0))(params, examples))
    specs = export_trace(fun, params, batch, path, max_grad_norm=1.0, claimed_norms=norms, **kw)
    report = ghost_oracle.check(str(path))
    assert report.passed, report.explain()
    np.testing.assert_allclose(report.true_norms, norms, rtol=1e-9)
    return specs


def test_scalar_lookup_and_clamping_gather(tmp_path):
    with jax.enable_x64(True):
        table = {"E": jax.random.normal(jax.random.key(0), (7, 3))}

        def one(p, i):  # one id per example (keep_batch_dim=False): E[i] is a dynamic_slice
            rows = jnp.take(p["E"], jnp.stack([i, i + 9]), axis=0, mode="clip")  # i + 9 clamps to the last row
            return jnp.sum(jnp.tanh(p["E"][i]) ** 2) + jnp.sum(rows ** 3)

        specs = checked(one, table, jnp.array([1, 5, 0, 6]), tmp_path / "ids.safetensors", keep_batch_dim=False)
    assert [(s["name"], s["kind"]) for s in specs] == [("E", "embedding"), ("E@1", "embedding")]


def test_nchw_convolution_with_padding_stride_and_dilation(tmp_path):
    with jax.enable_x64(True):
        k = jax.random.split(jax.random.key(1), 3)
        params = {"K": jax.random.normal(k[0], (4, 2, 3, 3)) / 3, "W": jax.random.normal(k[1], (4, 2))}

        def nchw(p, x):
            h = jax.lax.conv_general_dilated(x, p["K"], (2, 1), [(1, 1), (0, 2)], rhs_dilation=(1, 2),
                                             dimension_numbers=("NCHW", "OIHW", "NCHW"))
            return jnp.mean(jnp.tanh(h).mean((2, 3)) @ p["W"])

        specs = checked(nchw, params, jax.random.normal(k[2], (B, 2, 6, 5)), tmp_path / "conv.safetensors")
    assert [(s["name"], s["kind"]) for s in specs] == [("K", "conv1d"), ("W", "conv1d")]


def test_a_kernel_whose_free_axes_straddle_the_contracted_one_and_its_permuted_step(tmp_path):
    with jax.enable_x64(True):
        k = jax.random.split(jax.random.key(2), 2)
        params = {"q": jax.random.normal(k[0], (2, 3, 4)) / 2}  # N×D×H

        def proj(p, x):  # x B×T×D
            return jnp.mean(jnp.tanh(jnp.einsum("btd,ndh->btnh", x, p["q"])) ** 2)

        x = jax.random.normal(k[1], (B, 5, 3))
        path = tmp_path / "q.safetensors"
        specs = checked(proj, params, x, path)
        assert [(s["name"], s["kind"]) for s in specs] == [("q", "linear")]
        grads = jax.vmap(jax.grad(proj), in_axes=(None, 0))(params, x[:, None])
        norms = norms_of(grads)
        c = float(np.median(norms))
        clipped = {"q": np.tensordot(np.minimum(1.0, c / norms), np.asarray(grads["q"]), 1)}
        assert_update(proj, params, x, {"q": clipped["q"] / B}, clipped_sum=clipped, max_grad_norm=c,
                      noise_multiplier=0.0, batch_divisor=B, trace_path=path)
        with safe_open(str(path), framework="np") as f:  # out×in: (N·H)×D, the kernel's own N×D×H permuted
            np.testing.assert_array_equal(f.get_tensor("claimed.clipped_sum.q").reshape(2, 4, 3),
                                          np.transpose(clipped["q"], (0, 2, 1)))
        wrong = clipped["q"].copy()
        wrong[1, 2, 3] += 1e-3
        with pytest.raises(ghost_oracle.ClippingCheckFailed):
            assert_update(proj, params, x, {"q": wrong / B}, clipped_sum={"q": wrong}, max_grad_norm=c,
                          noise_multiplier=0.0, batch_divisor=B)
