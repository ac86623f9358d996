"""Two tiny models written six ways, with the same weights, each as the `fun(params, batch)` that
jax_privacy's `clipped_grad` clips: a plain `jnp` function over a dict, Flax linen, Flax NNX,
Keras 3 on the JAX backend, Equinox and Haiku.

- The tied LM: token lookup in E, an RMS norm with a gain (x̂ ⊙ (1 + w) in the plain function and
  NNX, the library's own x̂ ⊙ w elsewhere), a residual 2-layer MLP with gelu, the head h @ Eᵀ,
  and the mean cross-entropy of the next token. E is used twice: the lookup and the head.
- The untied conv model: a 3×3 VALID convolution with bias, relu, flattened (H, W, C), then a
  2-layer MLP with gelu, and the cross-entropy of a label.

Each front-end builds its model from the canonical weights (`lm_weights`, `conv_weights`: numpy
f64 arrays, cast to the model's dtype) and returns a `Built`: the function, the params pytree in
that front-end's own form, and `canon`, which maps a pytree shaped like its params (a gradient)
back to the canonical names and layouts, so that the front-ends' gradients can be compared.
`fun(params, batch)` returns the mean loss over the examples of `batch` (B first), so a batch of
one gives that example's own loss. Keras reads `KERAS_BACKEND` once, at its first import:
`keras_module()` sets it to "jax" when keras is not imported yet and says so when it was
imported with another backend."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

V, D, H, T, B = 11, 8, 16, 6, 4  # vocabulary, width, MLP width, tokens, examples
EPS = 1e-6
IMG, CIN, COUT, HID, CLASSES = 6, 2, 3, 8, 5  # image side, channels in/out, MLP width, classes
FLAT = (IMG - 2) * (IMG - 2) * COUT

FRONT_ENDS = ("jnp", "linen", "nnx", "keras", "equinox", "haiku")


@dataclass
class Built:
    fun: Callable[..., Any]
    params: Any
    canon: Callable[[Any], dict[str, np.ndarray]]


# -- the canonical weights and batches ---------------------------------------------------------
def lm_weights(seed: int = 0) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    return {"embed": r.normal(0, 0.7, (V, D)), "gain": 1.0 + 0.2 * r.normal(size=D),
            "w1": r.normal(0, 0.5, (D, H)), "b1": 0.1 * r.normal(size=H),
            "w2": r.normal(0, 0.4, (H, D)), "b2": 0.1 * r.normal(size=D)}


def conv_weights(seed: int = 1) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    return {"kernel": r.normal(0, 0.4, (3, 3, CIN, COUT)), "kbias": 0.1 * r.normal(size=COUT),
            "w1": r.normal(0, 0.3, (FLAT, HID)), "b1": 0.1 * r.normal(size=HID),
            "w2": r.normal(0, 0.5, (HID, CLASSES)), "b2": 0.1 * r.normal(size=CLASSES)}


def lm_batch(seed: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, (B, T)).astype(np.int32)


def conv_batch(dtype: Any, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    r = np.random.default_rng(seed)
    return r.normal(size=(B, IMG, IMG, CIN)).astype(dtype), r.integers(0, CLASSES, B).astype(np.int32)


def _next_token_ce(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """Each sequence's mean cross-entropy of its next token: logits (..., T, V), ids (..., T)."""
    logp = jax.nn.log_softmax(logits[..., :-1, :])
    return -jnp.take_along_axis(logp, ids[..., 1:, None], -1)[..., 0].mean(-1)


def _label_ce(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)[..., 0]


def _gelu(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=True)


def _np(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


# -- plain jnp -----------------------------------------------------------------------------------
def jnp_lm_logits(p: dict[str, Any], ids: jax.Array) -> jax.Array:
    """`p["head"]`, where given, is the head's own copy of E: the untied reference for the
    per-use gradients of E (the tied model uses `p["embed"]` for both)."""
    x = p["embed"][ids]
    xhat = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS)
    n = xhat * (1 + p["gain"])
    h = x + _gelu(n @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return h @ p.get("head", p["embed"]).T


def jnp_lm(w: dict[str, np.ndarray], dtype: Any) -> Built:
    params = {k: jnp.asarray(v, dtype) for k, v in w.items()}
    params["gain"] = jnp.asarray(w["gain"] - 1.0, dtype)  # stored as w in x̂ ⊙ (1 + w)

    def fun(p: dict[str, Any], ids: jax.Array) -> jax.Array:
        return jnp.mean(_next_token_ce(jnp_lm_logits(p, ids), ids))

    return Built(fun, params, lambda g: {k: _np(v) for k, v in g.items()})


def _conv_nhwc(x: jax.Array, k: jax.Array) -> jax.Array:
    return jax.lax.conv_general_dilated(x, k, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def jnp_conv(w: dict[str, np.ndarray], dtype: Any) -> Built:
    params = {k: jnp.asarray(v, dtype) for k, v in w.items()}

    def fun(p: dict[str, Any], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        x, y = batch
        z = jax.nn.relu(_conv_nhwc(x, p["kernel"]) + p["kbias"]).reshape(x.shape[0], -1)
        logits = _gelu(z @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
        return jnp.mean(_label_ce(logits, y))

    return Built(fun, params, lambda g: {k: _np(v) for k, v in g.items()})


# -- Flax linen ----------------------------------------------------------------------------------
def _replace(tree: Any, values: dict[tuple[str, ...], np.ndarray], dtype: Any) -> Any:
    """`tree` (nested dicts) with the leaf at each path replaced; the shapes must agree."""
    out = jax.tree_util.tree_map(lambda a: a, tree)
    for path, v in values.items():
        node = out
        for k in path[:-1]:
            node = node[k]
        assert tuple(node[path[-1]].shape) == v.shape, (path, node[path[-1]].shape, v.shape)
        node[path[-1]] = jnp.asarray(v, dtype)
    leaves = len(jax.tree_util.tree_leaves(out))
    assert leaves == len(values), f"{leaves} leaves, {len(values)} set"
    return out


def linen_lm(w: dict[str, np.ndarray], dtype: Any) -> Built:
    import flax.linen as nn

    class TiedLM(nn.Module):
        @nn.compact
        def __call__(self, ids: jax.Array) -> jax.Array:
            embed = nn.Embed(V, D, param_dtype=dtype, name="embed")
            x = embed(ids)
            n = nn.RMSNorm(epsilon=EPS, param_dtype=dtype, name="norm")(x)
            h = x + nn.Dense(D, param_dtype=dtype, name="down")(
                _gelu(nn.Dense(H, param_dtype=dtype, name="up")(n)))
            return embed.attend(h)

    model = TiedLM()
    ids = jnp.asarray(lm_batch())
    params = _replace(dict(model.init(jax.random.key(0), ids)["params"]), {
        ("embed", "embedding"): w["embed"], ("norm", "scale"): w["gain"], ("up", "kernel"): w["w1"],
        ("up", "bias"): w["b1"], ("down", "kernel"): w["w2"], ("down", "bias"): w["b2"]}, dtype)

    def fun(p: Any, ids: jax.Array) -> jax.Array:
        return jnp.mean(_next_token_ce(model.apply({"params": p}, ids), ids))

    def canon(g: Any) -> dict[str, np.ndarray]:
        return {"embed": _np(g["embed"]["embedding"]), "gain": _np(g["norm"]["scale"]),
                "w1": _np(g["up"]["kernel"]), "b1": _np(g["up"]["bias"]),
                "w2": _np(g["down"]["kernel"]), "b2": _np(g["down"]["bias"])}

    return Built(fun, params, canon)


def linen_conv(w: dict[str, np.ndarray], dtype: Any) -> Built:
    import flax.linen as nn

    class ConvNet(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            z = nn.relu(nn.Conv(COUT, (3, 3), padding="VALID", param_dtype=dtype, name="conv")(x))
            z = z.reshape(x.shape[0], -1)
            return nn.Dense(CLASSES, param_dtype=dtype, name="fc2")(
                _gelu(nn.Dense(HID, param_dtype=dtype, name="fc1")(z)))

    model = ConvNet()
    x, _ = conv_batch(np.dtype(dtype))
    params = _replace(dict(model.init(jax.random.key(0), jnp.asarray(x))["params"]), {
        ("conv", "kernel"): w["kernel"], ("conv", "bias"): w["kbias"], ("fc1", "kernel"): w["w1"],
        ("fc1", "bias"): w["b1"], ("fc2", "kernel"): w["w2"], ("fc2", "bias"): w["b2"]}, dtype)

    def fun(p: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        x, y = batch
        return jnp.mean(_label_ce(model.apply({"params": p}, x), y))

    def canon(g: Any) -> dict[str, np.ndarray]:
        return {"kernel": _np(g["conv"]["kernel"]), "kbias": _np(g["conv"]["bias"]),
                "w1": _np(g["fc1"]["kernel"]), "b1": _np(g["fc1"]["bias"]),
                "w2": _np(g["fc2"]["kernel"]), "b2": _np(g["fc2"]["bias"])}

    return Built(fun, params, canon)


# -- Flax NNX ------------------------------------------------------------------------------------
def _nnx_set(state: Any, values: dict[tuple[str, ...], np.ndarray], dtype: Any) -> Any:
    """The NNX state with the leaf at each path (its keys, then `.value`) replaced."""
    flat = jax.tree_util.tree_flatten_with_path(state)
    paths = {tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path) for path, _ in flat[0]}
    wanted = {path + ("value",) for path in values}
    assert paths == wanted, (paths, wanted)

    def put(path: Any, leaf: Any) -> Any:
        key = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)[:-1]
        v = values[key]
        assert tuple(leaf.shape) == v.shape, (key, leaf.shape, v.shape)
        return jnp.asarray(v, dtype)

    return jax.tree_util.tree_map_with_path(put, state)


def nnx_lm(w: dict[str, np.ndarray], dtype: Any) -> Built:
    from flax import nnx

    class Gain(nnx.Module):
        """x̂ ⊙ (1 + w), w starting at 0 (Gemma's RMS norm)."""

        def __init__(self, d: int) -> None:
            self.w = nnx.Param(jnp.zeros((d,), dtype))

        def __call__(self, x: jax.Array) -> jax.Array:
            xhat = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + EPS)
            return xhat * (1 + self.w[...])

    class TiedLM(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.embed = nnx.Embed(V, D, param_dtype=dtype, rngs=rngs)
            self.norm = Gain(D)
            self.up = nnx.Linear(D, H, param_dtype=dtype, rngs=rngs)
            self.down = nnx.Linear(H, D, param_dtype=dtype, rngs=rngs)

        def __call__(self, ids: jax.Array) -> jax.Array:
            x = self.embed(ids)
            h = x + self.down(_gelu(self.up(self.norm(x))))
            return self.embed.attend(h)

    graphdef, state = nnx.split(TiedLM(nnx.Rngs(0)))
    params = _nnx_set(state, {("embed", "embedding"): w["embed"], ("norm", "w"): w["gain"] - 1.0,
                              ("up", "kernel"): w["w1"], ("up", "bias"): w["b1"],
                              ("down", "kernel"): w["w2"], ("down", "bias"): w["b2"]}, dtype)

    def fun(p: Any, ids: jax.Array) -> jax.Array:
        return jnp.mean(_next_token_ce(nnx.merge(graphdef, p)(ids), ids))

    def canon(g: Any) -> dict[str, np.ndarray]:
        return {"embed": _np(g["embed"]["embedding"][...]), "gain": _np(g["norm"]["w"][...]),
                "w1": _np(g["up"]["kernel"][...]), "b1": _np(g["up"]["bias"][...]),
                "w2": _np(g["down"]["kernel"][...]), "b2": _np(g["down"]["bias"][...])}

    return Built(fun, params, canon)


def nnx_conv(w: dict[str, np.ndarray], dtype: Any) -> Built:
    from flax import nnx

    class ConvNet(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.conv = nnx.Conv(CIN, COUT, (3, 3), padding="VALID", param_dtype=dtype, rngs=rngs)
            self.fc1 = nnx.Linear(FLAT, HID, param_dtype=dtype, rngs=rngs)
            self.fc2 = nnx.Linear(HID, CLASSES, param_dtype=dtype, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            z = nnx.relu(self.conv(x)).reshape(x.shape[0], -1)
            return self.fc2(_gelu(self.fc1(z)))

    graphdef, state = nnx.split(ConvNet(nnx.Rngs(0)))
    params = _nnx_set(state, {("conv", "kernel"): w["kernel"], ("conv", "bias"): w["kbias"],
                              ("fc1", "kernel"): w["w1"], ("fc1", "bias"): w["b1"],
                              ("fc2", "kernel"): w["w2"], ("fc2", "bias"): w["b2"]}, dtype)

    def fun(p: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        x, y = batch
        return jnp.mean(_label_ce(nnx.merge(graphdef, p)(x), y))

    def canon(g: Any) -> dict[str, np.ndarray]:
        return {"kernel": _np(g["conv"]["kernel"][...]), "kbias": _np(g["conv"]["bias"][...]),
                "w1": _np(g["fc1"]["kernel"][...]), "b1": _np(g["fc1"]["bias"][...]),
                "w2": _np(g["fc2"]["kernel"][...]), "b2": _np(g["fc2"]["bias"][...])}

    return Built(fun, params, canon)


# -- Keras 3 (JAX backend) ----------------------------------------------------------------------
def keras_module() -> Any:
    """keras on the JAX backend, or None where keras was already imported in this process with
    another backend (it reads KERAS_BACKEND once; the caller then runs its case in a fresh
    process with KERAS_BACKEND=jax)."""
    if "keras" not in sys.modules:
        os.environ["KERAS_BACKEND"] = "jax"
    import keras

    return keras if keras.backend.backend() == "jax" else None


def _keras_params(model: Any, names: dict[int, str], w: dict[str, np.ndarray],
                  layout: dict[str, Callable[[np.ndarray], np.ndarray]], dtype: Any) -> list[Any]:
    """The trainable variables' values, in `model.trainable_variables` order (what
    `stateless_call` takes), set from the canonical weights."""
    out = []
    for v in model.trainable_variables:
        name = names[id(v)]
        value = layout.get(name, lambda a: a)(w[name])
        assert tuple(v.shape) == value.shape, (name, v.shape, value.shape)
        out.append(jnp.asarray(value, dtype))
    assert sorted(names.values()) == sorted(w), (names, list(w))
    return out


def keras_lm(w: dict[str, np.ndarray], dtype: Any) -> Built:
    keras = keras_module()
    assert keras is not None, "keras is imported with a backend other than jax"
    kdtype = np.dtype(dtype).name

    class TiedLM(keras.Model):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__(dtype=kdtype)
            self.embed = keras.layers.Embedding(V, D, dtype=kdtype)
            self.norm = keras.layers.RMSNormalization(epsilon=EPS, dtype=kdtype)
            self.up = keras.layers.Dense(H, dtype=kdtype)
            self.down = keras.layers.Dense(D, dtype=kdtype)

        def call(self, ids: Any) -> Any:
            x = self.embed(ids)
            h = x + self.down(keras.ops.gelu(self.up(self.norm(x)), approximate=True))
            return keras.ops.matmul(h, keras.ops.transpose(self.embed.embeddings))

    model = TiedLM()
    model(lm_batch())  # builds the variables
    names = {id(model.embed.embeddings): "embed", id(model.norm.scale): "gain",
             id(model.up.kernel): "w1", id(model.up.bias): "b1", id(model.down.kernel): "w2",
             id(model.down.bias): "b2"}
    order = [names[id(v)] for v in model.trainable_variables]
    params = _keras_params(model, names, w, {}, dtype)
    non_trainable = [v.value for v in model.non_trainable_variables]

    def fun(p: list[Any], ids: Any) -> Any:
        logits, _ = model.stateless_call(p, non_trainable, ids)
        ce = keras.losses.sparse_categorical_crossentropy(ids[:, 1:], logits[:, :-1], from_logits=True)
        return keras.ops.mean(ce)

    return Built(fun, params, lambda g: {order[i]: _np(v) for i, v in enumerate(g)})


def keras_conv(w: dict[str, np.ndarray], dtype: Any) -> Built:
    keras = keras_module()
    assert keras is not None, "keras is imported with a backend other than jax"
    kdtype = np.dtype(dtype).name

    class ConvNet(keras.Model):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__(dtype=kdtype)
            self.conv = keras.layers.Conv2D(COUT, 3, padding="valid", activation="relu", dtype=kdtype)
            self.flat = keras.layers.Flatten(dtype=kdtype)
            self.fc1 = keras.layers.Dense(HID, dtype=kdtype)
            self.fc2 = keras.layers.Dense(CLASSES, dtype=kdtype)

        def call(self, x: Any) -> Any:
            return self.fc2(keras.ops.gelu(self.fc1(self.flat(self.conv(x))), approximate=True))

    model = ConvNet()
    x, _ = conv_batch(np.dtype(dtype))
    model(x)
    names = {id(model.conv.kernel): "kernel", id(model.conv.bias): "kbias", id(model.fc1.kernel): "w1",
             id(model.fc1.bias): "b1", id(model.fc2.kernel): "w2", id(model.fc2.bias): "b2"}
    order = [names[id(v)] for v in model.trainable_variables]
    params = _keras_params(model, names, w, {}, dtype)
    non_trainable = [v.value for v in model.non_trainable_variables]

    def fun(p: list[Any], batch: tuple[Any, Any]) -> Any:
        x, y = batch
        logits, _ = model.stateless_call(p, non_trainable, x)
        return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))

    return Built(fun, params, lambda g: {order[i]: _np(v) for i, v in enumerate(g)})


# -- Equinox -------------------------------------------------------------------------------------
def equinox_lm(w: dict[str, np.ndarray], dtype: Any) -> Built:
    import equinox as eqx

    class TiedLM(eqx.Module):
        """Sees one sequence (T,): the Equinox idiom; `fun` vmaps it over the batch."""

        embed: eqx.nn.Embedding
        norm: eqx.nn.RMSNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key: jax.Array) -> None:
            k = jax.random.split(key, 3)
            self.embed = eqx.nn.Embedding(V, D, dtype=dtype, key=k[0])
            self.norm = eqx.nn.RMSNorm(D, eps=EPS, use_bias=False, dtype=dtype)
            self.up = eqx.nn.Linear(D, H, dtype=dtype, key=k[1])
            self.down = eqx.nn.Linear(H, D, dtype=dtype, key=k[2])

        def __call__(self, ids: jax.Array) -> jax.Array:
            x = jax.vmap(self.embed)(ids)
            h = x + jax.vmap(lambda n: self.down(_gelu(self.up(self.norm(n)))))(x)
            return _next_token_ce(h @ self.embed.weight.T, ids)

    model = TiedLM(jax.random.key(0))
    model = eqx.tree_at(lambda m: (m.embed.weight, m.norm.weight, m.up.weight, m.up.bias, m.down.weight,
                                   m.down.bias), model,
                        tuple(jnp.asarray(a, dtype) for a in (w["embed"], w["gain"], w["w1"].T, w["b1"],
                                                              w["w2"].T, w["b2"])))
    params, static = eqx.partition(model, eqx.is_array)

    def fun(p: Any, ids: jax.Array) -> jax.Array:
        return jnp.mean(jax.vmap(eqx.combine(p, static))(ids))

    def canon(g: Any) -> dict[str, np.ndarray]:
        return {"embed": _np(g.embed.weight), "gain": _np(g.norm.weight), "w1": _np(g.up.weight).T,
                "b1": _np(g.up.bias), "w2": _np(g.down.weight).T, "b2": _np(g.down.bias)}

    return Built(fun, params, canon)


def equinox_conv(w: dict[str, np.ndarray], dtype: Any) -> Built:
    import equinox as eqx

    class ConvNet(eqx.Module):
        """Sees one image (H, W, C), convolved as (C, H, W) as Equinox's Conv2d takes it."""

        conv: eqx.nn.Conv2d
        fc1: eqx.nn.Linear
        fc2: eqx.nn.Linear

        def __init__(self, key: jax.Array) -> None:
            k = jax.random.split(key, 3)
            self.conv = eqx.nn.Conv2d(CIN, COUT, 3, dtype=dtype, key=k[0])
            self.fc1 = eqx.nn.Linear(FLAT, HID, dtype=dtype, key=k[1])
            self.fc2 = eqx.nn.Linear(HID, CLASSES, dtype=dtype, key=k[2])

        def __call__(self, x: jax.Array, y: jax.Array) -> jax.Array:
            z = jax.nn.relu(self.conv(x.transpose(2, 0, 1))).transpose(1, 2, 0).reshape(-1)
            return _label_ce(self.fc2(_gelu(self.fc1(z))), y)

    model = ConvNet(jax.random.key(0))
    model = eqx.tree_at(lambda m: (m.conv.weight, m.conv.bias, m.fc1.weight, m.fc1.bias, m.fc2.weight, m.fc2.bias),
                        model, tuple(jnp.asarray(a, dtype) for a in (
                            w["kernel"].transpose(3, 2, 0, 1), w["kbias"][:, None, None], w["w1"].T, w["b1"],
                            w["w2"].T, w["b2"])))
    params, static = eqx.partition(model, eqx.is_array)

    def fun(p: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        return jnp.mean(jax.vmap(eqx.combine(p, static))(*batch))

    def canon(g: Any) -> dict[str, np.ndarray]:
        return {"kernel": _np(g.conv.weight).transpose(2, 3, 1, 0), "kbias": _np(g.conv.bias)[:, 0, 0],
                "w1": _np(g.fc1.weight).T, "b1": _np(g.fc1.bias), "w2": _np(g.fc2.weight).T, "b2": _np(g.fc2.bias)}

    return Built(fun, params, canon)


# -- Haiku ---------------------------------------------------------------------------------------
def haiku_lm(w: dict[str, np.ndarray], dtype: Any) -> Built:
    import haiku as hk

    def loss(ids: jax.Array) -> jax.Array:
        embed = hk.Embed(V, D, name="embed")
        x = embed(ids)
        n = hk.RMSNorm(-1, eps=EPS, name="norm")(x)
        h = x + hk.Linear(D, name="down")(_gelu(hk.Linear(H, name="up")(n)))
        return jnp.mean(_next_token_ce(h @ embed.embeddings.T, ids))

    model = hk.transform(loss)
    params = _replace(hk.data_structures.to_mutable_dict(model.init(jax.random.key(0), jnp.asarray(lm_batch()))), {
        ("embed", "embeddings"): w["embed"], ("norm", "scale"): w["gain"], ("up", "w"): w["w1"],
        ("up", "b"): w["b1"], ("down", "w"): w["w2"], ("down", "b"): w["b2"]}, dtype)

    def fun(p: Any, ids: jax.Array) -> jax.Array:
        return model.apply(p, None, ids)

    def canon(g: Any) -> dict[str, np.ndarray]:
        return {"embed": _np(g["embed"]["embeddings"]), "gain": _np(g["norm"]["scale"]),
                "w1": _np(g["up"]["w"]), "b1": _np(g["up"]["b"]), "w2": _np(g["down"]["w"]), "b2": _np(g["down"]["b"])}

    return Built(fun, params, canon)


def haiku_conv(w: dict[str, np.ndarray], dtype: Any) -> Built:
    import haiku as hk

    def loss(x: jax.Array, y: jax.Array) -> jax.Array:
        z = jax.nn.relu(hk.Conv2D(COUT, 3, padding="VALID", name="conv")(x)).reshape(x.shape[0], -1)
        logits = hk.Linear(CLASSES, name="fc2")(_gelu(hk.Linear(HID, name="fc1")(z)))
        return jnp.mean(_label_ce(logits, y))

    model = hk.transform(loss)
    x, y = conv_batch(np.dtype(dtype))
    params = _replace(hk.data_structures.to_mutable_dict(model.init(jax.random.key(0), x, y)), {
        ("conv", "w"): w["kernel"], ("conv", "b"): w["kbias"], ("fc1", "w"): w["w1"], ("fc1", "b"): w["b1"],
        ("fc2", "w"): w["w2"], ("fc2", "b"): w["b2"]}, dtype)

    def fun(p: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        return model.apply(p, None, *batch)

    def canon(g: Any) -> dict[str, np.ndarray]:
        return {"kernel": _np(g["conv"]["w"]), "kbias": _np(g["conv"]["b"]), "w1": _np(g["fc1"]["w"]),
                "b1": _np(g["fc1"]["b"]), "w2": _np(g["fc2"]["w"]), "b2": _np(g["fc2"]["b"])}

    return Built(fun, params, canon)


LM = {"jnp": jnp_lm, "linen": linen_lm, "nnx": nnx_lm, "keras": keras_lm, "equinox": equinox_lm,
      "haiku": haiku_lm}
CONV = {"jnp": jnp_conv, "linen": linen_conv, "nnx": nnx_conv, "keras": keras_conv, "equinox": equinox_conv,
        "haiku": haiku_conv}


def build(front_end: str, model: str, dtype: Any) -> tuple[Built, Any]:
    """(the front-end's model in `dtype`, its batch). Call under `jax.enable_x64(True)` for f64."""
    if model == "lm":
        return LM[front_end](lm_weights(), dtype), jnp.asarray(lm_batch())
    x, y = conv_batch(np.dtype(dtype))
    return CONV[front_end](conv_weights(), dtype), (jnp.asarray(x), jnp.asarray(y))


# -- ground truth --------------------------------------------------------------------------------
def per_example_grads(built: Built, batch: Any) -> dict[str, np.ndarray]:
    """Each example's own gradient, `jax.vmap(jax.grad(...))` of its loss as a batch of one, in
    the canonical names and layouts (B first)."""
    def own(p: Any, example: Any) -> jax.Array:
        return built.fun(p, jax.tree_util.tree_map(lambda a: a[None], example))

    # compiled once: op by op, every primitive of every front-end would be compiled on its own
    grads = jax.tree_util.tree_map(np.asarray, jax.jit(jax.vmap(jax.grad(own), in_axes=(None, 0)))(
        built.params, batch))
    per = [built.canon(jax.tree_util.tree_map(lambda g, i=i: g[i], grads)) for i in range(B)]
    return {k: np.stack([p[k] for p in per]) for k in per[0]}


def norms_of(grads: dict[str, np.ndarray]) -> np.ndarray:
    return np.sqrt(sum(np.sum(np.square(g).reshape(len(g), -1), 1) for g in grads.values()))


def lm_norms_without_cross_term(dtype: Any) -> np.ndarray:
    """The tied LM's per-example norms with E's two uses taken as two parameters:
    √(Σ_other ‖g‖² + ‖g_lookup‖² + ‖g_head‖²), the claim that drops 2⟨g_lookup, g_head⟩; from the
    plain function with the head given its own copy of E."""
    w = lm_weights()
    p = {k: jnp.asarray(v, dtype) for k, v in w.items()}
    p["gain"] = jnp.asarray(w["gain"] - 1.0, dtype)
    p["head"] = p["embed"]

    def own(p: dict[str, Any], ids: jax.Array) -> jax.Array:
        return _next_token_ce(jnp_lm_logits(p, ids[None]), ids[None])[0]

    grads = jax.vmap(jax.grad(own), in_axes=(None, 0))(p, jnp.asarray(lm_batch()))
    return norms_of({k: _np(v) for k, v in grads.items()})
