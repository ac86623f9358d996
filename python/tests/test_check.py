"""`check` on the committed golden traces, and what a Report holds."""
import json
import math

import numpy as np
import pytest
from conftest import REPO, TRACES

import ghost_oracle

GOLDEN = sorted(TRACES.glob("*.safetensors")) + sorted((TRACES / "families").glob("*.safetensors"))
# Wrong on purpose (oracles/python/audit_opacus_example.py): Opacus ghost clipping of an untied
# copy drops the tied cross term; the last-writer and batch-mean-loss claims are seeded bugs.
FLAGGED = {"opacus_ghost_untied", "embedding_only", "batch_mean_loss"}


def test_the_golden_traces_are_all_there():
    names = {p.stem for p in GOLDEN}
    assert FLAGGED | {"opacus_per_sample", "gpt2", "llama", "qwen2", "gemma"} <= names
    assert len(GOLDEN) >= 12


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_golden_trace_verdicts(path):
    report = ghost_oracle.check(path)
    if path.stem in FLAGGED:
        assert not report.passed
        assert report.verdict == "privacy-violation"
        assert report.max_sensitivity > 1
        assert report.privacy.actual_epsilon > report.privacy.stated_epsilon
    else:
        assert report.passed, report.explain()
        assert report.verdict == "pass"
        assert report.max_sensitivity <= 1 + 1e-6
        assert report.privacy.actual_epsilon == pytest.approx(report.privacy.stated_epsilon)


def test_the_untied_workaround_is_flagged_with_its_tied_parameter():
    report = ghost_oracle.check(TRACES / "opacus_ghost_untied.safetensors")
    assert report.kind == "check" and report.dtype == "f32" and report.device == "trace file"
    assert report.tied_parameters == {
        "transformer.wte.weight": (("transformer.wte.weight", "embedding"), ("lm_head.weight", "linear"))}
    (clipper,) = report.clippers
    assert clipper.name == "opacus-ghost-untied" and clipper.verdict == "privacy-violation"
    (case,) = clipper.cases
    assert case.name == "opacus_ghost_untied.safetensors"
    i = case.worst_example
    # The claimed squared norm is the true one less the cross term.
    short = 1 - (case.claimed_norms[i] / case.true_norms[i]) ** 2
    assert short == pytest.approx(case.cross_share[i], rel=1e-3)
    assert case.sensitivity[i] == pytest.approx(case.max_sensitivity)
    assert case.effective_noise_multiplier == pytest.approx(1 / case.max_sensitivity)


def test_report_arrays_are_numpy_per_example():
    report = ghost_oracle.check(TRACES / "opacus_per_sample.safetensors")
    for name in ("true_norms", "claimed_norms", "coefficients", "true_coefficients", "sensitivity", "cross_share"):
        a = getattr(report, name)
        assert isinstance(a, np.ndarray) and a.dtype == np.float64 and a.shape == (4,), name
        assert not a.flags.writeable
    c = report.worst.max_grad_norm
    np.testing.assert_allclose(report.claimed_norms, report.true_norms, rtol=1e-6)
    np.testing.assert_allclose(report.true_coefficients, np.minimum(1, c / report.true_norms))
    np.testing.assert_allclose(report.sensitivity, report.coefficients * report.true_norms / c)


def test_to_json_is_the_cli_document():
    report = ghost_oracle.check(TRACES / "opacus_ghost_untied.safetensors")
    doc = json.loads(report.to_json())
    assert doc["passed"] is False
    assert doc["verdicts"] == {"opacus-ghost-untied": "privacy-violation"}
    assert doc["dtype"] == "f32" and doc["device"] == "trace file"
    (clipper,) = doc["clippers"]
    assert clipper["privacy"]["stated_epsilon"] == pytest.approx(report.privacy.stated_epsilon)
    examples = clipper["cases"][0]["examples"]
    np.testing.assert_allclose([e["true_norm"] for e in examples], report.true_norms)
    np.testing.assert_allclose([e["norm"] for e in examples], report.claimed_norms)


def test_repr_is_the_cli_table():
    text = repr(ghost_oracle.check(TRACES / "opacus_per_sample.safetensors"))
    assert text.startswith("clipper opacus-grad-sample (f32, trace file): PASS")
    assert "opacus_per_sample.safetensors  pass" in text
    assert "privacy: stated ε = " in text
    assert "all 1 audited clipper(s) pass" in text
    assert str(ghost_oracle.check(TRACES / "opacus_per_sample.safetensors")) == text


def test_accounting_arguments_reach_the_privacy_report():
    path = TRACES / "opacus_ghost_untied.safetensors"
    typical = ghost_oracle.check(path).privacy
    assert typical.default_setting and (typical.sampling_rate, typical.steps, typical.delta) == (0.01, 1000, 1e-5)
    mine = ghost_oracle.check(path, noise_multiplier=2.0, sampling_rate=0.02, steps=500, delta=1e-6).privacy
    assert not mine.default_setting
    assert (mine.sampling_rate, mine.steps, mine.delta, mine.noise_multiplier) == (0.02, 500, 1e-6, 2.0)
    assert mine.effective_noise_multiplier == pytest.approx(2.0 / mine.worst_contribution)
    assert mine.actual_epsilon > mine.stated_epsilon
    assert mine.sigma_needed == pytest.approx(2.0 * mine.worst_contribution, rel=1e-3)
    assert "ε" in mine.sentence


def test_precision_override():
    path = TRACES / "families" / "gpt2.safetensors"
    assert ghost_oracle.check(path).dtype == "f64"
    coarse = ghost_oracle.check(path, precision="bf16")
    assert coarse.dtype == "bf16" and coarse.passed
    assert coarse.worst.bound.max() > ghost_oracle.check(path).worst.bound.max()


def test_noise_multiplier_zero_warns_and_reports_infinite_epsilon():
    with pytest.warns(UserWarning, match="no privacy"):
        report = ghost_oracle.check(TRACES / "opacus_per_sample.safetensors", noise_multiplier=0)
    assert math.isinf(report.privacy.stated_epsilon)


def test_audit_builtin_suite_flags_standard_ghost_clipping():
    report = ghost_oracle.audit(clippers=["ghost", "ghost-tied"], max_grad_norm=None)
    assert report.kind == "audit"
    verdicts = {c.name: c.verdict for c in report.clippers}
    assert verdicts == {"ghost": "privacy-violation", "ghost-tied": "pass"}
    assert report.verdict == "privacy-violation" and not report.passed
    assert report.deciding.name == "ghost"
    assert any("transformer.wte.weight" in w for w in report.deciding.warnings)
    cases = report.clippers[0].cases
    assert len(cases) >= 24 and len(cases) == 3 * len({c.name.split("@")[0] for c in cases})  # C = ½, 1, 2 × median
    assert "clipper ghost (f32, cpu): PRIVACY-VIOLATION" in repr(report)
    assert json.loads(report.to_json())["verdicts"] == verdicts


def test_audit_on_a_checkpoint():
    case = REPO / "oracles" / "golden" / "cases" / "tied_l1_h2_t2"
    report = ghost_oracle.audit(case, case / "batch.safetensors", clippers="ghost-tied", max_grad_norm=1.0,
                                dtype="f64", reduction="sum")
    assert report.passed and report.dtype == "f64"
    (clipper,) = report.clippers
    assert [c.name for c in clipper.cases] == ["tied_l1_h2_t2"]
    assert clipper.worst.max_grad_norm == 1.0


def test_audit_on_a_llama_checkpoint():
    case = REPO / "oracles" / "golden" / "cases" / "llama_tied_gqa_t2"
    report = ghost_oracle.audit(case, case / "batch.safetensors", clippers=["ghost", "ghost-tied"])
    verdicts = {c.name: c.verdict for c in report.clippers}
    assert verdicts["ghost-tied"] == "pass" and verdicts["ghost"] != "pass"
    assert any("model.embed_tokens.weight" in w for w in report.clippers[0].warnings)


def test_mutants_kill_matrix():
    report = ghost_oracle.mutants()
    assert report.kind == "mutants" and report.passed and report.verdict == "pass"
    names = [c.name for c in report.clippers]
    assert names[:len(ghost_oracle.MUTANTS)] == list(ghost_oracle.MUTANTS)
    assert names[-2:] == ["ghost-tied", "materialize"]
    for c in report.clippers:
        assert c.problems == ()
        assert set(c.cells) == set(report.cases)
        if c.mutant:
            assert c.reproduces and c.verdict != "pass"
        else:
            assert c.verdict == "pass" and set(c.cells.values()) == {"pass"}
    assert "every mutant caught with the right verdict; no false alarm" in repr(report)
    assert json.loads(report.to_json())["ok"] is True
