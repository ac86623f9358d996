"""`ghost_oracle.jax`'s gates take the PyTorch twins' keyword arguments and do with them what the
PyTorch ones do: `epochs` and `dataset_size` count the run's steps as `ghost_oracle.check`
does (held against the CLI's formula), `max_memory` bounds the check, `batch_axis` 0 traces the
batch (claims from `jax.vmap(jax.grad)`), and a batch axis the Flax capture cannot follow is
refused by name before the model runs; an unknown keyword is refused as Python refuses one."""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax_models import norms_of, per_example_grads

from ghost_oracle.jax import assert_norms, assert_update


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="out")(jnp.tanh(nn.Dense(5, name="hidden")(x)))


def sq_loss(apply, x):
    return (apply(x) ** 2).sum(-1)


@pytest.fixture(scope="module")
def case():
    model = Mlp()
    x = jax.random.normal(jax.random.key(0), (4, 3))
    params = model.init(jax.random.key(1), x)["params"]
    norms = norms_of(per_example_grads(model, params, sq_loss, x))
    return model, params, x, norms


def test_epochs_and_dataset_size_count_the_steps_as_the_cli_does(case):
    model, params, x, norms = case
    report = assert_norms(model, params, sq_loss, x, norms, max_grad_norm=float(np.median(norms)), batch_axis=0,
                          sampling_rate=0.003, epochs=2.5, dataset_size=12345, delta=1e-6, max_memory="1G")
    # q·N = 37.035: a batch of 37, ⌈12345 / 37⌉ = 334 steps an epoch, 2.5 epochs ⌈835⌉
    assert report.privacy.steps == math.ceil(2.5 * math.ceil(12345 / round(0.003 * 12345))) == 835
    assert report.privacy.delta == 1e-6
    np.testing.assert_allclose(report.true_norms, norms, rtol=1e-5)


def test_max_memory_bounds_the_check(case):
    model, params, x, norms = case
    with pytest.raises(ValueError, match="max_memory"):
        assert_norms(model, params, sq_loss, x, norms, max_grad_norm=1.0, max_memory=1024)
    with pytest.raises(ValueError, match="max_memory"):
        assert_norms(model, params, sq_loss, x, norms, max_grad_norm=1.0, max_memory=0)


@pytest.mark.parametrize("batch_axis, needle", [
    (1, r"batch_axis=1 \(sequence × batch\): the JAX exporter follows the examples along axis 0 only"),
    (2, r"batch_axis must be 0 .*got 2"),
    (True, r"batch_axis must be 0 .*got True"),
])
def test_a_batch_axis_the_capture_cannot_follow_is_refused_before_the_model_runs(case, batch_axis, needle):
    model, params, x, norms = case
    calls = []

    def loss(apply, xx):
        calls.append(1)
        return sq_loss(apply, xx)

    with pytest.raises(ValueError, match=needle):
        assert_norms(model, params, loss, x, norms, max_grad_norm=1.0, batch_axis=batch_axis)
    with pytest.raises(ValueError, match=needle):
        assert_update(model, params, loss, x, params, max_grad_norm=1.0, noise_multiplier=0.0, batch_divisor=4.0,
                      batch_axis=batch_axis)
    assert calls == []


def test_an_unknown_keyword_is_refused_by_name(case):
    model, params, x, norms = case
    with pytest.raises(TypeError, match=r"assert_norms\(\) got an unexpected keyword argument 'epoch'"):
        assert_norms(model, params, sq_loss, x, norms, max_grad_norm=1.0, epoch=3)
