"""The JAX exporter runs the self-check both exporters share (`ghost_oracle._trace.check`), as
the PyTorch tests hold it (test_export.py): forced into the sketch of 1B-class parameters, the
tiny tied Flax LM passes with its true norms and a handler 0.1 % off is refused, naming the
parameter; its tied table checked a few vocabulary rows at a time passes and refuses as whole.
The truth is `jax.vmap(jax.grad)` of each example's own loss (`jax_models.true_norms`)."""
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")

import numpy as np  # noqa: E402
from jax_models import TiedLM, batch, init, lm_loss, true_norms  # noqa: E402

import ghost_oracle  # noqa: E402
from ghost_oracle._trace import check as C  # noqa: E402
from ghost_oracle._trace.format import TraceExportError  # noqa: E402
from ghost_oracle.jax import export_trace  # noqa: E402
from ghost_oracle.jax.kinds import dense, embed  # noqa: E402


@pytest.fixture(scope="module")
def lm():
    model = TiedLM()
    ids = batch()
    params = init(model, ids)
    return model, params, ids, true_norms(model, params, lm_loss, ids)


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
    monkeypatch.setattr(C, "_blocks", lambda uses, numel: seen.setdefault(uses[0].param, blocks(uses, numel)))
    path = tmp_path / "t.safetensors"
    export(lm, path)
    assert ghost_oracle.check(str(path)).passed
    vocab = lm[1]["embed"]["embedding"].shape[0]
    assert seen["embed.embedding"] == [(i, i + 1) for i in range(vocab)]
    scaled(monkeypatch, embed.EmbedLookup, "embedding")
    with pytest.raises(TraceExportError, match=r"parameter `embed.embedding`: .*differs from jax.grad's at \d+ of "
                                               rf"{vocab * 8} entries"):
        export(lm, tmp_path / "u.safetensors")
