"""jax_privacy's own step judged: its exact norms, clipped sum and noisy update pass at σ 0 and
1, in f32 and x64, with microbatching and padding; the bugs of its history fail with the right
verdict (noise calibrated for the sum added to the mean, under-noise, an f16 norm that
underflows to 0), and BandMF is refused by name."""
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("jax_privacy")

import jax.numpy as jnp
import numpy as np
from jax_models import (
    TiedLM,
    batch,
    clipped_sum,
    init,
    lm_loss,
    norms_of,
    per_example_grads,
)
from jax_privacy import noise_addition
from safetensors import safe_open

import ghost_oracle
from ghost_oracle import jax_privacy as gj
from ghost_oracle.jax import assert_norms, assert_update

C = 0.5  # below every example's norm on this batch: every example is clipped


@pytest.fixture(scope="module")
def lm():
    model = TiedLM()
    ids = batch()
    return model, init(model, ids), ids


def _flat(tree):
    return ghost_oracle.jax.capture.flat_params(tree, "tree")


def test_norms_clipped_sum_and_update_pass_without_noise(lm):
    model, params, ids = lm
    step = gj.dp_step(model, params, lm_loss, ids, l2_clip_norm=C, noise_multiplier=0.0, normalize_by=len(ids))
    grads = per_example_grads(model, params, lm_loss, ids)
    norms = norms_of(grads)
    assert (norms > C).all()
    np.testing.assert_allclose(step.claimed_norms, norms, rtol=1e-5)  # the adapter reads jax_privacy's norms
    want = _flat(clipped_sum(grads, norms, C))
    for k, v in want.items():  # multiplied back by normalize_by: the oracle's Σ c_i g_i
        np.testing.assert_allclose(step.clipped_sum[k], v, rtol=1e-4, atol=1e-6)
    assert step.batch_divisor == len(ids)
    report = assert_update(model, params, lm_loss, ids, step.update, clipped_sum=step.clipped_sum,
                           claimed_norms=step.claimed_norms, max_grad_norm=C, noise_multiplier=0.0,
                           batch_divisor=step.batch_divisor)
    assert report.passed


def test_noisy_update_microbatched_with_padding_passes(lm):
    model, params, ids = lm
    pad = np.array([False, False, False, True])
    report = gj.assert_update(model, params, lm_loss, ids, l2_clip_norm=C, noise_multiplier=1.0,
                              normalize_by=3.0, microbatch_size=2, is_padding_example=pad)
    assert report.passed
    assert len(report.true_norms) == 3  # the padding example is not in the trace


def test_rescale_to_unit_norm_divides_by_c_too(lm):
    model, params, ids = lm
    step = gj.dp_step(model, params, lm_loss, ids, l2_clip_norm=C, noise_multiplier=1.0, normalize_by=4.0,
                      rescale_to_unit_norm=True)
    assert step.batch_divisor == pytest.approx(4.0 * C)
    assert gj.assert_norms(model, params, lm_loss, ids, l2_clip_norm=C).passed
    report = assert_update(model, params, lm_loss, ids, step.update, clipped_sum=step.clipped_sum, max_grad_norm=C,
                           noise_multiplier=1.0, batch_divisor=step.batch_divisor)
    assert report.passed


def test_x64_model_passes(tmp_path):
    with jax.enable_x64(True):
        model = TiedLM(dtype=jnp.float64, param_dtype=jnp.float64)
        ids = batch()
        params = init(model, ids)
        assert params["embed"]["embedding"].dtype == jnp.float64  # not Flax's default f32
        report = gj.assert_update(model, params, lm_loss, ids, l2_clip_norm=C, noise_multiplier=1.0,
                                  normalize_by=4.0, trace_path=tmp_path / "x64.safetensors")
        assert report.passed
    with safe_open(str(tmp_path / "x64.safetensors"), framework="np") as f:
        assert f.metadata()["compute_dtype"] == "f64"  # judged at f64, not at Flax's default f32


def test_noise_calibrated_for_the_sum_added_to_the_mean_is_flagged(lm):
    model, params, ids = lm
    step = gj.dp_step(model, params, lm_loss, ids, l2_clip_norm=C, noise_multiplier=0.0, normalize_by=4.0)
    key = jax.random.key(3)
    update = {}
    for k, v in step.clipped_sum.items():  # K/B + σCξ: noise for the sum, on the mean
        key, sub = jax.random.split(key)
        update[k] = v / 4.0 + C * 1.0 * np.asarray(jax.random.normal(sub, v.shape, v.dtype))
    with pytest.raises(ghost_oracle.ClippingCheckFailed) as e:
        assert_update(model, params, lm_loss, ids, update, clipped_sum=step.clipped_sum, max_grad_norm=C,
                      noise_multiplier=1.0, batch_divisor=4.0)
    assert e.value.report.verdict == "utility-distortion"  # B times the noise: safe, and wrong


def test_under_noise_is_a_privacy_violation(lm):
    model, params, ids = lm
    step = gj.dp_step(model, params, lm_loss, ids, l2_clip_norm=C, noise_multiplier=0.0, normalize_by=4.0)
    # jax_privacy's own privatizer at 1/B of the stated σ: its sensitivity is C/normalize_by
    priv = noise_addition.gaussian_privatizer(stddev=1.0 * C / 4.0 / 4.0, prng_key=5)
    summed = {k: v / 4.0 for k, v in step.clipped_sum.items()}
    noisy, _ = priv.update(summed, priv.init(summed))
    with pytest.raises(ghost_oracle.ClippingCheckFailed) as e:
        assert_update(model, params, lm_loss, ids, {k: np.asarray(v) for k, v in noisy.items()},
                      clipped_sum=step.clipped_sum, max_grad_norm=C, noise_multiplier=1.0, batch_divisor=4.0)
    assert e.value.report.verdict == "privacy-violation"


def test_f16_norm_that_underflows_leaves_examples_unclipped(lm):
    model, params, ids = lm
    grads = per_example_grads(model, params, lm_loss, ids)
    norms = norms_of(grads)
    # the norm taken in f16 after the gradients were scaled down (a loss scale, a tiny
    # learning-rate-folded loss): every square underflows, the norm is 0 and c = min(1, C/0) = 1
    scale = 1e-5
    f16 = np.sqrt(sum(np.sum(np.square((np.asarray(g) * scale).astype(np.float16)).reshape(len(ids), -1), 1)
                      .astype(np.float16) for g in jax.tree_util.tree_leaves(grads)).astype(np.float32)) / scale
    assert (f16 == 0).all()
    with pytest.raises(ghost_oracle.ClippingCheckFailed) as e:
        assert_norms(model, params, lm_loss, ids, f16, max_grad_norm=C)
    report = e.value.report
    assert report.verdict == "privacy-violation"
    assert max(report.sensitivity) == pytest.approx(norms.max() / C, rel=1e-4)


def test_bandmf_is_refused_by_name(lm):
    model, params, ids = lm
    with pytest.raises(ValueError, match="BandMF"):
        gj.dp_step(model, params, lm_loss, ids, l2_clip_norm=C, noise_multiplier=1.0, num_bands=4)
