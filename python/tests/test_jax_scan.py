"""nn.scan over layers: a tiny tied LM whose blocks are one nn.scan'd Block (parameters stacked
L×… on axis 0) is exported with each layer's calls as sites of their own, the stacked parameter
written as its L layers `layers.attn.q.kernel[l]`; norms and the claimed step are judged against
per-example gradients from jax.vmap(jax.grad(...)) of the scanned model itself. Scans the
exporter cannot replay exactly, and nn.vmap over the batch, are refused by name."""
import json

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from jax_models import (
    VOCAB,
    D,
    batch,
    clipped_sum,
    init,
    lm_loss,
    norms_of,
    per_example_grads,
    true_norms,
    untied_params,
)
from safetensors import safe_open

import ghost_oracle
from ghost_oracle.jax import TraceExportError, assert_norms, assert_update, export_trace

L = 3


class Attn(nn.Module):
    @nn.compact
    def __call__(self, x):
        q = nn.RMSNorm(name="q_norm")(nn.DenseGeneral((2, 4), name="q")(x))  # per-head norm
        o = nn.Dense(D, name="o")(q.reshape(*q.shape[:2], -1))
        return jnp.cumsum(o, 1) / jnp.arange(1, x.shape[1] + 1)[:, None]  # causal mixing over positions


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        h = h + Attn(name="attn")(nn.LayerNorm(name="ln")(h))
        mlp = nn.Dense(D, name="mlp")
        return h + mlp(jnp.tanh(mlp(h))), None  # one module, two uses in every layer


class ScanTiedLM(nn.Module):
    """Embed with attend as the head, a 1×T position lookup, L blocks by nn.scan, RMSNorm."""

    tied: bool = True

    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(VOCAB, D, name="embed")
        h = embed(ids) + nn.Embed(16, D, name="pos")(jnp.arange(ids.shape[1])[None])
        layers = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=L)
        h, _ = layers(name="layers")(h, None)
        h = nn.RMSNorm(name="final_norm")(h)
        return (embed if self.tied else nn.Embed(VOCAB, D, name="head")).attend(h)


@pytest.fixture(scope="module")
def lm():
    model = ScanTiedLM()
    ids = batch()
    params = init(model, ids)
    grads = per_example_grads(model, params, lm_loss, ids)
    return model, params, ids, grads, norms_of(grads)


def _np_tree(tree):
    return jax.tree_util.tree_map(np.array, tree)


def test_each_layer_is_its_own_sites_and_norms_and_step_are_exact(lm, tmp_path):
    model, params, ids, grads, norms = lm
    assert params["layers"]["attn"]["q"]["kernel"].shape == (L, D, 2, 4)  # stacked on axis 0
    c = float(np.median(norms))
    summed = clipped_sum(grads, norms, c)
    path = tmp_path / "scan.safetensors"
    specs = export_trace(model, params, lm_loss, ids, path, claimed_norms=norms, max_grad_norm=c,
                         clipped_sum=summed, update=jax.tree_util.tree_map(lambda v: v / 4, summed),
                         batch_divisor=4, noise_multiplier=0.0)
    names = [s["name"] for s in specs]
    for layer in range(L):
        assert f"layers.attn.q.kernel[{layer}]" in names
        assert f"layers.attn.q_norm.scale[{layer}]" in names
        assert f"layers.mlp.kernel[{layer}]@1" in names  # the second use within layer l
    assert not any(s["param"] == "layers.attn.q.kernel" for s in specs)
    with safe_open(str(path), framework="np") as f:
        parameters = json.loads(f.metadata()["parameters"])
        assert parameters["layers.attn.q.kernel[2]"] == D * 2 * 4  # one layer's slice
        assert "layers.attn.q.kernel" not in parameters
        for layer in range(L):  # the claimed step split slice by slice, in layer order
            np.testing.assert_allclose(f.get_tensor(f"claimed.clipped_sum.layers.attn.o.kernel[{layer}]"),
                                       np.asarray(summed["layers"]["attn"]["o"]["kernel"][layer]), rtol=1e-6)
        assert f.get_tensor("layers.ln.scale[1].activations").shape == (4, 6, D)
    report = ghost_oracle.check(str(path))
    assert report.passed, report.explain()
    np.testing.assert_allclose(report.true_norms, norms, rtol=1e-5)


def test_exact_norms_pass_and_a_dropped_cross_term_fails(lm):
    model, params, ids, _, norms = lm
    c = float(norms.min()) / 2
    assert assert_norms(model, params, lm_loss, ids, norms, max_grad_norm=c).passed
    # the clipper's norms: the head as a parameter of its own, √(‖g_embed‖² + ‖g_head‖²)
    dropped = true_norms(ScanTiedLM(tied=False), untied_params(params), lm_loss, ids)
    assert not np.allclose(dropped, norms, rtol=1e-4)
    with pytest.raises(ghost_oracle.ClippingCheckFailed) as e:
        assert_norms(model, params, lm_loss, ids, dropped, max_grad_norm=c)
    expected = "privacy-violation" if (dropped < norms).any() else "utility-distortion"
    assert e.value.report.verdict == expected, e.value.report.explain()


def test_layers_swapped_in_the_clipped_sum_fail(lm):
    model, params, ids, grads, norms = lm
    c = float(np.median(norms))
    summed = _np_tree(clipped_sum(grads, norms, c))
    update = jax.tree_util.tree_map(lambda v: v / 4, summed)
    assert assert_update(model, params, lm_loss, ids, update, clipped_sum=summed, max_grad_norm=c,
                         noise_multiplier=0.0, batch_divisor=4).passed
    q = summed["layers"]["attn"]["q"]["kernel"]
    q[[0, 1]] = q[[1, 0]]  # layer 0's clipped sum claimed for layer 1 and back
    with pytest.raises(ghost_oracle.ClippingCheckFailed):
        assert_update(model, params, lm_loss, ids, update, clipped_sum=summed, max_grad_norm=c, noise_multiplier=0.0,
                      batch_divisor=4)


@pytest.mark.parametrize("sigma", [0.0, 1.0])
def test_jax_privacy_step_passes(lm, sigma):
    pytest.importorskip("jax_privacy")
    from ghost_oracle import jax_privacy as gj

    model, params, ids, _, norms = lm
    report = gj.assert_update(model, params, lm_loss, ids, l2_clip_norm=0.5, noise_multiplier=sigma,
                              normalize_by=4.0)
    assert report.passed, report.explain()
    np.testing.assert_allclose(report.true_norms, norms, rtol=1e-5)


class _Step(nn.Module):
    @nn.compact
    def __call__(self, c, x):
        return jnp.tanh(nn.Dense(4, name="dense")(c)) + x, c.sum(-1)


class ScannedXs(nn.Module):
    """A scan over per-layer inputs on axis 1 of xs, run in reverse, with per-layer outputs."""

    scan: dict

    @nn.compact
    def __call__(self, x, xs):
        c, ys = nn.scan(_Step, split_rngs={"params": True}, **self.scan)(name="layers")(x, xs)
        return c.sum(-1) + ys.sum(0)


def sq_loss(apply, inputs):
    return apply(*inputs) ** 2


INPUTS = (jax.random.normal(jax.random.key(0), (3, 4)), jax.random.normal(jax.random.key(2), (3, 2, 4)))


def test_reversed_scan_over_inputs_on_axis_1():
    model = ScannedXs({"variable_axes": {"params": 0}, "in_axes": 1, "reverse": True})
    params = model.init(jax.random.key(1), *INPUTS)["params"]
    norms = norms_of(per_example_grads(model, params, sq_loss, INPUTS))
    report = assert_norms(model, params, sq_loss, INPUTS, norms, max_grad_norm=float(np.median(norms)))
    np.testing.assert_allclose(report.true_norms, norms, rtol=1e-5)
    with pytest.raises(ghost_oracle.ClippingCheckFailed):
        assert_norms(model, params, sq_loss, INPUTS, norms * 0.99, max_grad_norm=float(norms.min()) / 2)


@pytest.mark.parametrize(("scan", "why"), [
    ({"variable_broadcast": "params", "in_axes": 1}, r"broadcast to every layer"),
    ({"variable_axes": {"params": 1}, "in_axes": 1}, r"stacked on axis 1"),
])
def test_a_scan_not_stacking_params_on_axis_0_is_refused_by_name(scan, why, tmp_path):
    model = ScannedXs(scan)
    if "variable_broadcast" in scan:  # one Dense for every layer (Flax's init of it fails: layer 0's weights)
        stacked = ScannedXs({"variable_axes": {"params": 0}, "in_axes": 1}).init(jax.random.key(1), *INPUTS)
        params = jax.tree_util.tree_map(lambda v: v[0], stacked["params"])
    else:
        params = model.init(jax.random.key(1), *INPUTS)["params"]
    model.apply({"params": params}, *INPUTS)  # a model Flax runs
    with pytest.raises(TraceExportError, match=rf"module `layers` is an nn.scan whose .*{why}"):
        export_trace(model, params, sq_loss, INPUTS, tmp_path / "t.safetensors", claimed_norms=np.ones(3),
                     max_grad_norm=1.0)


class VmappedOverBatch(nn.Module):
    @nn.compact
    def __call__(self, x):
        dense = nn.vmap(nn.Dense, variable_axes={"params": None}, split_rngs={"params": False})
        return dense(4, name="dense")(x).sum(-1)


def test_nn_vmap_over_the_batch_is_refused_by_name(tmp_path):
    model = VmappedOverBatch()
    x = INPUTS[0]
    params = model.init(jax.random.key(1), x)["params"]
    with pytest.raises(TraceExportError, match=r"module `dense` \(Dense.__call__\) was called under nn.vmap"):
        export_trace(model, params, lambda apply, x: apply(x) ** 2, x, tmp_path / "t.safetensors",
                     claimed_norms=np.ones(3), max_grad_norm=1.0)


class _Inner(nn.Module):
    @nn.compact
    def __call__(self, c, _):
        return jnp.tanh(nn.Dense(4, name="dense")(c)), None


class _Outer(nn.Module):
    @nn.compact
    def __call__(self, c, _):
        inner = nn.scan(_Inner, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        c, _ = inner(name="inner")(c, None)
        return nn.LayerNorm(name="ln")(c), None


class ScanInScan(nn.Module):
    @nn.compact
    def __call__(self, x):
        outer = nn.scan(_Outer, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
        # one feature, not the sum: a LayerNorm's outputs sum to its bias whatever its input, so
        # the sum's gradient is rounding alone (cannot-judge once the trace carries it)
        return outer(name="outer")(x, None)[0][..., 0]


def test_a_scan_in_a_scan_is_split_on_both_axes(tmp_path):
    model = ScanInScan()
    x = INPUTS[0]
    params = model.init(jax.random.key(1), x)["params"]
    assert params["outer"]["inner"]["dense"]["kernel"].shape == (2, 3, 4, 4)

    def loss(apply, x):
        return apply(x) ** 2

    norms = norms_of(per_example_grads(model, params, loss, x))
    path = tmp_path / "nested.safetensors"
    specs = export_trace(model, params, loss, x, path, claimed_norms=norms, max_grad_norm=float(np.median(norms)))
    names = {s["name"] for s in specs}
    assert {f"outer.inner.dense.kernel[{i}][{j}]" for i in range(2) for j in range(3)} <= names
    assert {"outer.ln.scale[0]", "outer.ln.scale[1]"} <= names
    report = ghost_oracle.check(str(path))
    assert report.passed, report.explain()
    np.testing.assert_allclose(report.true_norms, norms, rtol=1e-5)
