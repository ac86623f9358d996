"""Tiny Flax models and independent ground truth for the JAX exporter's tests: per-example
gradients by `jax.vmap(jax.grad(...))` of each example's own loss, never from the exporter."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

VOCAB, D, T, B = 13, 8, 6, 4


class TiedLM(nn.Module):
    """Embed with attend as the head, a 1×T position lookup, LayerNorm, a DenseGeneral q with a
    per-head RMSNorm, Dense layers (one called twice), RMSNorm. `tied=False` gives the head its
    own copy of the table (the claim of a clipper that drops the cross term)."""

    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    tied: bool = True

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        embed = nn.Embed(VOCAB, D, name="embed", **kw)
        h = embed(ids) + nn.Embed(16, D, name="pos", **kw)(jnp.arange(ids.shape[1])[None])
        h = nn.LayerNorm(name="ln", **kw)(h)
        q = nn.DenseGeneral((2, 4), name="q", **kw)(h)
        q = nn.RMSNorm(name="q_norm", **kw)(q)
        h = h + nn.Dense(D, name="o", **kw)(q.reshape(*q.shape[:2], -1))
        mlp = nn.Dense(D, name="mlp", **kw)
        h = h + mlp(jnp.tanh(mlp(h)))  # one module, two uses
        h = nn.RMSNorm(name="final_norm", **kw)(h)
        if self.tied:
            return embed.attend(h)
        return nn.Embed(VOCAB, D, name="head", **kw).attend(h)


def lm_loss(apply: Any, ids: jax.Array) -> jax.Array:
    """Each example's mean next-token cross-entropy."""
    logits = apply(ids)
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))  # bf16/f16 models: the loss in f32
    logp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0].mean(1)


def batch(seed: int = 0, b: int = B) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (b, T), 0, VOCAB)


def init(model: nn.Module, x: Any, seed: int = 1) -> Any:
    return model.init(jax.random.key(seed), x)["params"]


def per_example_grads(model: nn.Module, params: Any, loss: Any, x: Any) -> Any:
    """Example i's gradient of its own loss, by vmap over single examples."""
    def one(p: Any, xi: Any) -> jax.Array:
        xb = jax.tree_util.tree_map(lambda a: a[None], xi)
        return loss(lambda *a, **k: model.apply({"params": p}, *a, **k), xb)[0]

    return jax.vmap(jax.grad(one), in_axes=(None, 0))(params, x)


def norms_of(grads: Any) -> np.ndarray:
    leaves = jax.tree_util.tree_leaves(grads)
    b = leaves[0].shape[0]
    return np.sqrt(sum(np.sum(np.asarray(g, dtype=np.float64).reshape(b, -1) ** 2, 1) for g in leaves))


def true_norms(model: nn.Module, params: Any, loss: Any, x: Any) -> np.ndarray:
    return norms_of(per_example_grads(model, params, loss, x))


def clipped_sum(grads: Any, norms: np.ndarray, c: float) -> Any:
    coef = np.minimum(1.0, c / norms)
    return jax.tree_util.tree_map(lambda g: np.tensordot(coef, np.asarray(g, dtype=np.float64), 1).astype(g.dtype),
                                  grads)


def untied_params(params: Any) -> Any:
    """The tied model's weights in the untied model: the head a copy of the table."""
    out = dict(params)
    out["head"] = {"embedding": params["embed"]["embedding"]}
    return out
