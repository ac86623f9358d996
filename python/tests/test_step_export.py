"""The step in a trace: `claimed.clipped_sum.*`, `claimed.update.*` and the header keys written by
`export_trace`, micro-batches traced as one logical batch, `ghost_oracle.opacus.dp_step`, and the
golden step traces (oracles/golden/traces/step/) against the exact clipped sum in float64."""
import copy
import importlib
import json
import math
import os
import sys

import pytest
import torch
from conftest import REPO, TRACES, llama_rmsnorm_in_input_dtype, untied_copy
from safetensors import safe_open
from torch.func import functional_call, grad, vmap

import ghost_oracle
from ghost_oracle.torch import export_trace

opacus = pytest.importorskip("opacus")
import ghost_oracle.opacus as dpo  # noqa: E402

STEP = TRACES / "step"
GOLDEN = ["hooks_tied_gpt2_sigma0", "hooks_tied_gpt2_sigma1", "hooks_llama_microbatches_sigma0",
          "ghost_llama_sigma0", "ghost_llama_two_backward_sigma0"]


def read(path):
    with safe_open(str(path), "pt") as f:
        return dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}


def fake_step(model, dtype=None, seed=0):
    """A tensor per trainable parameter (a tied one once), in the parameter's shape."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g, dtype=dtype or p.dtype) for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------
# export_trace: the new keys.


def test_step_keys_round_trip(tied_gpt2, tmp_trace):
    m = tied_gpt2
    clipped, update = fake_step(m.model, seed=1), fake_step(m.model, seed=2)
    export_trace(m.model, m.loss, m.ids, tmp_trace, claimed_norms=m.exact, max_grad_norm=m.c, noise_multiplier=1.0,
                 clipped_sum=clipped, update=update, batch_divisor=4, clip_stabilizer=1e-6)
    meta, ts = read(tmp_trace)
    listed = json.loads(meta["parameters"])
    assert set(listed) == set(clipped)  # the tied head once, under its embedding's name
    assert {k for k in ts if k.startswith("claimed.clipped_sum.")} == {f"claimed.clipped_sum.{n}" for n in listed}
    assert {k for k in ts if k.startswith("claimed.update.")} == {f"claimed.update.{n}" for n in listed}
    for n, p in m.model.named_parameters():
        assert ts[f"claimed.clipped_sum.{n}"].shape == p.shape and ts[f"claimed.clipped_sum.{n}"].dtype == torch.float32
        assert torch.equal(ts[f"claimed.clipped_sum.{n}"], clipped[n])
        assert torch.equal(ts[f"claimed.update.{n}"], update[n])
    # Conv1D: the in×out weight as stored; the tied parameter: its embedding's table
    assert ts["claimed.update.transformer.h.0.attn.c_attn.weight"].shape == (12, 36)
    assert ts["claimed.update.transformer.wte.weight"].shape == (19, 12)
    assert "claimed.update.lm_head.weight" not in ts
    assert meta["batch_divisor"] == "4.0" and float(meta["batch_divisor"]) == 4
    assert float(meta["clip_stabilizer"]) == 1e-6 and meta["clipping"] == "flat"
    assert float(meta["noise_multiplier"]) == 1.0


def test_a_trace_without_the_step_has_no_step_keys(tied_gpt2, tmp_trace):
    m = tied_gpt2
    export_trace(m.model, m.loss, m.ids, tmp_trace, claimed_norms=m.exact, max_grad_norm=m.c)
    meta, ts = read(tmp_trace)
    assert not {"batch_divisor", "clip_stabilizer", "clipping"} & set(meta)
    assert not [k for k in ts if k.startswith(("claimed.clipped_sum.", "claimed.update."))]


def test_clipped_sum_alone_in_other_dtypes_shapes_and_names(tied_gpt2, tmp_trace):
    """Either key alone; the dtype as given; any shape with the parameter's element count (here
    flat), stored in the parameter's shape; a tied parameter under its head's name."""
    m = tied_gpt2
    clipped = {n: t.reshape(-1).to(torch.bfloat16 if "ln_" in n else torch.float64)
               for n, t in fake_step(m.model).items()}
    clipped["lm_head.weight"] = clipped.pop("transformer.wte.weight")
    export_trace(m.model, m.loss, m.ids, tmp_trace, claimed_norms=m.exact, max_grad_norm=m.c, clipped_sum=clipped,
                 clipping="automatic", clip_stabilizer=1e-6)
    meta, ts = read(tmp_trace)
    assert "batch_divisor" not in meta and meta["clipping"] == "automatic" and float(meta["clip_stabilizer"]) == 1e-6
    assert not [k for k in ts if k.startswith("claimed.update.")]
    wte = ts["claimed.clipped_sum.transformer.wte.weight"]
    assert wte.shape == (19, 12) and wte.dtype == torch.float64
    assert torch.equal(wte.reshape(-1), clipped["lm_head.weight"])
    assert ts["claimed.clipped_sum.transformer.h.0.ln_1.weight"].dtype == torch.bfloat16
    assert ts["claimed.clipped_sum.transformer.h.0.mlp.c_fc.weight"].shape == (12, 48)


def _bad(model, what):
    good = fake_step(model)
    cases = {
        "unknown": ({**good, "transformer.h.0.attn.nope.weight": torch.zeros(3)},
                    r"`transformer.h.0.attn.nope.weight` is not a parameter of the model"),
        "missing": ({k: v for k, v in good.items() if k != "transformer.h.0.mlp.c_fc.bias"},
                    r"no tensor for parameter\(s\) `transformer.h.0.mlp.c_fc.bias`"),
        "numel": ({**good, "transformer.wpe.weight": torch.zeros(16, 11)},
                  r"parameter `transformer.wpe.weight` has shape \[16, 11\] \(176 elements\); the parameter has "
                  r"shape \[16, 12\] \(192 elements\)"),
        "not a tensor": ({**good, "transformer.ln_f.bias": [0.0] * 12},
                         r"the value for parameter `transformer.ln_f.bias` is a list, not a tensor"),
        "integer": ({**good, "transformer.ln_f.bias": torch.zeros(12, dtype=torch.int64)},
                    r"parameter `transformer.ln_f.bias` has dtype torch.int64"),
        "tied twice": ({**good, "lm_head.weight": good["transformer.wte.weight"]},
                       r"parameter `transformer.wte.weight` is given twice, as `transformer.wte.weight` and "
                       r"`lm_head.weight`"),
    }
    return {k: ({what: v[0]}, v[1]) for k, v in cases.items()}


@pytest.mark.parametrize("what", ["clipped_sum", "update"])
@pytest.mark.parametrize("case", ["unknown", "missing", "numel", "not a tensor", "integer", "tied twice"])
def test_bad_step_tensors_are_refused_naming_the_parameter(tied_gpt2, tmp_path, what, case):
    m = tied_gpt2
    kwargs, message = _bad(m.model, what)[case]
    path = tmp_path / "t.safetensors"
    with pytest.raises(ValueError, match=f"^{what}: .*" + message):
        export_trace(m.model, m.loss, m.ids, path, claimed_norms=m.exact, max_grad_norm=m.c, batch_divisor=4,
                     **kwargs)
    assert not path.exists()


def test_bad_step_header_values_are_refused(tied_gpt2, tmp_path):
    m = tied_gpt2
    path = tmp_path / "t.safetensors"
    step = fake_step(m.model)

    def export(**kw):
        export_trace(m.model, m.loss, m.ids, path, claimed_norms=m.exact, max_grad_norm=m.c, **kw)

    with pytest.raises(ValueError, match="update needs batch_divisor"):
        export(update=step)
    for d in (0, -4, float("nan"), "four"):
        with pytest.raises(ValueError, match="batch_divisor must be a"):
            export(update=step, batch_divisor=d)
    with pytest.raises(ValueError, match="clip_stabilizer must be a non-negative number"):
        export(clipped_sum=step, clip_stabilizer=-1e-6)
    with pytest.raises(ValueError, match="clipping must be \"flat\".*got 'per_layer'"):
        export(clipped_sum=step, clipping="per_layer")
    with pytest.raises(TypeError, match="update must be a dict"):
        export(update=list(step.values()), batch_divisor=4)
    frozen = copy.deepcopy(m.model)
    frozen.transformer.ln_f.bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"parameter `transformer.ln_f.bias` is not trainable"):
        export_trace(frozen, m.loss, m.ids, path, claimed_norms=m.exact, max_grad_norm=m.c, clipped_sum=step)
    assert not path.exists()


def test_a_frozen_parameter_is_left_out_of_the_step(tied_gpt2, tmp_trace):
    m = tied_gpt2
    frozen = copy.deepcopy(m.model)
    frozen.transformer.ln_f.bias.requires_grad_(False)
    step = {k: v for k, v in fake_step(m.model).items() if k != "transformer.ln_f.bias"}
    export_trace(frozen, m.loss, m.ids, tmp_trace, claimed_norms=m.exact, max_grad_norm=m.c, clipped_sum=step)
    _, ts = read(tmp_trace)
    assert "claimed.clipped_sum.transformer.ln_f.bias" not in ts
    assert len([k for k in ts if k.startswith("claimed.clipped_sum.")]) == len(step)


# ---------------------------------------------------------------------------------------------
# Micro-batches: the trace of the logical batch.


def test_micro_batches_are_traced_as_their_concatenation(tied_gpt2, tmp_path):
    m = tied_gpt2
    whole, parts = tmp_path / "whole.safetensors", tmp_path / "parts.safetensors"
    export_trace(m.model, m.loss, m.ids, whole, claimed_norms=m.exact, max_grad_norm=m.c)
    seen = []

    def norms(model, batch):
        seen.append(batch)
        return m.exact

    export_trace(m.model, m.loss, [m.ids[:1], m.ids[1:3], m.ids[3:]], parts, claimed_norms=norms, max_grad_norm=m.c)
    assert len(seen) == 1 and torch.equal(seen[0], m.ids)
    (meta_w, ts_w), (meta_p, ts_p) = read(whole), read(parts)
    assert meta_w == meta_p and ts_w.keys() == ts_p.keys()
    for k in ts_w:
        assert torch.equal(ts_w[k], ts_p[k]), k
    assert ts_p["transformer.wte.weight.ids"].shape == (4, 12)


def test_dict_micro_batches(tied_gpt2, tmp_trace):
    m = tied_gpt2

    def loss(model, batch):
        assert batch["flag"] == "x"
        return m.loss(model, batch["input_ids"])

    seen = []

    def norms(model, batch):
        seen.append(batch)
        return m.exact

    shared = torch.arange(12).unsqueeze(0)
    mbs = [{"input_ids": m.ids[:1], "attention_mask": torch.ones(1, 12), "shared": shared, "flag": "x"},
           {"input_ids": m.ids[1:], "attention_mask": torch.ones(3, 12), "shared": shared.clone(), "flag": "x"}]
    export_trace(m.model, loss, mbs, tmp_trace, claimed_norms=norms, max_grad_norm=m.c)
    _, ts = read(tmp_trace)
    assert torch.equal(ts["transformer.wte.weight.ids"], m.ids)
    (batch,) = seen
    assert torch.equal(batch["input_ids"], m.ids) and batch["attention_mask"].shape == (4, 12)
    assert torch.equal(batch["shared"], shared) and batch["flag"] == "x"


def test_bad_micro_batches_are_refused(tied_gpt2, tmp_path):
    m = tied_gpt2
    path = tmp_path / "t.safetensors"

    def export(inputs):
        export_trace(m.model, m.loss, inputs, path, claimed_norms=m.exact, max_grad_norm=m.c)

    with pytest.raises(ValueError, match="micro-batch 1 has sequence length T = 8 but micro-batch 0 has T = 12"):
        export([m.ids[:2], m.ids[2:, :8]])
    with pytest.raises(ValueError, match="inputs is an empty list"):
        export([])
    with pytest.raises(ValueError, match="micro-batch 1 has keys"):
        export([{"input_ids": m.ids[:2]}, {"input_ids": m.ids[2:], "attention_mask": torch.ones(2, 12)}])
    with pytest.raises(ValueError, match=r"micro-batch 1: `mask` has shape \[3, 12\]; to be concatenated"):
        export([{"input_ids": m.ids[:2], "mask": torch.ones(2, 12)},
                {"input_ids": m.ids[2:], "mask": torch.ones(3, 12)}])
    with pytest.raises(ValueError, match="`flag` differs between micro-batches"):
        export([{"input_ids": m.ids[:2], "flag": 1}, {"input_ids": m.ids[2:], "flag": 2}])
    with pytest.raises(TypeError, match="micro-batch 1: inputs must be a tensor"):
        export([m.ids[:2], "tokens"])
    with pytest.raises(ValueError, match="claimed_norms has 4 values; the batch has 2 examples"):
        export([m.ids[:1], m.ids[1:2]])
    assert not path.exists()


# ---------------------------------------------------------------------------------------------
# ghost_oracle.opacus.dp_step.


def test_dp_step_hooks_mode_on_a_tied_gpt2(tied_gpt2, tmp_trace):
    m = tied_gpt2
    before = {n: p.detach().clone() for n, p in m.model.named_parameters()}
    step = dpo.dp_step(m.model, m.loss, m.ids, max_grad_norm=m.c, noise_multiplier=0.0)
    assert all(torch.equal(before[n], p) for n, p in m.model.named_parameters())  # weights untouched
    assert list(step.clipped_sum) == [n for n, _ in m.model.named_parameters()]  # the tied parameter once
    assert step.batch_divisor == 4.0 and step.expected_batch_size == 4 and step.accumulated_iterations == 1
    torch.testing.assert_close(step.norms, m.exact.double(), rtol=1e-5, atol=0)
    torch.testing.assert_close(step.coefficients, (m.c / (step.norms + 1e-6)).clamp(max=1), rtol=1e-6, atol=0)
    for n, p in m.model.named_parameters():
        assert step.update[n].shape == p.shape and step.clipped_sum[n].dtype == p.dtype
        torch.testing.assert_close(step.update[n] * 4, step.clipped_sum[n])  # σ = 0: u·D = K
    export_trace(m.model, m.loss, step.inputs, tmp_trace, clipper="opacus-hooks", **step.export_kwargs())
    meta, ts = read(tmp_trace)
    assert float(meta["clip_stabilizer"]) == 1e-6 and float(meta["batch_divisor"]) == 4
    assert float(meta["noise_multiplier"]) == 0.0
    assert torch.equal(ts["claimed.coefficients"], step.coefficients)
    assert ghost_oracle.check(tmp_trace).passed


def test_dp_step_noise_is_seeded(tied_gpt2):
    m = tied_gpt2
    a, b, c = (dpo.dp_step(m.model, m.loss, m.ids, max_grad_norm=m.c, noise_multiplier=1.0, seed=s)
               for s in (5, 5, 6))
    name = "transformer.wte.weight"
    assert torch.equal(a.update[name], b.update[name]) and not torch.equal(a.update[name], c.update[name])
    assert torch.equal(a.clipped_sum[name], c.clipped_sum[name])
    # the noise: (u·D − K) / (σC) is standard normal, entry by entry
    r = torch.cat([(a.update[n] * a.batch_divisor - a.clipped_sum[n]).reshape(-1) for n in a.update]) / m.c
    assert abs(float(r.std()) - 1.0) < 0.1 and abs(float(r.mean())) < 0.1


def test_dp_step_micro_batches(tied_gpt2):
    m = tied_gpt2
    one = dpo.dp_step(m.model, m.loss, m.ids, max_grad_norm=m.c, noise_multiplier=0.0)
    skip = dpo.dp_step(m.model, m.loss, [m.ids[:2], m.ids[2:]], max_grad_norm=m.c, noise_multiplier=0.0)
    acc = dpo.dp_step(m.model, m.loss, [m.ids[:2], m.ids[2:]], max_grad_norm=m.c, noise_multiplier=0.0,
                      accumulation="backward")
    assert (skip.batch_divisor, skip.expected_batch_size, skip.accumulated_iterations) == (4.0, 4, 1)
    assert (acc.batch_divisor, acc.expected_batch_size, acc.accumulated_iterations) == (4.0, 2, 2)
    for s in (skip, acc):
        torch.testing.assert_close(s.norms, one.norms, rtol=1e-6, atol=0)
        for n in one.clipped_sum:
            torch.testing.assert_close(s.clipped_sum[n], one.clipped_sum[n], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(s.update[n], one.update[n], rtol=1e-5, atol=1e-6)
    assert len(skip.inputs) == 2 and skip.accumulation == "skip_step" and one.accumulation == "none"


def test_dp_step_ghost_mode(tied_gpt2):
    m = tied_gpt2
    with pytest.raises(NotImplementedError, match="Parameter tying is not supported with Ghost Clipping"):
        dpo.dp_step(m.model, m.loss, m.ids, max_grad_norm=m.c, noise_multiplier=0.0, grad_sample_mode="ghost")
    untied = untied_copy(m.model, *m.untie)
    one = dpo.dp_step(untied, m.loss, m.ids, max_grad_norm=m.c, noise_multiplier=0.0, grad_sample_mode="ghost")
    hooks = dpo.dp_step(untied, m.loss, m.ids, max_grad_norm=m.c, noise_multiplier=0.0)
    torch.testing.assert_close(one.norms, hooks.norms, rtol=1e-5, atol=0)
    for n in hooks.clipped_sum:
        torch.testing.assert_close(one.clipped_sum[n], hooks.clipped_sum[n], rtol=1e-4, atol=1e-5)
    skip = dpo.dp_step(untied, m.loss, [m.ids[:2], m.ids[2:]], max_grad_norm=m.c, noise_multiplier=0.0,
                       grad_sample_mode="ghost")
    for n in one.clipped_sum:
        torch.testing.assert_close(skip.clipped_sum[n], one.clipped_sum[n], rtol=1e-4, atol=1e-5)
    # two backward passes, one step: only the last micro-batch's clipped sum is kept, and the
    # ghost optimizer counts one accumulated iteration
    two = dpo.dp_step(untied, m.loss, [m.ids[:2], m.ids[2:]], max_grad_norm=m.c, noise_multiplier=0.0,
                      grad_sample_mode="ghost", accumulation="backward")
    last = dpo.dp_step(untied, m.loss, m.ids[2:], max_grad_norm=m.c, noise_multiplier=0.0, grad_sample_mode="ghost")
    assert (two.batch_divisor, two.expected_batch_size, two.accumulated_iterations) == (2.0, 2, 1)
    torch.testing.assert_close(two.norms, one.norms, rtol=1e-5, atol=0)  # the norms are right
    for n in one.clipped_sum:
        torch.testing.assert_close(two.clipped_sum[n], last.clipped_sum[n], rtol=1e-5, atol=1e-6)


def test_dp_step_argument_errors(tied_gpt2):
    m = tied_gpt2
    kw = dict(max_grad_norm=m.c, noise_multiplier=0.0)
    with pytest.raises(ValueError, match="grad_sample_mode must be"):
        dpo.dp_step(m.model, m.loss, m.ids, grad_sample_mode="functorch", **kw)
    with pytest.raises(ValueError, match="accumulation must be"):
        dpo.dp_step(m.model, m.loss, m.ids, accumulation="sum", **kw)
    with pytest.raises(ValueError, match="inputs is an empty list"):
        dpo.dp_step(m.model, m.loss, [], **kw)
    with pytest.raises(ValueError, match=r"micro-batch 0: per_example_loss returned \(\)"):
        dpo.dp_step(m.model, lambda g, x: m.loss(g, x).sum(), m.ids, **kw)


# ---------------------------------------------------------------------------------------------
# The golden step traces against the exact clipped sum, in float64.


@pytest.fixture(scope="module")
def script():
    sys.path.insert(0, str(REPO / "python" / "scripts"))
    try:
        return importlib.import_module("make_step_traces")
    finally:
        sys.path.pop(0)


def exact_float64(model, loss, ids, c):
    """(n*, c*, {param: Σ_i c*_i g*_i}): per-example gradients of a float64 copy of the model by
    torch.func (grad of each example's own loss, vmapped over the batch; RMSNorm in float64),
    c* = min(1, C / (n* + 1e-6))."""
    m = llama_rmsnorm_in_input_dtype(copy.deepcopy(model).double().eval())
    params = {k: v.detach() for k, v in m.named_parameters()}

    def one(p, x):
        return loss(lambda i, **kw: functional_call(m, p, (i,), kw), x.unsqueeze(0))[0]

    g = vmap(grad(one), in_dims=(None, 0))(params, ids)
    n = sum((v.reshape(ids.shape[0], -1) ** 2).sum(1) for v in g.values()).sqrt()
    coef = torch.clamp(c / (n + 1e-6), max=1.0)
    return n, coef, {k: (coef.view(-1, *[1] * (v.dim() - 1)) * v).sum(0) for k, v in g.items()}


def relative_error(claimed, exact):
    num = sum(float((claimed[k].double() - exact[k]).pow(2).sum()) for k in exact)
    return math.sqrt(num / sum(float(v.pow(2).sum()) for v in exact.values()))


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_step_traces(script, name):
    family, mode, sigma, sizes, _ = script.CASES[name]
    model, loss, ids = script.MODELS[family](), script.LOSSES[family], script.BATCHES[family]()
    meta, ts = read(STEP / f"{name}.safetensors")
    c = float(meta["max_grad_norm"])
    n, coef, exact = exact_float64(model, loss, ids, c)
    # the model rebuilt here is the one the trace was made from: Opacus's norms are its norms
    torch.testing.assert_close(ts["claimed.norms"], n, rtol=1e-5, atol=0)
    torch.testing.assert_close(ts["claimed.coefficients"], coef, rtol=1e-5, atol=0)
    assert sum(1 for x in coef if x < 1) == 2  # two of the four examples clipped
    params = json.loads(meta["parameters"])
    assert params == {k: p.numel() for k, p in model.named_parameters()}
    assert ts["transformer.wte.weight.ids" if family == "gpt2" else "model.embed_tokens.weight.ids"].shape == (4, 10)
    clipped = {k: ts[f"claimed.clipped_sum.{k}"] for k in params}
    update = {k: ts[f"claimed.update.{k}"] for k in params}
    for k, p in model.named_parameters():
        assert clipped[k].shape == update[k].shape == p.shape and clipped[k].dtype == torch.float32
    assert float(meta["clip_stabilizer"]) == 1e-6 and meta["clipping"] == "flat"
    assert float(meta["noise_multiplier"]) == sigma and meta["clipper"] == f"opacus-{mode}"
    d = float(meta["batch_divisor"])
    err = relative_error(clipped, exact)
    if name == "ghost_llama_two_backward_sigma0":
        assert d == 2.0  # the micro-batch's size: one accumulated iteration
        assert err > 0.5
        _, _, last = exact_float64(model, loss, ids[sizes[0]:], c)  # the last micro-batch's exact sum
        assert relative_error(clipped, last) < 1e-5
    else:
        assert d == 4.0
        assert err < 1e-5, err
    noise = math.sqrt(sum(float((update[k].double() * d - clipped[k].double()).pow(2).sum()) for k in params))
    if sigma == 0:
        assert noise <= 1e-6 * math.sqrt(sum(float(v.double().pow(2).sum()) for v in clipped.values()))
    else:
        entries = sum(params.values())
        assert abs(noise / (sigma * c * math.sqrt(entries)) - 1) < 0.1


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_step_traces_are_read_by_check(name):
    report = ghost_oracle.check(STEP / f"{name}.safetensors")
    assert report.precision == "f32"


def test_automatic_clipping_without_a_stabilizer_is_refused_before_writing(tied_gpt2, tmp_trace):
    """C/(n + γ) with γ = 0 has no bound for a zero gradient; the reader refuses such a trace, so
    the exporter refuses to write one."""
    m = tied_gpt2
    with pytest.raises(ValueError, match=r'^clipping "automatic" .* needs γ > 0 \(clip_stabilizer\), got 0$'):
        export_trace(m.model, m.loss, m.ids, tmp_trace, claimed_norms=m.exact, max_grad_norm=m.c,
                     clipped_sum=fake_step(m.model), clipping="automatic")
    assert not os.path.exists(tmp_trace)
