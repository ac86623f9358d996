"""Every JAX front-end through the program route: one tiny tied LM and one untied conv model,
written with the same weights as a plain `jnp` function, Flax linen, Flax NNX, Keras 3 (JAX
backend), Equinox and Haiku (`jax_frontends`), each handed to the oracle as the
`fun(params, batch)` jax_privacy clips.

Ground truth first, with no oracle: each front-end's per-example gradients
(`jax.vmap(jax.grad(...))` of each example's own loss) equal the plain function's, and the plain
function's equal a loop of `jax.grad` over the examples. Then, per front-end, model and precision
(f32, x64): the exact norms pass `assert_norms`, a norm 0.1 % low fails, and the tied LM's norms
with E's lookup and head taken as two parameters (‖g_lookup‖² + ‖g_head‖², the cross term
dropped) fail; the tied LM's exact clipped sum, shaped like each front-end's params, passes
`assert_update` and one entry of it 1 % off fails; `export_trace` names the parameters by their
pytree key paths. docs/python.md's examples of the program route run as printed.

Keras reads KERAS_BACKEND once, at its first import: where keras was imported in this process
with another backend, a Keras case runs itself again in a fresh process with KERAS_BACKEND=jax
(`_elsewhere`). Keras' RMSNormalization computes in float32 even in a float64 model, so its x64 LM
agrees with the others to f32's rounding only, and the oracle judges it at that precision."""
from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("equinox")
pytest.importorskip("haiku")
if importlib.util.find_spec("keras") is None:  # not imported here: keras reads its backend at import
    pytest.skip("keras is not installed", allow_module_level=True)

import jax.numpy as jnp  # noqa: E402
import jax_frontends as F  # noqa: E402
import numpy as np  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

import ghost_oracle  # noqa: E402
from ghost_oracle.jax import assert_norms, assert_update, export_trace  # noqa: E402

PRECISIONS = {"f32": False, "x64": True}
MODELS = ("lm", "conv")


def _elsewhere(front_end: str, request: pytest.FixtureRequest) -> bool:
    """Runs this test in a fresh process with KERAS_BACKEND=jax where keras is already imported
    here with another backend; True where it did (and passed)."""
    if front_end != "keras" or F.keras_module() is not None:
        return False
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        request.node.nodeid], cwd=request.config.rootpath, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"{request.node.nodeid} with KERAS_BACKEND=jax:\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
    return True


def _dtype(x64: bool):
    return jnp.float64 if x64 else jnp.float32


@functools.cache
def _case(front_end: str, model: str, x64: bool) -> tuple[F.Built, object, dict[str, np.ndarray]]:
    """(the model, its batch, its per-example gradients), built once per process; call under
    `jax.enable_x64(x64)`, as its arrays are in that precision."""
    built, batch = F.build(front_end, model, _dtype(x64))
    return built, batch, F.per_example_grads(built, batch)


def _loop_grads(built: F.Built, batch) -> dict[str, np.ndarray]:
    """Each example's gradient by its own `jax.grad` call (no vmap)."""
    per = []
    grad = jax.jit(jax.grad(built.fun))
    for i in range(F.B):
        one = jax.tree_util.tree_map(lambda a, i=i: a[i:i + 1], batch)
        per.append(built.canon(jax.tree_util.tree_map(np.asarray, grad(built.params, one))))
    return {k: np.stack([p[k] for p in per]) for k in per[0]}


def _assert_grads_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray], rtol: float) -> float:
    assert sorted(got) == sorted(want)
    worst = 0.0
    for k in want:
        assert got[k].shape == want[k].shape, k
        err = float(np.abs(got[k] - want[k]).max() / np.abs(want[k]).max())
        assert err <= rtol, f"{k}: relative error {err:.3g} > {rtol:g}"
        worst = max(worst, err)
    return worst


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("model", MODELS)
def test_plain_function_vmap_grad_equals_a_loop_of_grads(model, precision):
    with jax.enable_x64(PRECISIONS[precision]):
        built, batch, grads = _case("jnp", model, PRECISIONS[precision])
        _assert_grads_close(grads, _loop_grads(built, batch),
                            1e-12 if PRECISIONS[precision] else 1e-5)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("front_end", [f for f in F.FRONT_ENDS if f != "jnp"])
def test_front_ends_give_the_plain_functions_per_example_grads(front_end, model, precision, request):
    if _elsewhere(front_end, request):
        return
    x64 = PRECISIONS[precision]
    with jax.enable_x64(x64):
        built, batch, got = _case(front_end, model, x64)
        leaves = jax.tree_util.tree_leaves(built.params)
        assert {leaf.dtype for leaf in leaves} == {np.dtype(_dtype(x64))}, "the weights are in the model's dtype"
        ref, ref_batch, want = _case("jnp", model, x64)
        # Keras in a float64 model: its losses' mean reduces in float32, and
        # keras.layers.RMSNormalization casts x̂ and its gain to float32, so the x64 Keras loss,
        # and the LM's gradients, agree with the others to f32's rounding only
        mixed = front_end == "keras" and model == "lm" and x64
        rtol = 1e-12 if x64 and not mixed else 1e-5
        np.testing.assert_allclose(float(built.fun(built.params, batch)), float(ref.fun(ref.params, ref_batch)),
                                   rtol=1e-5 if front_end == "keras" or not x64 else 1e-12)
    err = _assert_grads_close(got, want, rtol)
    if mixed:
        assert err > 1e-12, "Keras' RMS norm now computes in float64: the x64 Keras LM is no longer mixed"


def _key_path_names(params) -> dict[str, tuple[int, ...]]:
    """The names the program route gives the parameters (with their shapes): each leaf's key
    path, DictKey → its key, GetAttrKey → its name, SequenceKey/FlattenedIndexKey → its index,
    joined with '.'."""
    def part(k) -> str:
        if isinstance(k, jax.tree_util.DictKey):
            return str(k.key)
        if isinstance(k, jax.tree_util.GetAttrKey):
            return k.name
        if isinstance(k, jax.tree_util.SequenceKey | jax.tree_util.FlattenedIndexKey):
            return str(k.idx if isinstance(k, jax.tree_util.SequenceKey) else k.key)
        raise AssertionError(f"unexpected key {k!r}")

    return {".".join(part(k) for k in path): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("front_end", F.FRONT_ENDS)
def test_oracle_judges_the_front_end(front_end, model, precision, request, tmp_path):
    if _elsewhere(front_end, request):
        return
    x64 = PRECISIONS[precision]
    trace = tmp_path / "exact.safetensors"
    with jax.enable_x64(x64):
        built, batch, grads = _case(front_end, model, x64)
        norms = F.norms_of(grads)
        c = 0.5 * float(norms.min())  # every example clipped: a low norm is a coefficient too large
        report = assert_norms(built.fun, built.params, batch, norms, max_grad_norm=c, trace_path=trace)
    assert report.passed
    # judged at the precision the program computes in: f32 for Keras' x64 LM, whose RMS norm
    # runs in float32 (its truth here, vmap(grad), carries that rounding too)
    mixed = front_end == "keras" and model == "lm" and x64
    assert report.precision == ("f64" if x64 and not mixed else "f32")
    np.testing.assert_allclose(report.true_norms, norms, rtol=1e-9 if report.precision == "f64" else 1e-4)

    # the wrong claims judged on the same trace, its claimed norms rewritten (what assert_norms
    # would export again; one export per case keeps the suite's time down)
    wrong = {"0.1 % low": norms * (1 - 1e-3)}
    if model == "lm":
        separate = F.lm_norms_without_cross_term(_dtype(x64))
        # without the cross term 2⟨g_lookup, g_head⟩ some example's norm is low by more than
        # the 0.1 % above: its coefficient is too large
        assert (separate / norms < 1 - 1e-3).any(), separate / norms
        wrong["cross term dropped"] = separate
    for what, claims in wrong.items():
        path = _with_claimed_norms(trace, claims, tmp_path / "wrong.safetensors")
        assert ghost_oracle.check(str(path)).verdict == "privacy-violation", what


def _with_claimed_norms(trace, norms: np.ndarray, path):
    """A copy of `trace` with `claimed.norms` (float64, B) replaced, its header's metadata kept."""
    with safe_open(str(trace), framework="np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no mapping)
        metadata = f.metadata()
    assert tensors["claimed.norms"].shape == norms.shape
    tensors["claimed.norms"] = np.asarray(norms, dtype=np.float64)
    save_file(tensors, str(path), metadata=metadata)
    return path


@pytest.mark.filterwarnings("ignore:noise_multiplier 0")
@pytest.mark.parametrize("front_end", F.FRONT_ENDS)
def test_oracle_judges_the_front_ends_clipped_sum(front_end, request):
    """The tied LM's clipped sum Σ c_i g_i, given as a pytree shaped like the front-end's own
    params (a dict, an NNX state, Keras' list, an Equinox module, Haiku's mapping)."""
    if _elsewhere(front_end, request):
        return
    built, batch, grads = _case(front_end, "lm", False)
    native = jax.vmap(jax.grad(lambda p, ex: built.fun(p, ex[None])), in_axes=(None, 0))(built.params, batch)
    norms = F.norms_of(grads)
    c = float(np.median(norms))  # some examples clipped, some not
    coef = np.minimum(1.0, c / norms)
    summed = jax.tree_util.tree_map(lambda g: np.tensordot(coef.astype(g.dtype), np.asarray(g), 1), native)
    update = jax.tree_util.tree_map(lambda s: s / F.B, summed)
    report = assert_update(built.fun, built.params, batch, update, clipped_sum=summed, max_grad_norm=c,
                           noise_multiplier=0.0, batch_divisor=F.B)
    assert report.passed
    wrong = jax.tree_util.tree_map(np.array, summed)
    leaf = jax.tree_util.tree_leaves(wrong)[0]
    leaf.reshape(-1)[0] += 0.01 * np.abs(leaf).max()
    with pytest.raises(ghost_oracle.ClippingCheckFailed):
        assert_update(built.fun, built.params, batch, jax.tree_util.tree_map(lambda s: s / F.B, wrong),
                      clipped_sum=wrong, max_grad_norm=c, noise_multiplier=0.0, batch_divisor=F.B)


@pytest.mark.parametrize("front_end", F.FRONT_ENDS)
def test_export_names_parameters_by_key_path(front_end, tmp_path, request):
    if _elsewhere(front_end, request):
        return
    built, batch, grads = _case(front_end, "lm", False)
    norms = F.norms_of(grads)
    path = tmp_path / f"{front_end}.safetensors"
    specs = export_trace(built.fun, built.params, batch, path, claimed_norms=norms, max_grad_norm=1.0)
    assert {s["param"] for s in specs} == set(_key_path_names(built.params))
    # E is used twice: the lookup and the head, two sites of the one (V, D) parameter
    tied = [name for name, shape in _key_path_names(built.params).items() if shape == (F.V, F.D)]
    assert len(tied) == 1
    assert sorted(s["kind"] for s in specs if s["param"] == tied[0]) == ["embedding", "linear"]
    assert len(specs) == len(_key_path_names(built.params)) + 1
    report = ghost_oracle.check(str(path))
    assert report.passed, report.explain()
    np.testing.assert_allclose(report.true_norms, norms, rtol=1e-4)


DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "python.md")
DOCS_SECTION = "### Any JAX program"


def _docs_blocks() -> list[str]:
    """The ```python blocks of docs/python.md's section on any JAX program, as printed."""
    with open(DOCS, encoding="utf-8") as f:
        text = f.read()
    start = text.index(DOCS_SECTION)
    end = min(i for i in (text.find("\n## ", start), text.find("\n### ", start + 1)) if i > 0)
    return [b.split("\n```", 1)[0] for b in text[start:end].split("```python\n")[1:]]


def test_docs_section_has_one_example_per_front_end():
    blocks = _docs_blocks()
    imports = ["flax.linen", "from flax import nnx", "import keras", "import equinox", "import haiku",
               "jax_privacy import clipping"]
    assert len(blocks) == 7
    for block, wanted in zip(blocks[1:], imports, strict=True):
        assert wanted in block
    assert "params[\"embed\"][ids]" in blocks[0]  # the plain function


@pytest.mark.parametrize("index", range(7), ids=["jnp", "linen", "nnx", "keras", "equinox", "haiku", "shadow"])
def test_docs_example_runs_as_printed(index, request):
    block = _docs_blocks()[index]
    if "import keras" in block and "keras" in sys.modules and F.keras_module() is None:
        r = subprocess.run([sys.executable, "-c", block], env={**os.environ, "KERAS_BACKEND": "jax"},
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-4000:]
        return
    exec(compile(block, f"docs/python.md example {index}", "exec"), {"__name__": f"docs_example_{index}"})
