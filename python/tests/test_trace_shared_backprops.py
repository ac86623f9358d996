"""A site whose backprops are another site's (`backprops_of`, format `ghost-oracle-trace/3`): a
layer's bias and its weight read one output gradient, which the trace holds once.

Ground truth, independent of the code under test:
- each example's gradient norm by an f64 autograd loop over single examples;
- the unshared twin of an exported trace, built here with safetensors' own writer by copying
  each shared tensor under the bias's name and dropping the key (format /2), which the judge
  reads as traces were read before the key existed.
The exported trace's true norms equal the loop's and the twin's to the bit, with the same
verdicts; it is smaller than the twin by exactly the tensors it shares; the writer refuses a
`backprops_of` that names no site, the site itself, a site that shares in turn, or an array
that differs."""
import json
import math

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

import ghost_oracle
from ghost_oracle._trace.format import TraceExportError
from ghost_oracle._trace.site import Site
from ghost_oracle._trace.writer import write_trace
from ghost_oracle.torch import assert_norms, export_trace

B = 4


class Net(torch.nn.Module):
    """Conv2d + bias, GroupNorm, LayerNorm and Linear + bias: every kind of layer whose bias
    reads its weight's output gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.gn = torch.nn.GroupNorm(2, 4)
        self.ln = torch.nn.LayerNorm(4 * 5 * 5)
        self.fc = torch.nn.Linear(100, 3)
        with torch.no_grad():  # affine parameters away from 1 and 0, so that each matters
            for p in (self.gn.weight, self.gn.bias, self.ln.weight, self.ln.bias):
                p.add_(torch.randn_like(p) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.ln(torch.tanh(self.gn(self.conv(x))).flatten(1)))


SHARED = {"conv.bias": "conv.weight", "gn.bias": "gn.weight", "ln.bias": "ln.weight", "fc.bias": "fc.weight"}


def loss_fn(model, x):
    y = model(x)
    return (y ** 2).sum(1) + y[:, 0]


def loop_norms(model, x):
    """Each example's gradient norm by an f64 autograd loop over single examples."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(loss_fn(model, x[i:i + 1])[0], params)
        out.append(math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads)))
    return torch.tensor(out, dtype=torch.float64)


def build(dtype=torch.float64):
    torch.manual_seed(0)
    return Net().to(dtype), torch.randn(B, 3, 5, 5, dtype=dtype)


def read(path):
    with safe_open(str(path), "np") as f:
        return dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}


def unshared_twin(path, twin):
    """The trace at `path` with every shared tensor written again under the bias's name and no
    `backprops_of`: the file a writer without the key writes."""
    meta, tensors = read(path)
    sites = json.loads(meta["sites"])
    for s in sites:
        other = s.pop("backprops_of", None)
        if other is not None:
            tensors[f"{s['name']}.backprops"] = tensors[f"{other}.backprops"].copy()
    meta["sites"] = json.dumps(sites)
    meta["format"] = "ghost-oracle-trace/2" if any("conv" in s for s in sites) else "ghost-oracle-trace/1"
    save_file(tensors, str(twin), metadata=meta)


def data_bytes(path):
    """The bytes of a safetensors file's tensors: its size less its header."""
    with open(path, "rb") as f:
        raw = f.read()
    return len(raw) - 8 - int.from_bytes(raw[:8], "little")


def true_norms(path):
    report = ghost_oracle.check(path)
    return [float(v) for v in report.true_norms], report


def test_an_exported_model_shares_each_bias_backprops_and_is_judged_as_its_unshared_twin(tmp_path):
    model, x = build()
    truth = loop_norms(model, x)
    c = float(truth.median())
    path, twin = tmp_path / "shared.safetensors", tmp_path / "twin.safetensors"
    specs = export_trace(model, loss_fn, x, path, claimed_norms=truth, max_grad_norm=c)
    assert {s["name"]: s["backprops_of"] for s in specs if "backprops_of" in s} == SHARED
    meta, tensors = read(path)
    assert meta["format"] == "ghost-oracle-trace/3"
    assert json.loads(meta["sites"]) == specs
    for bias in SHARED:
        assert f"{bias}.backprops" not in tensors
    unshared_twin(path, twin)

    got, report = true_norms(path)
    want, twin_report = true_norms(twin)
    assert got == want  # to the bit
    np.testing.assert_allclose(got, truth.numpy(), rtol=1e-10)
    assert str(report.verdict) == str(twin_report.verdict) == "pass"
    # smaller by exactly the shared tensors: the biases' B×rows×out backprops
    _, twin_tensors = read(twin)
    shared = sum(twin_tensors[f"{bias}.backprops"].nbytes for bias in SHARED)
    assert shared == 8 * B * (25 * 4 + 25 * 4 + 100 + 3)  # conv, GroupNorm (positions × channels), LN, fc
    assert data_bytes(twin) - data_bytes(path) == shared

    # one example's claim 0.1 % low fails, through the shared trace
    low = truth.clone()
    low[int(torch.argmax(truth))] *= 0.999
    with pytest.raises(AssertionError, match="privacy-violation|utility-distortion"):
        assert_norms(model, loss_fn, x, low, max_grad_norm=c)


def test_a_float32_model_stored_in_float64_still_shares_and_gives_the_loops_norms(tmp_path):
    model, x = build(torch.float32)
    truth = loop_norms(model.double(), x.double())
    model.float()
    path = tmp_path / "t.safetensors"
    specs = export_trace(model, loss_fn, x, path, claimed_norms=truth, max_grad_norm=float(truth.median()),
                         dtype=torch.float64)
    assert {s["name"]: s.get("backprops_of") for s in specs if s["kind"] == "bias"} == SHARED
    _, tensors = read(path)
    assert all(v.dtype == np.float64 for v in tensors.values())
    got, _ = true_norms(path)
    np.testing.assert_allclose(got, truth.numpy(), rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# The writer.

def sites(bias_backprops=None, backprops_of="fc.weight"):
    rng = np.random.default_rng(0)
    g = rng.standard_normal((B, 2, 3))
    weight = Site(name="fc.weight", param="fc.weight", kind="linear",
                  tensors={"activations": rng.standard_normal((B, 2, 5)), "backprops": g}, precision="f64",
                  origin="module `fc`")
    bias = Site(name="fc.bias", param="fc.bias", kind="bias",
                tensors={"backprops": g if bias_backprops is None else bias_backprops}, precision="f64",
                origin="module `fc`", backprops_of=backprops_of)
    return [weight, bias]


def write(path, given):
    return write_trace(str(path), sites=given, parameters={"fc.weight": 15, "fc.bias": 3},
                       claimed_norms=np.ones(B), max_grad_norm=1.0, clipper="c")


def test_the_writer_writes_a_shared_array_once_and_the_twin_without_the_key_as_before(tmp_path):
    given = sites()
    write(tmp_path / "s.safetensors", given)
    meta, tensors = read(tmp_path / "s.safetensors")
    assert meta["format"] == "ghost-oracle-trace/3"
    assert json.loads(meta["sites"])[1] == {"name": "fc.bias", "param": "fc.bias", "kind": "bias",
                                            "backprops_of": "fc.weight"}
    assert sorted(tensors) == ["claimed.norms", "fc.weight.activations", "fc.weight.backprops"]
    # an equal array elsewhere in memory is the same array
    write(tmp_path / "copy.safetensors", sites(bias_backprops=given[0].tensors["backprops"].copy()))
    with open(tmp_path / "copy.safetensors", "rb") as f, open(tmp_path / "s.safetensors", "rb") as g:
        assert f.read() == g.read()
    # without the key: format /1, the bias's own tensor, as before
    write(tmp_path / "own.safetensors", sites(backprops_of=None))
    own_meta, own = read(tmp_path / "own.safetensors")
    assert own_meta["format"] == "ghost-oracle-trace/1" and "backprops_of" not in own_meta["sites"]
    np.testing.assert_array_equal(own["fc.bias.backprops"], own["fc.weight.backprops"])
    a, _ = true_norms(tmp_path / "s.safetensors")
    b, _ = true_norms(tmp_path / "own.safetensors")
    assert a == b


@pytest.mark.parametrize("spoil, message", [
    (lambda s: setattr(s[1], "backprops_of", "fc.nothing"), "site `fc.bias` (module `fc`): its backprops are said "
                                                            "to be site `fc.nothing`'s, which is not among"),
    (lambda s: setattr(s[1], "backprops_of", "fc.bias"), "`backprops_of` names the site itself"),
    (lambda s: setattr(s[0], "backprops_of", "fc.bias"), "whose backprops are site `fc.weight`'s in turn"),
    (lambda s: s[1].tensors.__setitem__("backprops", s[0].tensors["backprops"] * 1.0000001),
     "site `fc.bias` (module `fc`): its backprops (float64, [4, 2, 3]) are said to be site `fc.weight`'s "
     "(float64, [4, 2, 3]), but differ"),
    (lambda s: s[1].tensors.__setitem__("backprops", s[0].tensors["backprops"].astype(np.float32)),
     "its backprops (float32, [4, 2, 3]) are said to be site `fc.weight`'s (float64, [4, 2, 3]), but differ"),
    # -0.0 against +0.0: equal as numbers, not as bits
    (lambda s: [s[0].tensors.__setitem__("backprops", np.zeros((B, 2, 3))),
                s[1].tensors.__setitem__("backprops", -np.zeros((B, 2, 3)))], "but differ"),
])
def test_the_writer_refuses_a_backprops_of_that_is_not_another_sites_array(tmp_path, spoil, message):
    given = sites()
    spoil(given)
    with pytest.raises(TraceExportError) as refused:
        write(tmp_path / "t.safetensors", given)
    assert message in str(refused.value)
    assert not (tmp_path / "t.safetensors").exists()


# ---------------------------------------------------------------------------------------------
# The JAX exporter: its bias sites reshape the call's one output gradient as the weight's do.

def test_a_flax_model_shares_each_bias_backprops_and_gives_vmap_grads_norms(tmp_path):
    import flax.linen as fnn
    import jax
    import jax.numpy as jnp

    import ghost_oracle.jax as gjax

    class FlaxNet(fnn.Module):
        @fnn.compact
        def __call__(self, x):  # B×5×5×3, channels last
            h = jnp.tanh(fnn.Conv(4, (3, 3), padding="SAME", name="conv")(x)).reshape(x.shape[0], -1)
            return fnn.Dense(3, name="fc")(fnn.LayerNorm(name="ln")(h))

    def loss(apply, x):
        y = apply(x)
        return (y ** 2).sum(-1) + y[..., 0]

    model = FlaxNet()
    x = jax.random.normal(jax.random.key(0), (B, 5, 5, 3))
    params = jax.tree_util.tree_map(lambda a: a + 0.1, model.init(jax.random.key(1), x)["params"])

    def one(p, xi):
        return loss(lambda z: model.apply({"params": p}, z), xi[None])[0]

    grads = jax.vmap(jax.grad(one), in_axes=(None, 0))(params, x)
    truth = np.sqrt(sum((np.asarray(g, dtype=np.float64).reshape(B, -1) ** 2).sum(1)
                        for g in jax.tree_util.tree_leaves(grads)))
    path, twin = tmp_path / "shared.safetensors", tmp_path / "twin.safetensors"
    specs = gjax.export_trace(model, params, loss, x, path, claimed_norms=truth, max_grad_norm=float(np.median(truth)))
    assert {s["name"]: s["backprops_of"] for s in specs if "backprops_of" in s} == \
        {"conv.bias": "conv.kernel", "ln.bias": "ln.scale", "fc.bias": "fc.kernel"}
    meta, tensors = read(path)
    assert meta["format"] == "ghost-oracle-trace/3" and "fc.bias.backprops" not in tensors
    unshared_twin(path, twin)
    got, report = true_norms(path)
    want, twin_report = true_norms(twin)
    assert got == want
    assert str(report.verdict) == str(twin_report.verdict) == "pass"
    np.testing.assert_allclose(got, truth, rtol=1e-4)
    _, twin_tensors = read(twin)
    shared = sum(twin_tensors[f"{n}.backprops"].nbytes for n in ("conv.bias", "ln.bias", "fc.bias"))
    assert data_bytes(twin) - data_bytes(path) == shared == 4 * B * (25 * 4 + 100 + 3)
