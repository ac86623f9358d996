"""The JAX exporter on a tiny tied Flax LM: Embed lookups and attend (two sites of one
parameter), a 1×T position lookup, a module called twice; exact norms pass and a clipper that
drops the tied cross term fails as a privacy violation. The self-check both exporters share
(`ghost_oracle._trace.check`) held on it as the PyTorch tests hold it (test_export.py): forced
into the sketch of 1B-class parameters it passes and refuses a handler 0.1 % off, naming the
parameter; the tied table checked a few vocabulary rows at a time passes and refuses as whole."""
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")


import numpy as np
from jax_models import TiedLM, batch, init, lm_loss, true_norms, untied_params
from safetensors import safe_open

import ghost_oracle
from ghost_oracle._trace import check as C
from ghost_oracle._trace.format import TraceExportError
from ghost_oracle.jax import assert_norms, export_trace
from ghost_oracle.jax.kinds import dense, embed


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


# ---------------------------------------------------------------------------------------------
# The shared self-check on the JAX route: blocks of rows and the sketch.

def scaled(monkeypatch, cls, kind, factor=1.001):
    """`cls`'s handler with the backprops of its sites of `kind` scaled by `factor`."""
    sites = cls.sites

    def wrong(self, call, b):
        out = sites(self, call, b)
        for s in out:
            if s.kind == kind:
                s.tensors = {**s.tensors, "backprops": s.tensors["backprops"] * factor}
        return out

    monkeypatch.setattr(cls, "sites", wrong)


def export(lm, path):
    model, params, ids, norms = lm
    return export_trace(model, params, lm_loss, ids, path, claimed_norms=norms, max_grad_norm=float(np.median(norms)))


def test_the_sketched_check_passes_the_tied_lm_and_refuses_handlers_0_1_percent_off(lm, tmp_path, monkeypatch):
    monkeypatch.setattr(C, "FULL_CHECK_PRODUCTS", 0)
    monkeypatch.setattr(C, "_BLOCK_ENTRIES", 20)
    probe = C._probe_matrix
    sketched = []
    monkeypatch.setattr(C, "_probe_matrix", lambda uses, numel: sketched.append((uses, v := probe(uses, numel))) or v)
    path = tmp_path / "t.safetensors"
    specs = export(lm, path)
    report = ghost_oracle.check(str(path))
    assert report.passed, report.explain()
    np.testing.assert_allclose(report.true_norms, lm[3], rtol=1e-5)
    # every parameter with a matrix product is sketched, the tied table among them
    with_products = {s["param"] for s in specs if s["kind"] in ("linear", "conv1d")}
    assert {uses[0].param for uses, v in sketched if v is not None} == with_products
    assert "embed.embedding" in with_products
    # a Dense kernel's gradient 0.1 % off, and the tied table's lookup gradient 0.1 % off
    for cls, kind, param in ((dense.Dense, "conv1d", "mlp.kernel"), (embed.EmbedLookup, "embedding",
                                                                      "embed.embedding")):
        with monkeypatch.context() as m:
            scaled(m, cls, kind)
            with pytest.raises(TraceExportError, match=rf"parameter `{param}`: .*differs from jax.grad's through a ±1 "
                                                       "probe matrix"):
                export(lm, tmp_path / "u.safetensors")
        assert not (tmp_path / "u.safetensors").exists()


def test_the_tied_table_checked_in_blocks_of_a_few_rows_passes_and_refuses_as_whole(lm, tmp_path, monkeypatch):
    monkeypatch.setattr(C, "_BLOCK_ENTRIES", 7)  # a block is one vocabulary row of 8 entries
    blocks = C._blocks
    seen = {}
    monkeypatch.setattr(C, "_blocks", lambda uses: seen.setdefault(uses[0].param, blocks(uses)))
    path = tmp_path / "t.safetensors"
    export(lm, path)
    assert ghost_oracle.check(str(path)).passed
    vocab = lm[1]["embed"]["embedding"].shape[0]
    assert seen["embed.embedding"] == [(i, i + 1) for i in range(vocab)]
    scaled(monkeypatch, embed.EmbedLookup, "embedding")
    with pytest.raises(TraceExportError, match=r"parameter `embed.embedding`: .*differs from jax.grad's at \d+ of "
                                               rf"{vocab * 8} entries"):
        export(lm, tmp_path / "u.safetensors")
