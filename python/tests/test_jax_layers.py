"""The JAX exporter's linear kinds: nn.Einsum with an N-D kernel and a bias (one linear site,
the claimed step permuted to match), nn.Conv (a linear site over unfolded patches), and bf16
and f16 models judged at their own precision, each against per-example gradients from
jax.vmap(jax.grad(...))."""
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from jax_models import clipped_sum, norms_of, per_example_grads
from safetensors import safe_open

import ghost_oracle
from ghost_oracle.jax import assert_norms, assert_update, export_trace


class EinsumConv(nn.Module):
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, img):  # B×H×W×C
        h = nn.Conv(3, (3, 3), strides=(1, 2), padding="SAME", name="conv", dtype=self.dtype)(img)
        h = jnp.tanh(h).reshape(img.shape[0], -1, 3)  # B×R×3
        h = nn.Einsum((3, 2, 4), "brc,cnh->bnrh", name="proj", dtype=self.dtype)(h)  # kernel C×N×H
        return nn.Dense(1, name="out", dtype=self.dtype)(h.mean((1, 2)))[:, 0]


def sq_loss(apply, img):
    return apply(img).astype(jnp.float32) ** 2


@pytest.fixture(scope="module")
def case():
    model = EinsumConv()
    img = jax.random.normal(jax.random.key(0), (3, 4, 6, 2))
    params = model.init(jax.random.key(1), img)["params"]
    grads = per_example_grads(model, params, sq_loss, img)
    return model, params, img, grads, norms_of(grads)


def test_einsum_and_conv_sites_and_permuted_step(case, tmp_path):
    model, params, img, grads, norms = case
    c = float(np.median(norms))
    summed = clipped_sum(grads, norms, c)
    path = tmp_path / "layers.safetensors"
    specs = export_trace(model, params, sq_loss, img, path, claimed_norms=norms, max_grad_norm=c,
                         clipped_sum=summed, update={k: {n: v / 3 for n, v in d.items()} for k, d in summed.items()},
                         batch_divisor=3, noise_multiplier=0.0)
    kinds = {s["name"]: s["kind"] for s in specs}
    assert kinds == {"conv.kernel": "conv1d", "conv.bias": "bias", "proj.kernel": "conv1d", "proj.bias": "bias",
                     "out.kernel": "conv1d", "out.bias": "bias"}
    with safe_open(str(path), framework="np") as f:
        assert f.get_tensor("conv.kernel.activations").shape == (3, 4 * 3, 2 * 9)  # 4×3 positions, C·3·3
        assert f.get_tensor("proj.kernel.activations").shape == (3, 12, 3)
        assert f.get_tensor("proj.kernel.backprops").shape == (3, 12, 8)  # N·H
        k = f.get_tensor("claimed.clipped_sum.proj.kernel")  # C×(N·H): the kernel's own layout here
        np.testing.assert_allclose(k.reshape(-1), np.asarray(summed["proj"]["kernel"]).reshape(-1), rtol=1e-6)
        conv = f.get_tensor("claimed.clipped_sum.conv.kernel")  # permuted to (C_in, kh, kw, C_out)
        np.testing.assert_allclose(conv.reshape(-1), np.transpose(np.asarray(summed["conv"]["kernel"]),
                                                                  (2, 0, 1, 3)).reshape(-1), rtol=1e-6)
    report = ghost_oracle.check(str(path))
    assert report.passed, report.explain()
    np.testing.assert_allclose(report.true_norms, norms, rtol=1e-5)


def test_a_wrong_clipped_sum_entry_fails(case):
    model, params, img, grads, norms = case
    c = float(np.median(norms))
    summed = jax.tree_util.tree_map(np.array, clipped_sum(grads, norms, c))
    summed["proj"]["kernel"][0, 1, 2] += 0.05 * np.abs(summed["proj"]["kernel"]).max()
    with pytest.raises(ghost_oracle.ClippingCheckFailed):
        assert_update(model, params, sq_loss, img, {k: {n: v / 3 for n, v in d.items()} for k, d in summed.items()},
                      clipped_sum=summed, max_grad_norm=c, noise_multiplier=0.0, batch_divisor=3)


# f16 trains with a loss scale: unscaled, one example's output gradients here lie in f16's
# subnormal range, where no norm can be judged (the verdict is cannot-judge, not pass)
@pytest.mark.parametrize(("dtype", "precision", "loss_scale"),
                         [(jnp.bfloat16, "bf16", 1.0), (jnp.float16, "f16", 2.0**8)])
def test_low_precision_model_is_judged_at_its_precision(dtype, precision, loss_scale, tmp_path):
    model = EinsumConv(dtype=dtype)
    img = jax.random.normal(jax.random.key(0), (3, 4, 6, 2))
    params = model.init(jax.random.key(1), img)["params"]  # f32 weights, computed in `dtype`

    def loss(apply, img):
        return loss_scale * sq_loss(apply, img)

    norms = norms_of(per_example_grads(model, params, loss, img))
    path = tmp_path / f"{precision}.safetensors"
    report = assert_norms(model, params, loss, img, norms, max_grad_norm=float(np.median(norms)), trace_path=path)
    assert report.passed
    with safe_open(str(path), framework="np") as f:
        assert f.metadata()["compute_dtype"] == precision
        assert f.get_tensor("proj.kernel.activations").dtype == np.dtype(dtype)  # as the einsum saw them
        assert f.get_tensor("conv.kernel.backprops").dtype == np.dtype(dtype)
    with pytest.raises(ghost_oracle.ClippingCheckFailed) as e:
        assert_norms(model, params, loss, img, norms * 0.9, max_grad_norm=float(norms.min()) / 2)
    assert e.value.report.verdict == "privacy-violation"
