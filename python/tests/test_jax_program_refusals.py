"""What the program route refuses, by a TraceExportError naming the parameter's key path and the
primitive (or, for fun's own shape, the argument): a parameter squared, reduced, in a
nonlinearity, negated, partly used, mapped over by vmap (batch dimensions on its side of a
dot_general), inside a while_loop; a fun whose batch loss is not the mean or sum of its
examples' own; bad arguments."""
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp
import numpy as np
from jax import lax

from ghost_oracle.jax import TraceExportError, assert_norms, export_trace

B = 3


def params():
    k = jax.random.split(jax.random.key(0), 2)
    return {"dense": {"w": jax.random.normal(k[0], (4, 4)), "b": jnp.zeros(4)},
            "heads": jax.random.normal(k[1], (2, 4, 4))}


def batch():
    return jax.random.normal(jax.random.key(1), (B, 5, 4))


def export(fun, tmp_path, **kw):
    return export_trace(fun, params(), batch(), tmp_path / "t.safetensors", max_grad_norm=1.0, **kw)


@pytest.mark.parametrize(("fun", "name", "primitive"), [
    (lambda p, x: jnp.sum(x @ p["dense"]["w"] ** 2), "dense.w", "integer_pow"),
    (lambda p, x: jnp.sum(x * p["dense"]["w"].sum(0)), "dense.w", "reduce_sum"),
    (lambda p, x: jnp.sum(x @ jnp.tanh(p["dense"]["w"])), "dense.w", "tanh"),
    (lambda p, x: jnp.sum(x / p["dense"]["b"]), "dense.b", "div"),
    (lambda p, x: jnp.sum(jnp.tanh(x - p["dense"]["b"])), "dense.b", "sub"),
    (lambda p, x: jnp.sum(x @ p["dense"]["w"][:, :2]), "dense.w", "dot_general"),
    (lambda p, x: jnp.sum(x @ (p["dense"]["w"] @ p["dense"]["w"].T)), "dense.w", "dot_general"),
], ids=["squared", "reduced", "nonlinearity", "divided", "negated", "part", "product-of-two-uses"])
def test_a_parameter_used_otherwise_is_refused_by_name(fun, name, primitive, tmp_path):
    with pytest.raises(TraceExportError, match=rf"parameter `{name}` is used by `{primitive}`"):
        export(fun, tmp_path)


def test_batch_dims_on_the_parameter_side_are_refused(tmp_path):
    def per_head(p, x):  # one weight per head, vmapped with each head's input: a batched dot_general
        return jnp.sum(jax.vmap(lambda w, h: h @ w)(p["heads"], jnp.stack([x, 2 * x])))

    with pytest.raises(TraceExportError, match=r"parameter `heads` is used by `dot_general`.*batch dimensions"):
        export(per_head, tmp_path)


def test_a_parameter_mapped_over_alone_is_a_site_not_a_refusal(tmp_path):
    """vmap over the weight only folds its mapped axis into the free ones: an ordinary use."""
    def per_head(p, x):
        return jnp.sum(jax.vmap(lambda w, h: h @ w, in_axes=(0, None))(p["heads"], x) ** 2)

    with pytest.warns(UserWarning, match="`dense.w` received no gradient"):
        specs = export(per_head, tmp_path)
    assert [(s["param"], s["kind"]) for s in specs] == [("heads", "linear")]


def test_a_parameter_in_a_while_loop_is_refused(tmp_path):
    def looped(p, x):
        return jnp.sum(lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] @ p["dense"]["w"]), (0, x))[1])

    with pytest.raises(TraceExportError, match=r"parameter `dense.w` is used by `while`.*while_loop"):
        export(looped, tmp_path)


def test_a_batch_loss_that_is_not_the_mean_or_sum_of_its_examples_is_refused(tmp_path):
    def normalised(p, x):  # divided by B²: each example's loss depends on how many others there are
        return jnp.sum(jnp.tanh(x @ p["dense"]["w"])) / x.shape[0] ** 2

    with pytest.raises(TraceExportError, match="neither the mean .* nor the sum"):
        export(normalised, tmp_path)

    def centred(p, x):  # batch statistics: an example alone is centred to 0
        h = x @ p["dense"]["w"]
        return jnp.mean((h - h.mean(0)) ** 2)

    with pytest.raises(TraceExportError, match="neither the mean .* nor the sum"):
        export(centred, tmp_path)


def test_bad_arguments_are_refused_by_name(tmp_path):
    def fine(p, x):
        return jnp.mean(jnp.tanh(x @ p["dense"]["w"] + p["dense"]["b"]))

    with pytest.raises(ValueError, match="batch_argnums=2"):
        export(fine, tmp_path, batch_argnums=2)
    with pytest.raises(TypeError, match="keep_batch_dim"):
        export(fine, tmp_path, keep_batch_dim=1)
    with pytest.raises(TraceExportError, match="leaf `step` is int32"):
        export_trace(fine, {**params(), "step": jnp.zeros((), jnp.int32)}, batch(), tmp_path / "t.safetensors",
                     max_grad_norm=1.0)
    with pytest.raises(TraceExportError, match="must return the loss, one number"):
        export(lambda p, x: jnp.tanh(x @ p["dense"]["w"]), tmp_path)
    with pytest.raises(TypeError, match="missing claimed_norms"):
        assert_norms(fine, params(), batch(), max_grad_norm=1.0)
    with pytest.raises(ValueError, match="claimed_norms has 2 entries; the batch has 3"):
        assert_norms(fine, params(), batch(), np.ones(2), max_grad_norm=1.0)
