"""The program route judges each use at the precision the program computes it in: a float32
island under x64 (the Keras 3 `ops.mean` case: f64 parameters cast down for the MLP) gives f32
sites there and f64 elsewhere; a bfloat16 tied LM is judged at bf16. Also `is_padding_example`.
Truth: jax.vmap(jax.grad(...)) of each example's own loss, of the program as written."""
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp
import numpy as np
from jax_programs import B, lm_ids, lm_params, per_example_norms, rms, tied_lm
from safetensors import safe_open

import ghost_oracle
from ghost_oracle.jax import assert_norms, export_trace


def island(p, ids):
    """The tied LM with its MLP computed in float32 under x64."""
    h = rms(p["embed"][ids]) * (1 + p["norm"])
    up = h.astype(jnp.float32) @ p["mlp"]["up"].astype(jnp.float32) + p["mlp"]["bias"].astype(jnp.float32)
    h = h + (jax.nn.gelu(up) @ p["mlp"]["down"].astype(jnp.float32)).astype(jnp.float64)
    logp = jax.nn.log_softmax((rms(h) @ p["embed"].T)[:, :-1])
    return -jnp.take_along_axis(logp, ids[:, 1:, None], -1).mean()


def test_a_float32_island_under_x64_is_judged_in_float32_there(tmp_path):
    with jax.enable_x64(True):
        params, ids = lm_params(jnp.float64), lm_ids()
        norms = per_example_norms(island, params, ids)
        path = tmp_path / "island.safetensors"
        export_trace(island, params, ids, path, max_grad_norm=1.0, claimed_norms=norms)
        with safe_open(str(path), framework="np") as f:
            dtypes = {k.rsplit(".", 1)[0]: f.get_tensor(k).dtype for k in f.keys() if k.endswith(".activations")}
        assert dtypes == {"norm": np.float64, "mlp.up": np.float32, "mlp.down": np.float32, "embed@1": np.float64}
        report = ghost_oracle.check(str(path))
        assert report.passed, report.explain()
        np.testing.assert_allclose(report.true_norms, norms, rtol=1e-6)
        low = norms.copy()
        low[2] *= 1 - 1e-3
        with pytest.raises(ghost_oracle.ClippingCheckFailed):
            assert_norms(island, params, ids, low, max_grad_norm=float(np.median(norms)))


def test_a_bfloat16_program_is_judged_at_bfloat16():
    params = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), lm_params(jnp.float32))
    ids = lm_ids()
    norms = per_example_norms(tied_lm, params, ids)
    report = assert_norms(tied_lm, params, ids, norms, max_grad_norm=1.0)
    np.testing.assert_allclose(report.true_norms, norms, rtol=2e-2)  # bf16's own rounding of the truth
    with pytest.raises(ghost_oracle.ClippingCheckFailed):
        assert_norms(tied_lm, params, ids, norms * (1 - 5e-2), max_grad_norm=1.0)


def test_padding_examples_are_left_out(tmp_path):
    with jax.enable_x64(True):
        params, ids = lm_params(jnp.float64), lm_ids()
        norms = per_example_norms(tied_lm, params, ids)
        pad = np.zeros(B, dtype=bool)
        pad[1] = True
        path = tmp_path / "pad.safetensors"
        export_trace(tied_lm, params, ids, path, max_grad_norm=1.0, claimed_norms=norms, is_padding_example=pad)
        report = ghost_oracle.check(str(path))
    assert report.passed, report.explain()
    np.testing.assert_allclose(report.true_norms, norms[~pad], rtol=1e-9)
