"""assert_norms on exact and on dropped-cross-term norms, for a tied GPT-2 and a tied Llama."""
import json

import pytest
import torch
from conftest import REPO, causal_lm_loss, func_norms, positions
from safetensors import safe_open

import ghost_oracle
from ghost_oracle.torch import assert_norms, export_trace

MODELS = ["tied_gpt2", "tied_llama"]


@pytest.mark.parametrize("name", MODELS)
def test_exact_torch_func_norms_pass(request, name):
    m = request.getfixturevalue(name)
    report = assert_norms(m.model, m.loss, m.ids, claimed_norms=m.exact, max_grad_norm=m.c,
                          clipper="torch.func-exact")
    assert report.passed and report.verdict == "pass"
    # Llama's RMSNorms and eager softmax compute in float32 inside the float64 model
    assert report.precision == {"tied_gpt2": "f32", "tied_llama": "f32"}[name]
    assert m.tied in report.tied_parameters
    assert report.claimed_norms.tolist() == m.exact.double().tolist()
    assert report.max_sensitivity_ratio == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("name", MODELS)
def test_dropped_cross_term_norms_raise_a_readable_assertion(request, name):
    m = request.getfixturevalue(name)
    dropped = func_norms(m.model, m.loss, m.ids, untie=m.untie)
    assert not torch.allclose(dropped.double(), m.exact, rtol=1e-4)
    with pytest.raises(AssertionError) as e:
        assert_norms(m.model, m.loss, m.ids, claimed_norms=dropped, max_grad_norm=m.c, clipper="dropped-cross")
    msg = str(e.value)
    print(msg)
    assert msg.startswith("ghost-oracle: clipper `dropped-cross`: ")
    verdict = msg.split(": ")[2].split(" ")[0]
    assert verdict in ("privacy-violation", "utility-distortion")
    assert "worst example " in msg and "claimed norm " in msg and "true norm " in msg
    assert "sensitivity: its clipped contribution is " in msg
    assert "σ_eff = " in msg
    assert "ε: stated " in msg and ", actual " in msg
    assert f"tied parameter: `{m.tied}`" in msg
    assert "the claim is the truth without the cross term" in msg
    assert "per example:" in msg and "<- worst" in msg


def test_the_message_matches_the_report(tied_gpt2, tmp_path):
    m = tied_gpt2
    dropped = func_norms(m.model, m.loss, m.ids, untie=m.untie)
    path = tmp_path / "kept.safetensors"
    with pytest.raises(AssertionError) as e:
        assert_norms(m.model, m.loss, m.ids, claimed_norms=dropped, max_grad_norm=m.c, trace_path=path,
                     sampling_rate=0.005, steps=2000, delta=1e-6)
    report = ghost_oracle.check(path, sampling_rate=0.005, steps=2000, delta=1e-6)
    assert report.explain() == str(e.value)
    k = report.worst
    i = k.worst_example
    msg = str(e.value)
    assert f"worst example {i} of 4: claimed norm {k.claimed_norms[i]:.6g}, true norm {k.true_norms[i]:.6g}" in msg
    assert f"σ_eff = {k.effective_noise_multiplier:.4f}" in msg
    p = report.privacy
    assert f"ε: stated {p.stated_epsilon:.2f}, actual {p.actual_epsilon:.2f} (δ = 1e-06, q = 0.005, 2000 steps)" in msg


def test_dict_inputs_and_callable_claims(tied_gpt2, tmp_path):
    m = tied_gpt2
    batch = {"input_ids": m.ids, "position_ids": positions(m.ids)}

    def loss(model, inputs):
        logits = model(**inputs).logits
        return causal_lm_loss(logits, inputs["input_ids"])

    seen = []

    def claims(model, inputs):
        seen.append(inputs)
        return m.exact.numpy()

    report = assert_norms(m.model, loss, batch, claimed_norms=claims, max_grad_norm=m.c)
    assert report.passed and seen == [batch]


def test_export_trace_writes_a_complete_trace(tied_gpt2, tmp_path):
    m = tied_gpt2
    path = tmp_path / "t.safetensors"
    specs = export_trace(m.model, m.loss, m.ids, path, claimed_norms=m.exact.tolist(), max_grad_norm=m.c,
                         clipper="exact", noise_multiplier=1.5)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    # /3: each Conv1D's and LayerNorm's bias reads its layer's backprops
    assert meta["format"] == "ghost-oracle-trace/3" and meta["compute_dtype"] == "f32"
    listed = json.loads(meta["parameters"])
    assert listed == {n: p.numel() for n, p in m.model.named_parameters()}  # the tied head once
    assert {s["param"] for s in specs} == set(listed)
    heads = [s for s in specs if s["name"] == "lm_head.weight"]
    assert heads == [{"name": "lm_head.weight", "param": "transformer.wte.weight", "kind": "linear"}]
    report = ghost_oracle.check(path)
    assert report.passed and report.worst.noise_multiplier == 1.5


def test_no_script_loads_the_package_by_file_path():
    """The scripts import the installed package; none loads its files by path."""
    scripts = sorted((REPO / "python" / "scripts").glob("*.py"))
    assert len(scripts) >= 5
    for path in scripts:
        text = path.read_text()
        assert "spec_from_file_location" not in text and "ghost_oracle\", \"" not in text, path.name
    assert not (REPO / "oracles" / "python").exists()
