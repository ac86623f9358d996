"""The JAX exporter on a tiny tied Flax LM: Embed lookups and attend (two sites of one
parameter), a 1×T position lookup, a module called twice; exact norms pass and a clipper that
drops the tied cross term fails as a privacy violation."""
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")


import numpy as np
from jax_models import TiedLM, batch, init, lm_loss, true_norms, untied_params
from safetensors import safe_open

import ghost_oracle
from ghost_oracle.jax import assert_norms, export_trace


@pytest.fixture(scope="module")
def lm():
    model = TiedLM()
    ids = batch()
    params = init(model, ids)
    return model, params, ids, true_norms(model, params, lm_loss, ids)


def test_tied_lm_sites_and_exact_norms(lm, tmp_path):
    model, params, ids, norms = lm
    path = tmp_path / "tied.safetensors"
    specs = export_trace(model, params, lm_loss, ids, path, claimed_norms=norms, max_grad_norm=float(np.median(norms)))
    by_param = {}
    for s in specs:
        by_param.setdefault(s["param"], []).append((s["name"], s["kind"]))
    assert by_param["embed.embedding"] == [("embed.embedding", "embedding"), ("embed.embedding@1", "linear")]
    assert by_param["mlp.kernel"] == [("mlp.kernel", "conv1d"), ("mlp.kernel@1", "conv1d")]
    assert by_param["q_norm.scale"] == [("q_norm.scale", "layernorm")]
    with safe_open(str(path), framework="np") as f:
        pos_ids = f.get_tensor("pos.embedding.ids")
        q_norm = f.get_tensor("q_norm.scale.activations")
    # the 1×T position lookup expanded to the batch: per-example rows, not the batch's sum
    assert pos_ids.shape == (4, 6) and (pos_ids == np.arange(6)).all()
    assert q_norm.shape == (4, 6 * 2, 4)  # per-head norm: T·H rows of head_dim
    report = ghost_oracle.check(str(path))
    assert report.passed, report.explain()
    np.testing.assert_allclose(report.true_norms, norms, rtol=1e-5)


def test_claim_half_a_percent_low_fails(lm):
    model, params, ids, norms = lm
    with pytest.raises(ghost_oracle.ClippingCheckFailed) as e:
        assert_norms(model, params, lm_loss, ids, norms * 0.995, max_grad_norm=float(norms.min()) / 2)
    assert e.value.report.verdict == "privacy-violation"


def test_dropped_cross_term_is_a_privacy_violation(lm):
    model, params, ids, norms = lm
    # the clipper's norms: the head as a parameter of its own, √(‖g_embed‖² + ‖g_head‖²)
    dropped = true_norms(TiedLM(tied=False), untied_params(params), lm_loss, ids)
    assert not np.allclose(dropped, norms, rtol=1e-4)
    c = float(norms.min()) / 2
    with pytest.raises(ghost_oracle.ClippingCheckFailed) as e:
        assert_norms(model, params, lm_loss, ids, dropped, max_grad_norm=c)
    report = e.value.report
    expected = "privacy-violation" if (dropped < norms).any() else "utility-distortion"
    assert report.verdict == expected, report.explain()
