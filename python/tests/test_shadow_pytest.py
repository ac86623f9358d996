"""`pytest --ghost-oracle` on a small Opacus-style test file, run unedited by pytest's pytester:
the JSONL report's lines and the terminal summary; a mutated Opacus fails the test that used the
mutated layer (and only it), `--ghost-oracle=report` records it without failing."""
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("opacus")

pytest_plugins = ["pytester"]

# Each run in a process of its own, as `pytest --ghost-oracle` runs: an in-process run restores
# sys.modules afterwards, and torch does not survive being imported twice in one process.

# What a library's own test looks like: Opacus's per-sample gradients against its own
# micro-batch loop, with no oracle in sight.
SUITE = '''
import copy

import torch
from torch import nn
from opacus.grad_sample import wrap_model


def micro_batch(model, x):
    out = []
    for i in range(len(x)):
        model.zero_grad()
        model(x[i:i + 1]).pow(2).sum().backward()
        out.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    return torch.stack(out)


def opacus_grad_samples(model, x, mode):
    model = copy.deepcopy(model)
    gsm = wrap_model(model, grad_sample_mode=mode, loss_reduction="sum")
    gsm(x).pow(2).sum().backward()
    return torch.cat([p.grad_sample.flatten(1) for p in model.parameters()], 1)


def test_linear():
    torch.manual_seed(0)
    model, x = nn.Linear(4, 3), torch.randn(3, 4)
    expected = micro_batch(model, x)
    for mode in ("hooks", "functorch"):
        assert opacus_grad_samples(model, x, mode).shape == expected.shape  # a check that sees no value


def test_embedding():
    torch.manual_seed(0)
    model, x = nn.Embedding(7, 3), torch.randint(0, 7, (3, 2))
    expected = micro_batch(model, x)
    torch.testing.assert_close(opacus_grad_samples(model, x, "hooks").norm(dim=1), expected.norm(dim=1),
                               rtol=1e-3, atol=1e-3)


def test_empty_batch():
    gsm = wrap_model(nn.Linear(4, 3), grad_sample_mode="hooks", loss_reduction="sum")
    gsm(torch.randn(0, 4)).pow(2).sum().backward()
'''

# The mutant: Opacus's linear grad sampler drops example 0's bias term (a conftest the suite does
# not have; the test file stays as it is).
MUTANT = '''
import pytest
from torch import nn
from opacus.grad_sample.grad_sample_module import GradSampleHooks


@pytest.fixture(autouse=True)
def mutated_linear_sampler(monkeypatch):
    original = GradSampleHooks.GRAD_SAMPLERS[nn.Linear]

    def dropped(layer, activations, backprops):
        out = original(layer, activations, backprops)
        if len(out[layer.bias]):
            out[layer.bias] = out[layer.bias].clone()
            out[layer.bias][0] = 0
        return out

    monkeypatch.setitem(GradSampleHooks.GRAD_SAMPLERS, nn.Linear, dropped)
'''

KEYS = {"test", "call", "library", "mode", "module", "outcome", "verdict", "max_rel_err", "message"}


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_suite_is_judged_unedited(pytester):
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_subprocess("--ghost-oracle", "--ghost-oracle-report", "r.jsonl",
                                           "-p", "no:cacheprovider", "-W", "ignore")
    result.assert_outcomes(passed=3)
    records = lines(pytester.path / "r.jsonl")
    assert all(KEYS <= set(r) for r in records)
    got = [(r["test"].split("::")[-1], r["call"], r["mode"], r["module"], r["outcome"], r["verdict"])
           for r in records]
    assert got == [("test_linear", 0, "hooks", "Linear", "judged", "pass"),
                   ("test_linear", 1, "functorch", "Linear", "judged", "pass"),
                   ("test_embedding", 0, "hooks", "Embedding", "judged", "pass"),
                   ("test_empty_batch", 0, "hooks", "Linear", "skipped", None)]
    assert records[-1]["message"].startswith("empty batch")
    assert all(r["library"] == "opacus" for r in records)
    assert all(r["max_rel_err"] < 1e-5 for r in records if r["outcome"] == "judged")
    result.stdout.fnmatch_lines(["*ghost-oracle shadow mode*",
                                 "computations seen: 4; judged: 3 (75.0 %) [functorch 1, hooks 2]",
                                 "passed: 3; failed: 0; cannot-judge: 0",
                                 "refused: 0", "skipped: 1", "*1  empty batch*",
                                 "time shadow mode added: * s"])


def test_a_mutated_opacus_fails_the_tests_using_the_layer(pytester):
    pytester.makepyfile(test_suite=SUITE)
    pytester.makeconftest(MUTANT)
    result = pytester.runpytest_subprocess("--ghost-oracle", "--ghost-oracle-report", "r.jsonl",
                                           "-p", "no:cacheprovider", "-W", "ignore")
    # the suite's own check of test_linear (shapes) passes; the oracle fails test_linear, and
    # only it: the embedding has no linear layer, the empty batch nothing to judge
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["E   AssertionError: ghost-oracle: 1 per-example gradient computation(s) of this test "
                                 "judged wrong",
                                 "*opacus hooks on Linear (B=3), computation 0 in test_suite.py::test_linear: judged, "
                                 "verdict privacy-violation*",
                                 "*worst example 0 of 3: claimed norm*true norm*",
                                 "passed: 2; failed: 1; cannot-judge: 0",
                                 "FAILED test_suite.py::test_linear - AssertionError: ghost-oracle: 1 per-examp*"])
    records = lines(pytester.path / "r.jsonl")
    # hooks mode calls the mutated sampler; functorch mode computes Linear's grad samples itself
    assert [(r["mode"], r["verdict"]) for r in records if r["test"].endswith("test_linear")] == [
        ("hooks", "privacy-violation"), ("functorch", "pass")]
    assert all(r["verdict"] == "pass" for r in records if r["test"].endswith("test_embedding"))

    recorded = pytester.runpytest_subprocess("--ghost-oracle=report", "-p", "no:cacheprovider", "-W", "ignore")
    recorded.assert_outcomes(passed=3)
    recorded.stdout.fnmatch_lines(["passed: 2; failed: 1; cannot-judge: 0"])


def test_the_fixture_raises_at_the_backward(pytester):
    pytester.makeconftest(MUTANT)
    pytester.makepyfile(test_one='''
import torch
from torch import nn
from opacus import GradSampleModule


def test_one(ghost_oracle_shadow):
    gsm = GradSampleModule(nn.Linear(4, 3), loss_reduction="sum")
    gsm(torch.randn(3, 4)).pow(2).sum().backward()
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "ignore")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*ShadowCheckFailed*"])


def test_report_without_shadow_mode_is_a_usage_error(pytester):
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("--ghost-oracle-report", "r.jsonl", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--ghost-oracle-report needs --ghost-oracle*"])
