"""`check` on the committed golden traces, and what a Report holds."""
import json
import math

import numpy as np
import pytest
from conftest import REPO, TRACES
from safetensors.numpy import load_file, save_file

import ghost_oracle

GOLDEN = sorted(TRACES.glob("*.safetensors")) + sorted((TRACES / "families").glob("*.safetensors"))
# Wrong on purpose (python/scripts/audit_opacus_example.py): Opacus ghost clipping of an untied
# copy drops the tied cross term; the last-writer and batch-mean-loss claims are seeded bugs.
FLAGGED = {"opacus_ghost_untied", "embedding_only", "batch_mean_loss"}


def test_the_golden_traces_are_all_there():
    names = {p.stem for p in GOLDEN}
    families = {"gpt2", "gpt_neo", "gpt_neox", "phi", "opt", "llama", "qwen2", "gemma", "qwen3", "gemma2",
                "gemma3_text", "vaultgemma", "qwen3_moe"}
    assert {p.stem for p in (TRACES / "families").glob("*.safetensors")} == families
    assert FLAGGED | {"opacus_per_sample"} | families <= names
    assert len(GOLDEN) >= 17


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_golden_trace_verdicts(path):
    report = ghost_oracle.check(path)
    if path.stem in FLAGGED:
        assert not report.passed
        assert report.verdict == "privacy-violation"
        assert report.max_sensitivity_ratio > 1
        assert report.privacy.actual_epsilon > report.privacy.stated_epsilon
        assert report.privacy.rounding_at is None
    else:
        assert report.passed, report.explain()
        assert report.verdict == "pass"
        assert report.max_sensitivity_ratio <= 1 + 1e-6
        assert report.privacy.actual_epsilon == pytest.approx(report.privacy.stated_epsilon)
        assert report.privacy.rounding_at == report.precision


def test_the_untied_workaround_is_flagged_with_its_tied_parameter():
    report = ghost_oracle.check(TRACES / "opacus_ghost_untied.safetensors")
    assert report.kind == "check" and report.precision == "f32" and report.device == "trace file"
    assert report.tied_parameters == {
        "transformer.wte.weight": (("transformer.wte.weight", "embedding"), ("lm_head.weight", "linear"))}
    (clipper,) = report.clippers
    assert clipper.name == "opacus-ghost-untied" and clipper.verdict == "privacy-violation"
    (case,) = clipper.cases
    assert case.case == "opacus_ghost_untied.safetensors"
    i = case.worst_example
    # The claimed squared norm is the true one less the cross term.
    short = 1 - (case.claimed_norms[i] / case.true_norms[i]) ** 2
    assert short == pytest.approx(case.cross_share[i], rel=1e-3)
    assert case.sensitivity[i] == pytest.approx(case.max_sensitivity_ratio)
    assert case.effective_noise_multiplier == pytest.approx(1 / case.max_sensitivity_ratio)


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


def cli_steps(epochs, dataset_size, sampling_rate):
    """The steps `ghost-oracle --epochs E --dataset-size N --sampling-rate q` accounts for:
    ⌈E × ⌈N / round(q·N)⌉⌉."""
    return math.ceil(epochs * math.ceil(dataset_size / max(1, round(sampling_rate * dataset_size))))


def test_epochs_over_a_dataset_size_give_the_clis_steps():
    path = TRACES / "opacus_ghost_untied.safetensors"
    # q·N = 37.035: a batch of 37, ⌈12345 / 37⌉ = 334 steps an epoch, 2.5 epochs ⌈835⌉
    assert cli_steps(2.5, 12345, 0.003) == 835
    p = ghost_oracle.check(path, sampling_rate=0.003, epochs=2.5, dataset_size=12345, delta=1e-6).privacy
    assert (p.sampling_rate, p.steps, p.delta) == (0.003, 835, 1e-6) and not p.default_setting
    assert p == ghost_oracle.check(path, sampling_rate=0.003, steps=835, delta=1e-6).privacy
    # epochs and dataset_size alone: the typical q = 0.01, a batch of 10 out of 1000
    p = ghost_oracle.check(path, epochs=3, dataset_size=1000).privacy
    assert p.steps == cli_steps(3, 1000, 0.01) == 300 and not p.default_setting


def test_audit_and_mutants_take_epochs():
    case = REPO / "oracles" / "golden" / "cases" / "tied_l1_h2_t2"
    report = ghost_oracle.audit(case, case / "batch.safetensors", clippers=["ghost-tied", "ghost"],
                                sampling_rate=0.02, epochs=3, dataset_size=777)
    assert {c.privacy.steps for c in report.clippers} == {cli_steps(3, 777, 0.02)} == {147}
    matrix = ghost_oracle.mutants(sampling_rate=0.01, epochs=2, dataset_size=1000)
    assert matrix.passed
    assert {(c.privacy.sampling_rate, c.privacy.steps) for c in matrix.clippers} == {(0.01, cli_steps(2, 1000, 0.01))}


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_audit_in_half_precision(dtype):
    case = REPO / "oracles" / "golden" / "cases" / "tied_l1_h2_t2"
    report = ghost_oracle.audit(case, case / "batch.safetensors", clippers=["ghost-tied", "materialize"],
                                precision=dtype)
    assert report.precision == dtype and report.passed, report.explain()
    f32 = ghost_oracle.audit(case, case / "batch.safetensors", clippers=["ghost-tied"])
    assert report.max_bound > 10 * f32.max_bound  # the bound of a coarser arithmetic
    assert report.judgeable.all() and report.unjudgeable_examples == ()


def with_tiny_example(dst, scale, example=0):
    """opacus_per_sample.safetensors with one example's backprops (so its gradient) and its
    claimed norm scaled by `scale`: the claim stays exact."""
    tensors = load_file(str(TRACES / "opacus_per_sample.safetensors"))
    with open(TRACES / "opacus_per_sample.safetensors", "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(n))["__metadata__"]
    for k, v in tensors.items():
        if k.endswith(".backprops"):
            v[example] *= v.dtype.type(scale)
    tensors["claimed.norms"] = tensors["claimed.norms"].astype(np.float64)
    tensors["claimed.norms"][example] *= scale
    tensors.pop("claimed.coefficients", None)
    save_file(tensors, str(dst), metadata=meta)
    return dst


def test_a_bound_too_loose_to_judge_is_cannot_judge(tmp_path):
    # An example whose gradient entries lie near f16's subnormals: at f16 its rounding bound is
    # over a tenth of its norm, and an exact claim cannot be told from a wrong one.
    path = with_tiny_example(tmp_path / "tiny.safetensors", 2.0 ** -8)
    assert ghost_oracle.check(path).passed  # at the trace's f32: every example judged
    report = ghost_oracle.check(path, precision="f16")
    assert report.verdict == "cannot-judge" and not report.passed
    k = report.worst
    assert k.verdict == "cannot-judge" and k.worst_example == 0
    assert k.unjudgeable_examples == report.unjudgeable_examples == (0,)
    assert isinstance(k.judgeable, np.ndarray) and k.judgeable.dtype == bool and not k.judgeable.flags.writeable
    assert k.judgeable.tolist() == [False, True, True, True]
    assert k.max_bound == report.max_bound == k.bound.max() == k.bound[0] > 0.1
    # The reason names the example, the precision and the rule that fired (the tenth).
    assert k.cannot_judge_reason == report.cannot_judge_reason
    assert k.cannot_judge_reason.startswith("example 0: the rounding bound at f16 is ")
    assert "over the 10.000 % past which a claim that far off would pass too" in k.cannot_judge_reason
    assert k.contribution_slack == 1e-2 and (k.model_rounding == 0).all()
    assert (k.bound[1:] <= 0.1).all()
    np.testing.assert_allclose(k.claimed_norms, k.true_norms, rtol=1e-6)  # the claim is right, yet not a pass
    assert (k.seq_len, k.widest_factor) == (12, 48)
    text = report.explain()
    assert text.startswith("ghost-oracle: clipper `opacus-grad-sample`: cannot-judge (")
    assert "cannot judge 1 of 4 example(s) (0) at f16" in text
    assert "CANNOT-JUDGE" in repr(report)
    doc = json.loads(report.to_json())
    assert doc["verdicts"] == {"opacus-grad-sample": "cannot-judge"}
    assert [e["judgeable"] for e in doc["clippers"][0]["cases"][0]["examples"]] == k.judgeable.tolist()


def test_verdicts_are_ordered_by_severity():
    assert ghost_oracle.VERDICTS == ("pass", "utility-distortion", "cannot-judge", "privacy-violation",
                                     "invalid-norm")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_an_invalid_claimed_norm_is_invalid_norm(tmp_path, bad):
    tensors = load_file(str(TRACES / "opacus_per_sample.safetensors"))
    with open(TRACES / "opacus_per_sample.safetensors", "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(n))["__metadata__"]
    tensors["claimed.norms"] = tensors["claimed.norms"].astype(np.float64)
    tensors["claimed.norms"][1] = bad
    tensors.pop("claimed.coefficients", None)
    save_file(tensors, str(tmp_path / "bad.safetensors"), metadata=meta)
    report = ghost_oracle.check(tmp_path / "bad.safetensors")
    assert report.verdict == "invalid-norm" and not report.passed
    k = report.worst
    assert k.invalid_examples == (1,) and k.worst_example == 1 and k.invalid.tolist() == [False, True, False, False]
    assert math.isinf(report.privacy.actual_epsilon) and math.isfinite(report.privacy.stated_epsilon)
    assert math.isnan(report.privacy.worst_contribution)
    if bad == -1.0:
        assert k.claimed_norms[1] == -1.0
    else:  # a NaN or infinite norm: its error is undefined
        assert not math.isfinite(k.claimed_norms[1]) and math.isnan(k.max_norm_rel_err)
    assert "invalid-norm (a NaN, infinite or negative norm" in report.explain()


def test_precision_override():
    path = TRACES / "families" / "gpt2.safetensors"
    assert ghost_oracle.check(path).precision == "f64"
    coarse = ghost_oracle.check(path, precision="bf16")
    assert coarse.precision == "bf16" and coarse.passed
    assert coarse.worst.bound.max() > ghost_oracle.check(path).worst.bound.max()


def test_noise_multiplier_zero_warns_and_reports_infinite_epsilon():
    with pytest.warns(UserWarning, match="no privacy"):
        report = ghost_oracle.check(TRACES / "opacus_per_sample.safetensors", noise_multiplier=0)
    assert math.isinf(report.privacy.stated_epsilon) and math.isinf(report.privacy.actual_epsilon)
    assert report.passed


def test_audit_builtin_suite_flags_standard_ghost_clipping():
    report = ghost_oracle.audit(clippers=["ghost", "ghost-tied"], max_grad_norm=None)
    assert report.kind == "audit"
    verdicts = {c.name: c.verdict for c in report.clippers}
    assert verdicts == {"ghost": "privacy-violation", "ghost-tied": "pass"}
    assert report.verdict == "privacy-violation" and not report.passed
    assert report.deciding.name == "ghost"
    assert any("transformer.wte.weight" in w for w in report.deciding.warnings)
    cases = report.clippers[0].cases
    assert len(cases) >= 24 and len(cases) == 3 * len({c.case.split("@")[0] for c in cases})  # C = ½, 1, 2 × median
    assert "clipper ghost (f32, cpu): PRIVACY-VIOLATION" in repr(report)
    assert json.loads(report.to_json())["verdicts"] == verdicts


def test_audit_on_a_checkpoint():
    case = REPO / "oracles" / "golden" / "cases" / "tied_l1_h2_t2"
    report = ghost_oracle.audit(case, case / "batch.safetensors", clippers="ghost-tied", max_grad_norm=1.0,
                                precision="f64", reduction="sum")
    assert report.passed and report.precision == "f64"
    (clipper,) = report.clippers
    assert [c.case for c in clipper.cases] == ["tied_l1_h2_t2"]
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


def test_max_memory_bounds_what_reading_a_trace_may_take():
    path = TRACES / "opacus_per_sample.safetensors"
    size = path.stat().st_size
    assert ghost_oracle.check(path, max_memory="1G").passed == ghost_oracle.check(path).passed
    assert ghost_oracle.check(path, max_memory=1 << 30).passed == ghost_oracle.check(path).passed
    with pytest.raises(ValueError, match=r"opacus_per_sample\.safetensors.*the file.*max_memory"):
        ghost_oracle.check(path, max_memory=size // 2)
    for bad in ("8X", "0", "lots"):
        with pytest.raises(ValueError, match=rf"max_memory.*{bad}"):
            ghost_oracle.check(path, max_memory=bad)
    with pytest.raises(ValueError, match="max_memory"):
        ghost_oracle.check(path, max_memory=0)
    with pytest.raises(TypeError, match="max_memory"):
        ghost_oracle.check(path, max_memory=1.5)
