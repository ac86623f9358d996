"""Small JAX programs `fun(params, batch)` for the program route's tests, and their truth:
each example's own gradient by jax.vmap(jax.grad(...)) on batch[i:i+1]."""
import jax
import jax.numpy as jnp
import numpy as np

V, D, H, T, B = 13, 6, 10, 5, 4


def rms(h):
    return h / jnp.sqrt((h * h).mean(-1, keepdims=True) + 1e-6)


def lm_params(dtype):
    k = jax.random.split(jax.random.key(0), 5)
    return {"embed": jax.random.normal(k[0], (V, D), dtype),
            "norm": 0.1 * jax.random.normal(k[1], (D,), dtype),
            "mlp": {"up": jax.random.normal(k[2], (D, H), dtype) / np.sqrt(D),
                    "bias": 0.1 * jax.random.normal(k[3], (H,), dtype),
                    "down": jax.random.normal(k[4], (H, D), dtype) / np.sqrt(H)}}


def lm_body(p, ids, head):
    h = rms(p["embed"][ids]) * (1 + p["norm"])
    h = h + jax.nn.gelu(h @ p["mlp"]["up"] + p["mlp"]["bias"]) @ p["mlp"]["down"]
    logp = jax.nn.log_softmax((rms(h) @ head.T)[:, :-1])
    return -jnp.take_along_axis(logp, ids[:, 1:, None], -1).mean()


def tied_lm(p, ids):  # B×T ids; the loss of the batch, the mean of its examples'
    return lm_body(p, ids, p["embed"])


def untied_lm(p, ids):  # the same weights with the head a parameter of its own
    return lm_body(p, ids, p["head"])


def lm_ids():
    return jax.random.randint(jax.random.key(7), (B, T), 0, V)


def per_example_norms(fun, params, batch):
    """The truth: each example's own gradient, fun on batch[i:i+1]."""
    grads = jax.vmap(jax.grad(fun), in_axes=(None, 0))(params, batch[:, None])
    return np.sqrt(sum(np.sum(np.asarray(g, np.float64).reshape(len(batch), -1) ** 2, 1)
                       for g in jax.tree_util.tree_leaves(grads)))


def mlp_params(dtype):
    k = jax.random.split(jax.random.key(1), 4)
    return {"layers": [{"w": jax.random.normal(k[0], (5, 8), dtype) / 2, "b": 0.1 * jnp.ones(8, dtype)},
                       {"w": jax.random.normal(k[1], (8, 3), dtype) / 3, "b": jnp.zeros(3, dtype)}]}


def mlp(p, batch):  # untied: x B×5, y B×3; the loss of the batch, the sum of its examples'
    x, y = batch
    h = jnp.tanh(x @ p["layers"][0]["w"] + p["layers"][0]["b"])
    out = h @ p["layers"][1]["w"] + p["layers"][1]["b"]
    return jnp.sum((out - y) ** 2)


def conv_params(dtype):
    k = jax.random.split(jax.random.key(2), 3)
    return {"conv": {"kernel": jax.random.normal(k[0], (3, 3, 2, 4), dtype) / 3, "bias": 0.1 * jnp.ones(4, dtype)},
            "head": jax.random.normal(k[1], (4, 2), dtype) / 2}


def conv_net(p, img):  # B×H×W×C, NHWC with an HWIO kernel, stride 2 on the width
    h = jax.lax.conv_general_dilated(img, p["conv"]["kernel"], (1, 2), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC")) + p["conv"]["bias"]
    out = jnp.tanh(h).mean((1, 2)) @ p["head"]
    return jnp.mean(jax.nn.logsumexp(out, -1) - out[:, 0])
