"""Low precision: bf16 and f16 models, and an f32 model under autocast, exported per site and
judged at the precision each site computed in.

The models are tiny tied Llamas (python/scripts/make_precision_traces.py's shape). The correct
claims are the norms the trace's own factors give (materialized here in float64, independently
of the oracle) and Opacus 1.6's, as its DPOptimizer computes them; 0.9× either must fail.
"""
import copy
import json
import math

import pytest
import torch
import transformers
from conftest import TRACES
from safetensors import safe_open
from safetensors.torch import save_file

import ghost_oracle
import ghost_oracle.torch.kinds.norm as X
import ghost_oracle.torch.record as R
from ghost_oracle.torch import TraceExportError, export_trace

B, T, V = 4, 16, 64
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
PRECISION = TRACES / "precision"
GOLDEN = sorted(p.name for p in PRECISION.glob("*.safetensors"))


def tied_llama(dtype=torch.float32):
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=True, initializer_range=0.1, attention_dropout=0.0,
                                   bos_token_id=0, eos_token_id=0)
    torch.manual_seed(23)
    model = transformers.LlamaForCausalLM(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model.to(dtype).train()


def batch():
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(4))
    ids[:, 9] = ids[:, 1]  # a repeated token
    return ids


def loss_under(autocast=None):
    """Each example's mean next-token cross entropy, logits upcast to float32; the forward under
    `torch.autocast("cpu", dtype=autocast)` when given."""
    def per_example_loss(model, ids):
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            logits = model(ids).logits.float()
            losses = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1),
                                                       reduction="none")
            return losses.view(ids.shape[0], -1).mean(1)
    return per_example_loss


SETTINGS = {  # name -> (model dtype, autocast dtype)
    "bf16": (torch.bfloat16, None),
    "autocast_bf16": (torch.float32, torch.bfloat16),
}


def export(setting, path, claimed=None, c=1.0, **kw):
    dtype, autocast = SETTINGS[setting] if isinstance(setting, str) else setting
    model = tied_llama(dtype)
    claimed = torch.ones(B) if claimed is None else claimed
    specs = export_trace(model, loss_under(autocast), batch(), str(path), claimed_norms=claimed, max_grad_norm=c,
                         clipper=str(setting), **kw)
    return model, specs


def header(path):
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    return meta, json.loads(meta["sites"]), dtypes


def factor_norms(path):
    """‖g_i*‖ from the trace's factors: every site's per-example gradient in float64, the sites
    of a parameter summed."""
    with safe_open(str(path), "pt") as f:
        grads = {}
        for s in json.loads(f.metadata()["sites"]):
            n = s["name"]
            d = f.get_tensor(f"{s.get('backprops_of', n)}.backprops").double()  # a bias reads its layer's
            if s["kind"] == "embedding":
                ids = f.get_tensor(f"{n}.ids")
                g = torch.zeros(d.shape[0], s["vocab"], d.shape[2], dtype=torch.float64)
                g.scatter_add_(1, ids.unsqueeze(-1).expand(-1, -1, d.shape[2]), d)
            elif s["kind"] == "bias":
                g = d.sum(1)
            elif s["kind"] == "layernorm":
                g = (d * f.get_tensor(f"{n}.activations").double()).sum(1)
            else:
                assert s["kind"] == "linear"
                g = torch.einsum("bto,bti->boi", d, f.get_tensor(f"{n}.activations").double())
            g = g.reshape(B, -1)
            grads[s["param"]] = grads[s["param"]] + g if s["param"] in grads else g
    return sum((g ** 2).sum(1) for g in grads.values()).sqrt()


def with_claims(src, dst, norms, c=None):
    """A copy of the trace `src` with other claimed norms (and C), the coefficients min(1, C/n):
    the factors bit for bit."""
    with safe_open(str(src), "pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "claimed.coefficients"}
    tensors["claimed.norms"] = torch.as_tensor(norms, dtype=torch.float64).contiguous()
    if c is not None:
        meta["max_grad_norm"] = repr(float(c))
    save_file(tensors, str(dst), metadata=meta)
    return dst


def midpoint(norms):
    s = torch.as_tensor(norms, dtype=torch.float64).sort().values
    return float((s[len(s) // 2 - 1] + s[len(s) // 2]) / 2)


def describe(report):
    k = report.worst
    return (f"verdict {k.verdict}, precision {report.precision}, max err/bound {k.max_err_units:.3g}, "
            f"max |n-n*|/n* {k.max_norm_rel_err:.3g}, bound {list(map(float, k.bound))}, "
            f"max c·n*/C {k.max_sensitivity_ratio:.5f}")


# ---------------------------------------------------------------------------------------------
# What the exporter records.


@pytest.mark.parametrize("autocast, name", [(torch.bfloat16, "bf16"), (torch.float16, "f16")])
def test_autocast_records_each_sites_precision(tmp_path, autocast, name):
    try:
        with torch.autocast("cpu", dtype=autocast):
            torch.nn.Linear(2, 2)(torch.ones(1, 2))
    except RuntimeError as e:  # f16 autocast on CPU is recent in torch
        pytest.skip(f"this torch has no CPU autocast in {name}: {e}")
    path = tmp_path / "t.safetensors"
    export((torch.float32, autocast), path)
    meta, sites, dtypes = header(path)
    assert meta["compute_dtype"] == name  # the coarsest site
    low = {"bf16": "BF16", "f16": "F16"}[name]
    for s in sites:
        matmul = s["name"].split(".")[-2] in LINEAR
        assert s["compute_dtype"] == (name if matmul else "f32"), s
        assert s["kind"] == ("linear" if matmul else "embedding" if "embed" in s["name"] else "layernorm")
        own = {"activations": s["name"], "backprops": s.get("backprops_of", s["name"])}
        stored = {dtypes[f"{own[t]}.{t}"] for t in own if f"{own[t]}.{t}" in dtypes}
        assert stored == {low if matmul else "F32"}, s  # factors as the matmul saw them
    head = next(s for s in sites if s["name"] == "lm_head.weight")
    assert head == {"name": "lm_head.weight", "param": "model.embed_tokens.weight", "kind": "linear",
                    "compute_dtype": name}
    assert next(s for s in sites if s["name"] == "model.embed_tokens.weight")["compute_dtype"] == "f32"


@pytest.mark.parametrize("dtype, name, stored", [(torch.bfloat16, "bf16", "BF16"), (torch.float16, "f16", "F16")])
def test_a_low_precision_model_records_one_precision(tmp_path, dtype, name, stored):
    path = tmp_path / "t.safetensors"
    export((dtype, None), path)
    meta, sites, dtypes = header(path)
    assert meta["compute_dtype"] == name
    assert all("compute_dtype" not in s for s in sites)  # written only where the sites differ
    assert {d for k, d in dtypes.items() if k.endswith((".activations", ".backprops"))} == {stored}


def test_autocast_activations_are_what_the_matmul_saw(tmp_path):
    model = tied_llama()
    seen = {}

    def keep(module, args, output):
        seen["h"] = output.detach()

    h = model.model.norm.register_forward_hook(keep)
    try:
        export_trace(model, loss_under(torch.bfloat16), batch(), str(tmp_path / "t.safetensors"),
                     claimed_norms=torch.ones(B), max_grad_norm=1.0)
    finally:
        h.remove()
    assert seen["h"].dtype == torch.float32  # the final norm computes in f32 under autocast
    with safe_open(str(tmp_path / "t.safetensors"), "pt") as f:
        a = f.get_tensor("lm_head.weight.activations")
        assert f.get_tensor("lm_head.weight.backprops").dtype == torch.bfloat16
        assert f.get_tensor("model.norm.weight.activations").dtype == torch.float32
    assert a.dtype == torch.bfloat16 and torch.equal(a, seen["h"].to(torch.bfloat16))


def test_the_parameters_precision_alone_refuses_autocast(tmp_path, monkeypatch):
    # The behaviour before per-site precision: every site judged at the parameters' f32. The
    # bf16 matmuls' weight gradients then miss autograd's by bf16 rounding, far over an f32
    # tolerance.
    monkeypatch.setattr(R, "site_dtype", lambda module, output: module.weight.dtype)
    with pytest.raises(TraceExportError) as e:
        export("autocast_bf16", tmp_path / "t.safetensors")
    assert "differs from autograd's" in str(e.value) and "computed in f32" in str(e.value)
    assert not (tmp_path / "t.safetensors").exists()


@pytest.mark.parametrize("setting", [(torch.float32, None), (torch.bfloat16, None), (torch.float16, None),
                                     (torch.float32, torch.bfloat16)], ids=["f32", "bf16", "f16", "autocast_bf16"])
def test_the_sketched_self_check_passes_each_precision_and_refuses_autocast_judged_at_f32(tmp_path, monkeypatch,
                                                                                        setting):
    # The check of 1B-class parameters (through a ±1 probe matrix) forced on the tiny model: its
    # bound, summed through the probe, holds every precision's rounding, and still refuses
    # bf16 matmuls judged at f32 (their gradients miss autograd's by bf16 rounding).
    from ghost_oracle._trace import check as C

    monkeypatch.setattr(C, "FULL_CHECK_PRODUCTS", 0)
    export(setting, tmp_path / "t.safetensors")
    if setting[1] is not None:
        monkeypatch.setattr(R, "site_dtype", lambda module, output: module.weight.dtype)
        with pytest.raises(TraceExportError, match="through a ±1 probe matrix") as e:
            export(setting, tmp_path / "u.safetensors")
        assert "computed in f32" in str(e.value)


def test_the_bf16_self_check_still_catches_a_wrong_rmsnorm(tmp_path, monkeypatch):
    # bf16 tolerances follow the arithmetic (f32 accumulation), so they are a small fraction of
    # Σ|terms|: an RMSNorm rebuilt with the wrong ε is refused, not waved through.
    def wrong_eps(use, x):
        xc = x.float()
        return (xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + 1.0)).to(x.dtype), x.dtype

    monkeypatch.setattr(X, "_normalized", wrong_eps)
    with pytest.raises(TraceExportError) as e:
        export("bf16", tmp_path / "t.safetensors")
    assert "layernorm.weight`" in str(e.value) and "LlamaRMSNorm" in str(e.value) and "computed in bf16" in str(e.value)


def test_an_explicit_storage_dtype_stores_every_site_in_it(tmp_path):
    path = tmp_path / "t.safetensors"
    export("autocast_bf16", path, dtype=torch.float64)
    meta, sites, dtypes = header(path)
    assert meta["compute_dtype"] == "bf16"  # the precision is the computation's, not the file's
    assert {s["compute_dtype"] for s in sites} == {"bf16", "f32"}
    assert {d for k, d in dtypes.items() if k.endswith((".activations", ".backprops"))} == {"F64"}


# ---------------------------------------------------------------------------------------------
# Verdicts. The bf16 bound is the judge's; these state what it must decide.


@pytest.fixture(scope="module", params=list(SETTINGS))
def exported(request, tmp_path_factory):
    setting = request.param
    path = tmp_path_factory.mktemp(setting) / f"{setting}.safetensors"
    export(setting, path)
    truth = factor_norms(path)
    return setting, path, truth, midpoint(truth)


def test_the_oracles_truth_is_the_factors_norm(exported):
    setting, path, truth, c = exported
    report = ghost_oracle.check(with_claims(path, path.with_name("exact.safetensors"), truth, c))
    torch.testing.assert_close(torch.tensor(report.true_norms.tolist(), dtype=torch.float64), truth, rtol=1e-9, atol=0)


def right_at_bf16(report):
    """An exact claim at bf16 is never called wrong: it passes, or the judge cannot judge it
    because the model's own bf16 rounding (measured by the exporter's replays, a few percent of
    the norm on this tiny tied Llama) lets a claim within the bound clip an example past
    C·(1 + δ), with that reason given."""
    if not report.passed:
        assert report.verdict == "cannot-judge", describe(report)
        assert "the model's own rounding" in (report.cannot_judge_reason or ""), describe(report)


def test_the_factors_norms_pass(exported):
    setting, path, truth, c = exported
    report = ghost_oracle.check(with_claims(path, path.with_name("exact.safetensors"), truth, c))
    assert report.precision == "bf16"
    right_at_bf16(report)


def test_0_9_times_the_factors_norms_fail(exported):
    setting, path, truth, c = exported
    report = ghost_oracle.check(with_claims(path, path.with_name("low.safetensors"), 0.9 * truth, c))
    assert not report.passed, describe(report)
    assert report.max_sensitivity_ratio > 1.05


def opacus_norms(setting, **kw):
    """The norms Opacus 1.6's DPOptimizer clips by (hooks mode), through the package's adapter."""
    pytest.importorskip("opacus")
    from opacus import GradSampleModule

    import ghost_oracle.opacus

    dtype, autocast = SETTINGS[setting]
    gsm = GradSampleModule(copy.deepcopy(tied_llama(dtype)), batch_first=True, loss_reduction="sum")
    return ghost_oracle.opacus.norms(gsm, loss_under(autocast), batch(), **kw)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_as_optimizer_is_dpoptimizers_arithmetic(setting):
    pytest.importorskip("opacus")
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    dtype, autocast = SETTINGS[setting]
    gsm = GradSampleModule(copy.deepcopy(tied_llama(dtype)), batch_first=True, loss_reduction="sum")
    opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=1.0,
                      expected_batch_size=B, loss_reduction="sum")
    loss_under(autocast)(gsm, batch()).sum().backward()
    # clip_and_accumulate's two lines
    per_param = [g.reshape(len(g), -1).norm(2, dim=-1) for g in opt.grad_samples]
    want = torch.stack(per_param, dim=1).norm(2, dim=1).double()
    got = ghost_oracle.opacus.per_sample_norms(gsm, as_optimizer=True)
    assert torch.equal(got, want)
    exact = ghost_oracle.opacus.per_sample_norms(gsm)
    if setting == "bf16":  # rounded to bf16, where the float64 norms of the grad samples are not
        assert torch.equal(got, got.to(torch.bfloat16).double())
        assert not torch.equal(exact, exact.to(torch.bfloat16).double())
    torch.testing.assert_close(got, exact, rtol=2 ** -7, atol=0)


def test_opacus_norms_pass_and_0_9_times_them_fail(exported, tmp_path):
    setting, path, truth, _ = exported
    claimed = opacus_norms(setting, as_optimizer=True)
    rel = float(((claimed - truth).abs() / truth).max())
    assert rel < 2 * 2 ** -8, rel  # two roundings to bf16 at most, and a little accumulation
    c = midpoint(claimed)
    ok = ghost_oracle.check(with_claims(path, tmp_path / "opacus.safetensors", claimed, c))
    right_at_bf16(ok)
    low = ghost_oracle.check(with_claims(path, tmp_path / "opacus_low.safetensors", 0.9 * claimed, c))
    assert not low.passed, describe(low)


# ---------------------------------------------------------------------------------------------
# The committed traces (python/scripts/make_precision_traces.py).


def test_the_golden_precision_traces_are_there():
    assert GOLDEN == [f"{s}_t{t}.safetensors" for s in ("autocast_bf16", "bf16") for t in (10, 128, 32)]


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_opacus_traces_pass(name):
    path = PRECISION / name
    record = json.loads((PRECISION / "precision.json").read_text())[name.removesuffix(".safetensors")]
    meta, sites, _ = header(path)
    assert meta["compute_dtype"] == "bf16"
    assert float(meta["max_grad_norm"]) == record["max_grad_norm"]
    with safe_open(str(path), "pt") as f:
        assert f.get_tensor("claimed.norms").tolist() == record["claimed_norms"]
        assert f.get_tensor("claimed.coefficients").tolist() == record["clip_factors"]  # Opacus's, as rounded
    torch.testing.assert_close(factor_norms(path).tolist(), record["factor_norms"], rtol=1e-12, atol=0)
    report = ghost_oracle.check(path)
    assert report.precision == "bf16"
    assert report.passed, describe(report)
    assert math.isclose(report.max_sensitivity_ratio, record["max_clipped_contribution"], rel_tol=1e-9)


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_opacus_traces_at_0_9_times_fail(name, tmp_path):
    path = PRECISION / name
    with safe_open(str(path), "pt") as f:
        claimed = f.get_tensor("claimed.norms")
    report = ghost_oracle.check(with_claims(path, tmp_path / name, 0.9 * claimed))
    assert not report.passed, describe(report)
