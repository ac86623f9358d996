"""Refused by name, never written as a wrong trace: a parameter used outside any modelled
module, bad arguments; padding examples are left out. (Transformations inside the model,
nn.scan and nn.vmap: test_jax_scan.py.)"""
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from jax_models import norms_of, per_example_grads

from ghost_oracle.jax import TraceExportError, assert_norms, export_trace


class WithRawScale(nn.Module):
    @nn.compact
    def __call__(self, x):
        gain = self.param("gain", nn.initializers.ones, (4,))
        return (nn.Dense(4, name="dense")(x) * gain).sum(-1)


def loss(apply, x):
    return apply(x) ** 2


X = jax.random.normal(jax.random.key(0), (3, 4))


def test_unmodelled_parameter_is_refused_by_name(tmp_path):
    model = WithRawScale()
    params = model.init(jax.random.key(1), X)["params"]
    with pytest.raises(TraceExportError, match="parameter `gain`") as e:
        export_trace(model, params, loss, X, tmp_path / "t.safetensors", claimed_norms=np.ones(3), max_grad_norm=1.0)
    # the message lists what is modelled from the registry of kinds, every class and method of it
    listed = str(e.value).split("by exact class (", 1)[1].split(")", 1)[0].split(", ")
    for modelled in ("Dense", "DenseGeneral", "Einsum", "Embed", "Embed.attend", "LayerNorm", "RMSNorm", "Conv",
                     "gemma's Embedder.encode", "gemma's Embedder.decode"):
        assert modelled in listed, str(e.value)


def test_bad_arguments_name_the_argument(tmp_path):
    model = WithRawScale()
    params = model.init(jax.random.key(1), X)["params"]
    with pytest.raises(ValueError, match="max_grad_norm"):
        export_trace(model, params, loss, X, tmp_path / "t.safetensors", claimed_norms=np.ones(3), max_grad_norm=-1)
    with pytest.raises(ValueError, match="claimed_norms"):
        assert_norms(nn.Dense(1), {"kernel": jnp.ones((4, 1)), "bias": jnp.zeros(1)},
                     lambda apply, x: apply(x)[:, 0], X, np.ones(2), max_grad_norm=1.0)


def test_padding_examples_are_left_out():
    model = nn.Dense(2)
    params = model.init(jax.random.key(1), X)["params"]

    def dense_loss(apply, x):
        return (apply(x) ** 2).sum(-1)

    norms = norms_of(per_example_grads(model, params, dense_loss, X))
    pad = np.array([False, True, False])
    claimed = norms.copy()
    claimed[1] = 0.0  # a padding example's claim is not judged
    report = assert_norms(model, params, dense_loss, X, claimed, max_grad_norm=float(norms.min()) / 2,
                          is_padding_example=pad)
    np.testing.assert_allclose(report.true_norms, norms[~pad], rtol=1e-5)
