"""Bad input is an exception with the CLI's message; nothing aborts the interpreter."""
import math
import os
import shutil
import subprocess

import pytest
import torch
from conftest import REPO, TRACES, gpt2_loss

import ghost_oracle
from ghost_oracle import _native
from ghost_oracle.torch import TraceExportError, assert_norms, export_trace

GOOD = TRACES / "opacus_per_sample.safetensors"
CASE = REPO / "oracles" / "golden" / "cases" / "tied_l1_h2_t2"


def _cli():
    """The ghost-oracle binary, when one was built (cargo build / cargo test), to compare
    messages with."""
    for profile in ("release", "debug"):
        path = REPO / "target" / profile / "ghost-oracle"
        if path.exists():
            return path
    return shutil.which("ghost-oracle")


def _cli_error(*args):
    cli = _cli()
    if cli is None:
        pytest.skip("no ghost-oracle binary built to compare messages with")
    out = subprocess.run([str(cli), *map(str, args)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    line = next(x for x in out.stderr.splitlines() if x.startswith("error: "))
    return line[len("error: "):]


@pytest.fixture
def garbage(tmp_path):
    path = tmp_path / "garbage.safetensors"
    path.write_bytes(b"not a safetensors file at all")
    return path


@pytest.fixture
def truncated(tmp_path):
    path = tmp_path / "truncated.safetensors"
    data = GOOD.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def test_a_missing_trace_is_file_not_found(tmp_path):
    path = tmp_path / "missing.safetensors"
    with pytest.raises(FileNotFoundError) as e:
        ghost_oracle.check(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("make", ["garbage", "truncated", "directory"])
def test_a_malformed_trace_is_a_value_error(request, tmp_path, make):
    path = tmp_path if make == "directory" else request.getfixturevalue(make)
    with pytest.raises(ValueError) as e:
        ghost_oracle.check(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("make", ["missing", "garbage", "truncated"])
def test_messages_are_the_clis(request, tmp_path, make):
    path = tmp_path / "missing.safetensors" if make == "missing" else request.getfixturevalue(make)
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        ghost_oracle.check(path)
    assert str(e.value) == _cli_error("check", path)


def test_a_trace_whose_header_lies_is_refused(tmp_path):
    data = bytearray(GOOD.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = data[8:8 + n].decode()
    lying = header.replace('\\"vocab\\": 19', '\\"vocab\\": 18')  # the embedding's table, one row short
    assert lying != header and len(lying) == len(header)
    path = tmp_path / "lying.safetensors"
    path.write_bytes(bytes(data[:8]) + lying.encode() + bytes(data[8 + n:]))
    with pytest.raises(ValueError, match="vocab|ids"):
        ghost_oracle.check(path)


@pytest.mark.parametrize("kw, exc, text", [
    (dict(noise_multiplier=-1), ValueError, "noise_multiplier must be a non-negative number, got -1"),
    (dict(noise_multiplier=math.nan), ValueError, "noise_multiplier must be a non-negative number, got NaN"),
    (dict(noise_multiplier=math.inf), ValueError, "noise_multiplier must be a non-negative number, got inf"),
    (dict(noise_multiplier="1"), TypeError, "noise_multiplier must be a number"),
    (dict(precision="f8"), ValueError, 'precision must be one of f64, f32, f16, bf16, got "f8"'),
    (dict(precision=32), TypeError, "precision must be one of"),
    (dict(sampling_rate=1.5), ValueError, "sampling_rate: sampling rate q = 1.5 is outside [0, 1]"),
    (dict(sampling_rate=-0.1), ValueError, "sampling_rate: sampling rate q = -0.1 is outside [0, 1]"),
    (dict(steps=0), ValueError, "steps must be a positive number of DP-SGD steps, got 0"),
    (dict(steps=-5), ValueError, "steps must be a positive number of DP-SGD steps, got -5"),
    (dict(steps=2.5), TypeError, "steps must be an integer"),
    (dict(delta=0), ValueError, "delta: δ = 0 is outside (0, 1)"),
    (dict(delta=1.5), ValueError, "delta: δ = 1.5 is outside (0, 1)"),
    (dict(epochs=-1, dataset_size=1000), ValueError, "epochs must be a positive number, got -1"),
    (dict(epochs=math.nan, dataset_size=1000), ValueError, "epochs must be a positive number, got NaN"),
    (dict(epochs="2", dataset_size=1000), TypeError, "epochs must be a number"),
    (dict(epochs=2, dataset_size=0), ValueError, "dataset_size must be at least 1, got 0"),
    (dict(epochs=2, dataset_size=1000.5), TypeError, "dataset_size must be an integer"),
    (dict(epochs=2), ValueError, "dataset_size must be given with the epochs, got none"),
    (dict(dataset_size=1000), ValueError, "epochs must be given with the dataset size, got none"),
    (dict(steps=10, epochs=2, dataset_size=1000), ValueError,
     "epochs must be left out when the steps are given, got both"),
])
def test_bad_check_arguments(kw, exc, text):
    with pytest.raises(exc) as e:
        ghost_oracle.check(GOOD, **kw)
    assert text in str(e.value)


@pytest.mark.parametrize("kw, exc, text", [
    (dict(clippers=["bogus"]), ValueError,
     "clippers: unknown clipper `bogus`; expected one of: materialize, ghost, ghost-tied"),
    (dict(clippers=["mutant:bogus"]), ValueError, "clippers: unknown clipper `mutant:bogus`"),
    (dict(max_grad_norm=0), ValueError, "max_grad_norm must be a positive number, got 0"),
    (dict(max_grad_norm=-1.5), ValueError, "max_grad_norm must be a positive number, got -1.5"),
    (dict(max_grad_norm=math.nan), ValueError, "max_grad_norm must be a positive number, got NaN"),
    (dict(noise_multiplier=-0.5), ValueError, "noise_multiplier must be a non-negative number, got -0.5"),
    (dict(precision="f8"), ValueError, 'precision must be one of f64, f32, f16, bf16, got "f8"'),
    (dict(reduction="max"), ValueError, 'reduction must be "mean" or "sum"'),
    (dict(model=CASE), ValueError, "model needs batch"),
    (dict(batch=CASE / "batch.safetensors"), ValueError, "batch needs model"),
    (dict(steps=0), ValueError, "steps must be a positive number"),
    (dict(epochs=0, dataset_size=1000), ValueError, "epochs must be a positive number, got 0"),
    (dict(epochs=1, dataset_size=-3), ValueError, "dataset_size must be at least 1, got -3"),
])
def test_bad_audit_arguments(kw, exc, text):
    with pytest.raises(exc) as e:
        ghost_oracle.audit(**kw)
    assert text in str(e.value)


def test_bad_mutants_arguments():
    with pytest.raises(ValueError, match='^precision must be one of f64, f32, f16, bf16, got "f8"$'):
        ghost_oracle.mutants(precision="f8")
    with pytest.raises(ValueError, match="delta"):
        ghost_oracle.mutants(delta=2)
    with pytest.raises(ValueError, match="^epochs must be a positive number, got -2$"):
        ghost_oracle.mutants(epochs=-2, dataset_size=1000)
    with pytest.raises(ValueError, match="^dataset_size must be given with the epochs, got none$"):
        ghost_oracle.mutants(epochs=2)


def test_audit_with_missing_or_bad_files(tmp_path, garbage):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ghost_oracle.audit(tmp_path / "nope", CASE / "batch.safetensors")
    with pytest.raises(FileNotFoundError):
        ghost_oracle.audit(CASE, tmp_path / "nope.safetensors")
    with pytest.raises(ValueError) as e:
        ghost_oracle.audit(CASE, garbage)
    assert str(garbage) in str(e.value)
    assert str(e.value) == _cli_error("audit", "--model", CASE, "--batch", garbage)


def test_a_panic_is_a_runtime_error_not_an_abort():
    with pytest.raises(RuntimeError, match="ghost-oracle panicked .*a deliberate panic"):
        _native._panic_for_tests()
    assert ghost_oracle.check(GOOD).passed  # the interpreter and the module carry on


# ---------------------------------------------------------------------------------------------
# The exporter and assert_norms.


def test_export_argument_errors(tied_gpt2, tmp_trace):
    m, ids, loss = tied_gpt2.model, tied_gpt2.ids, tied_gpt2.loss
    with pytest.raises(TypeError, match="micro-batch 0: inputs must be a tensor of token ids"):
        export_trace(m, loss, ids.tolist(), tmp_trace, claimed_norms=tied_gpt2.exact, max_grad_norm=1.0)
    with pytest.raises(ValueError, match=r"per_example_loss returned \(3,\); expected a tensor of shape \(4,\).*"
                                         r"pass batch_axis"):
        export_trace(m, lambda mm, x: loss(mm, x)[:3], ids, tmp_trace, claimed_norms=tied_gpt2.exact,
                     max_grad_norm=1.0)
    with pytest.raises(ValueError, match="claimed_norms has 3 values; the batch has 4 examples"):
        export_trace(m, loss, ids, tmp_trace, claimed_norms=tied_gpt2.exact[:3], max_grad_norm=1.0)
    with pytest.raises(TypeError, match="claimed_norms must be a tensor, array or list of 4 numbers"):
        export_trace(m, loss, ids, tmp_trace, claimed_norms="big", max_grad_norm=1.0)
    with pytest.raises(ValueError, match="max_grad_norm must be a positive number, got 0"):
        export_trace(m, loss, ids, tmp_trace, claimed_norms=tied_gpt2.exact, max_grad_norm=0)
    with pytest.raises(ValueError, match="noise_multiplier must be a non-negative number, got -1"):
        export_trace(m, loss, ids, tmp_trace, claimed_norms=tied_gpt2.exact, max_grad_norm=1.0, noise_multiplier=-1)
    with pytest.raises(ValueError, match=r"per_example_loss returned \(\); expected a tensor of shape \(4,\)"):
        export_trace(m, lambda mm, x: loss(mm, x).sum(), ids, tmp_trace, claimed_norms=tied_gpt2.exact,
                     max_grad_norm=1.0)
    assert not os.path.exists(tmp_trace)


def test_a_model_the_exporter_cannot_trace_is_refused(tied_gpt2):
    class Gain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = torch.nn.Parameter(torch.ones(()))

        def forward(self, x):
            return x * self.gain

    class Wrapped(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.g = inner, Gain()

        def forward(self, ids, **kw):
            out = self.inner(ids, **kw)
            out.logits = self.g(out.logits)
            return out

    with pytest.raises(TraceExportError, match=r"parameter `g.gain` \(module `g` \(Gain\)\).*no site"):
        assert_norms(Wrapped(tied_gpt2.model), gpt2_loss, tied_gpt2.ids, tied_gpt2.exact, max_grad_norm=1.0)


def test_assert_norms_passes_bad_check_arguments_through(tied_gpt2):
    with pytest.raises(ValueError, match="precision must be one of"):
        assert_norms(tied_gpt2.model, tied_gpt2.loss, tied_gpt2.ids, tied_gpt2.exact, max_grad_norm=1.0,
                     precision="f8")
    with pytest.raises(ValueError, match="max_grad_norm must be a positive number"):
        assert_norms(tied_gpt2.model, tied_gpt2.loss, tied_gpt2.ids, tied_gpt2.exact, max_grad_norm=-1)
