"""jax_privacy's own input judged: `assert_step(fun, params, batch, ...)` runs jax_privacy's
`clipped_grad` and `gaussian_privatizer` on the function it clips and judges them through the
program route, on the tied LM written six ways (`jax_frontends`: jnp, linen, NNX, Keras 3, Equinox,
Haiku), in f32 and x64:
σ 0 and σ 1 pass, the norms and clipped sum jax_privacy gives are the `jax.vmap(jax.grad)` ones,
and a privatizer that adds half the noise fails as a privacy violation. `shadow()` judges every
call of a function `clipped_grad` returned while it is active: a correct call passes, a norm
planted 0.1 % low (in jax_privacy's own norm, so its clipping uses it too) is reported, and the
patch is gone after the block, also when the block raises."""
from __future__ import annotations

import json

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("jax_privacy")

import functools  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import jax_frontends as F  # noqa: E402
import jax_privacy  # noqa: E402
import numpy as np  # noqa: E402
from jax_privacy import clipping, noise_addition  # noqa: E402

import ghost_oracle  # noqa: E402
from ghost_oracle import jax_privacy as gj  # noqa: E402

PRECISIONS = {"f32": False, "x64": True}


@functools.cache
def _case(front_end: str, x64: bool):
    """(the tied LM, its ids, its per-example gradients in its own pytree form, their norms);
    call under `jax.enable_x64(x64)`."""
    built, ids = F.build(front_end, "lm", jnp.float64 if x64 else jnp.float32)
    grads = jax.vmap(jax.grad(lambda p, x: built.fun(p, x[None])), in_axes=(None, 0))(built.params, ids)
    return built, ids, grads, F.norms_of(F.per_example_grads(built, ids))


def _assert_tree_close(got, want, rtol: float, atol: float) -> None:
    got_leaves, got_def = jax.tree_util.tree_flatten(got)
    want_leaves, want_def = jax.tree_util.tree_flatten(want)
    assert got_def == want_def
    for g, w in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=rtol, atol=atol)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("front_end", F.FRONT_ENDS)
def test_assert_step_passes_at_sigma_0_and_1(front_end, precision):
    x64 = PRECISIONS[precision]
    with jax.enable_x64(x64):
        built, ids, grads, norms = _case(front_end, x64)
        c = 0.5 * float(np.median(norms))  # some examples clipped, some not
        step = gj.fun_step(built.fun, built.params, ids, l2_clip_norm=c, noise_multiplier=0.0, normalize_by=F.B,
                           key=0)
        # Keras' RMS norm computes in f32 even under x64: that program is f32-accurate
        exact = x64 and front_end != "keras"
        rtol = 1e-10 if exact else 1e-5
        np.testing.assert_allclose(step.claimed_norms, norms, rtol=rtol)  # jax_privacy's norms, read back
        coef = np.minimum(1.0, c / norms)
        want = jax.tree_util.tree_map(lambda g: np.tensordot(coef, np.asarray(g, np.float64), 1), grads)
        _assert_tree_close(step.clipped_sum, want, rtol, 1e-12 if exact else 1e-6)  # Σ c_i g_i, times D
        assert step.batch_divisor == F.B
        for sigma, key in ((0.0, 0), (1.0, 7)):
            report = gj.assert_step(built.fun, built.params, ids, l2_clip_norm=c, noise_multiplier=sigma,
                                    normalize_by=F.B, key=key)
            assert report.passed
            np.testing.assert_allclose(report.true_norms, norms, rtol=1e-9 if exact else 1e-4)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("front_end", F.FRONT_ENDS)
def test_under_noised_step_fails(front_end, precision, monkeypatch):
    x64 = PRECISIONS[precision]
    original = noise_addition.gaussian_privatizer

    def half_noise(*, stddev, **kwargs):  # a privatizer that adds half the noise it is asked for
        return original(stddev=0.5 * stddev, **kwargs)

    monkeypatch.setattr(noise_addition, "gaussian_privatizer", half_noise)
    with jax.enable_x64(x64):
        built, ids, _, norms = _case(front_end, x64)
        with pytest.raises(ghost_oracle.ClippingCheckFailed) as e:
            gj.assert_step(built.fun, built.params, ids, l2_clip_norm=0.5 * float(norms.min()), noise_multiplier=1.0,
                           normalize_by=F.B, key=3)
    assert e.value.report.verdict == "privacy-violation"


def test_single_example_fun_with_keep_batch_dim_false():
    """jax_privacy with keep_batch_dim=False hands fun one example without its batch axis."""
    built, ids, _, norms = _case("jnp", False)

    def one(p, example):
        return built.fun(p, example[None])

    report = gj.assert_step(one, built.params, ids, l2_clip_norm=0.5 * float(norms.min()), noise_multiplier=1.0,
                            normalize_by=F.B, key=1, keep_batch_dim=False)
    np.testing.assert_allclose(report.true_norms, norms, rtol=1e-4)


def _low_norm(monkeypatch, factor: float) -> None:
    """jax_privacy's own per-example norm scaled by `factor`: the norms it returns and the ones
    it clips by (both are optax.global_norm in jax_privacy.clipping)."""
    norm = clipping.optax.global_norm
    monkeypatch.setattr(clipping.optax, "global_norm", lambda tree: factor * norm(tree))


def test_shadow_judges_every_call_and_reports_a_wrong_norm(monkeypatch, tmp_path):
    built, ids, _, norms = _case("jnp", False)
    c = 0.5 * float(norms.min())
    original = clipping.clipped_grad
    log = tmp_path / "shadow.jsonl"
    with gj.shadow(on_failure="record", report=log) as session:
        assert clipping.clipped_grad is not original and jax_privacy.clipped_grad is not original
        grad_fn = clipping.clipped_grad(built.fun, l2_clip_norm=c, normalize_by=F.B, return_grad_norms=True)
        assert grad_fn.sensitivity() == pytest.approx(c / F.B)  # still jax_privacy's callable: C / normalize_by
        _, aux = grad_fn(built.params, ids)
        np.testing.assert_allclose(np.asarray(aux.grad_norms), norms, rtol=1e-5)
        # no norms returned: the clipped sum alone is judged
        jax_privacy.clipped_grad(built.fun, l2_clip_norm=c, normalize_by=F.B)(built.params, ids)
        jax.jit(grad_fn)(built.params, ids)  # abstract values: skipped with the reason
        with monkeypatch.context() as m:
            _low_norm(m, 1 - 1e-3)
            bad = clipping.clipped_grad(built.fun, l2_clip_norm=c, normalize_by=F.B, return_grad_norms=True)
            bad(built.params, ids)
    assert clipping.clipped_grad is original and jax_privacy.clipped_grad is original
    outcomes = session.outcomes
    assert [o.outcome for o in outcomes] == ["judged", "judged", "skipped", "judged"]
    assert [o.verdict for o in outcomes] == ["pass", "pass", None, "privacy-violation"]
    assert "JAX transformation" in outcomes[2].message
    assert outcomes[0].max_rel_err < 1e-5 and outcomes[3].max_rel_err == pytest.approx(1e-3, rel=1e-2)
    assert session.failures == [outcomes[3]]
    assert session.summary.judged == 3 and session.summary.passed == 2 and session.summary.failed == 1
    assert any(line.startswith("passed: 2; failed: 1") for line in session.summary.lines())
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["verdict"] for x in lines] == ["pass", "pass", None, "privacy-violation"]


def test_shadow_raises_at_the_wrong_call_and_restores_on_error(monkeypatch):
    built, ids, _, norms = _case("jnp", False)
    c = 0.5 * float(norms.min())
    original = clipping.clipped_grad
    _low_norm(monkeypatch, 1 - 1e-3)
    with pytest.raises(ghost_oracle.ShadowCheckFailed) as e, gj.shadow():
        clipping.clipped_grad(built.fun, l2_clip_norm=c, normalize_by=F.B, return_grad_norms=True)(built.params, ids)
    assert e.value.report.verdict == "privacy-violation"
    assert clipping.clipped_grad is original and jax_privacy.clipped_grad is original
    with pytest.raises(RuntimeError, match="the block's own error"), gj.shadow(on_failure="record"):
        assert clipping.clipped_grad is not original
        raise RuntimeError("the block's own error")
    assert clipping.clipped_grad is original and jax_privacy.clipped_grad is original


def test_shadow_refuses_what_it_cannot_judge_by_name():
    built, ids, _, norms = _case("jnp", False)
    with gj.shadow(on_failure="record") as session:
        clipping.clipped_grad(lambda x, p: built.fun(p, x), argnums=1, batch_argnums=0,
                              l2_clip_norm=1.0)(ids, built.params)
    (o,) = session.outcomes
    assert o.outcome == "refused" and "argnums=1" in o.message
    with pytest.raises(ValueError, match="on_failure"):
        gj.shadow(on_failure="loud")
