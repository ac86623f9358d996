"""Nothing half-written: an export interrupted at any stage (the first forward, a probe's
backward, the self-check, the writer itself) leaves its directory as it was (no file at the
target, an old file there intact, no temporary file), and a finished one leaves the trace alone.
The user's exception propagates unchanged."""
import json
import os
import stat

import pytest
import torch
from safetensors.torch import load_file

import ghost_oracle
from ghost_oracle import _atomic
from ghost_oracle._trace import writer as trace_writer
from ghost_oracle.torch import assert_norms, export_trace
from ghost_oracle.torch import trace as torch_trace

B, F, H = 5, 4, 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(F, H), torch.nn.Tanh(), torch.nn.Linear(H, 2)).double()


def _inputs():
    return torch.randn(B, F, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _loss(model, x):
    return model(x).pow(2).sum(1)


def _brute_norms(model, x):
    """Each example's gradient norm, one backward per example."""
    norms = []
    for i in range(x.shape[0]):
        model.zero_grad()
        _loss(model, x[i:i + 1]).sum().backward()
        norms.append(torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters())).item())
    return norms


class Stop(KeyboardInterrupt):
    """The interrupt the tests raise, told apart from a real Ctrl-C."""


@pytest.fixture
def old_file(tmp_path):
    """A file already at the target, and the bytes it holds."""
    path = tmp_path / "trace.safetensors"
    path.write_bytes(b"an old trace the interrupted export must leave as it is")
    return path, path.read_bytes()


def _interrupt_in_forward(monkeypatch):
    def loss(model, x):
        raise Stop("in the forward")
    return loss


def _interrupt_in_probe_backward(monkeypatch):
    calls = {"backward": 0}

    def loss(model, x):
        out = model(x)

        def hook(grad):
            calls["backward"] += 1
            if calls["backward"] == 2:  # the batch's backward is the first, the first probe the second
                raise Stop("in a probe's backward")
            return grad

        out.register_hook(hook)
        return out.pow(2).sum(1)
    return loss


def _interrupt_in_self_check(monkeypatch):
    def stop(*args, **kwargs):
        raise Stop("in the self-check")
    monkeypatch.setattr(torch_trace, "self_check", stop)
    return _loss


def _interrupt_in_writer(monkeypatch):
    real = trace_writer._write_array
    written = []

    def half_then_stop(f, a):
        if written:  # a write cut off half way: the header and the first array are in the file
            raise Stop("in the writer")
        real(f, a)
        written.append(a)
    monkeypatch.setattr(trace_writer, "_write_array", half_then_stop)
    return _loss


def _interrupt_in_header(monkeypatch):
    def stop(tensors, meta):
        raise Stop("while the header is formed")
    monkeypatch.setattr(trace_writer, "_header", stop)
    return _loss


def _interrupt_in_rename(monkeypatch):
    def stop(src, dst):
        raise Stop("in the rename")
    monkeypatch.setattr(_atomic.os, "replace", stop)
    return _loss


STAGES = {"forward": _interrupt_in_forward, "probe backward": _interrupt_in_probe_backward,
          "self-check": _interrupt_in_self_check, "writer": _interrupt_in_writer,
          "header": _interrupt_in_header, "rename": _interrupt_in_rename}


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("existing", [False, True], ids=["no old file", "old file"])
def test_an_interrupted_export_leaves_the_directory_as_it_was(tmp_path, old_file, monkeypatch, stage, existing):
    target, old_bytes = old_file
    if not existing:
        target.unlink()
    before = sorted(os.listdir(tmp_path))
    loss = STAGES[stage](monkeypatch)
    with pytest.raises(Stop, match=r"^(in|while) "):
        export_trace(_model(), loss, _inputs(), target, claimed_norms=[1.0] * B, max_grad_norm=1.0)
    assert sorted(os.listdir(tmp_path)) == before
    if existing:
        assert target.read_bytes() == old_bytes


def test_a_users_exception_propagates_unchanged_and_nothing_is_written(tmp_path):
    class Mine(Exception):
        pass

    err = Mine("the user's own")

    def loss(model, x):
        raise err

    with pytest.raises(Mine) as e:
        export_trace(_model(), loss, _inputs(), tmp_path / "t.safetensors", claimed_norms=[1.0] * B,
                     max_grad_norm=1.0)
    assert e.value is err
    assert os.listdir(tmp_path) == []


def test_an_interrupted_assert_norms_leaves_no_trace_path(tmp_path, monkeypatch):
    _interrupt_in_writer(monkeypatch)
    target = tmp_path / "kept.safetensors"
    with pytest.raises(Stop):
        assert_norms(_model(), _loss, _inputs(), [1.0] * B, max_grad_norm=1.0, trace_path=target)
    assert os.listdir(tmp_path) == []


def test_a_finished_export_replaces_the_old_file_whole(tmp_path, old_file):
    target, _ = old_file
    model, x = _model(), _inputs()
    truth = _brute_norms(model, x)
    export_trace(model, _loss, x, target, claimed_norms=truth, max_grad_norm=1.0)
    assert os.listdir(tmp_path) == ["trace.safetensors"]
    # the file a plain open(path, "w") would have made: 0o666 less the umask, not 0o600
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o666 & ~umask
    assert load_file(target)["claimed.norms"].tolist() == truth
    assert ghost_oracle.check(target).passed


def _raw_header(path):
    """The header's JSON as written, its keys in file order (safetensors' own reader returns
    `__metadata__` through a HashMap, in no particular order)."""
    data = open(path, "rb").read()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n])


def test_the_header_is_written_in_sorted_order(tmp_path):
    target = tmp_path / "t.safetensors"
    export_trace(_model(), _loss, _inputs(), target, claimed_norms=[1.0] * B, max_grad_norm=1.0)
    keys = list(_raw_header(target)["__metadata__"])
    assert keys == sorted(keys) and {"format", "sites", "max_grad_norm"} <= set(keys)


@pytest.mark.parametrize("make, exc, needle", [
    ("missing directory", FileNotFoundError, "does not exist"),
    ("directory as target", IsADirectoryError, "is a directory"),
    ("file as directory", NotADirectoryError, "is not a directory"),
])
def test_a_target_that_cannot_be_written_is_refused_before_the_model_runs(tmp_path, make, exc, needle):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_dir").mkdir()
    target = {"missing directory": tmp_path / "nope" / "t.safetensors", "directory as target": tmp_path / "a_dir",
              "file as directory": tmp_path / "a_file" / "t.safetensors"}[make]
    ran = []

    def loss(model, x):
        ran.append(True)
        return _loss(model, x)

    with pytest.raises(exc, match=needle) as e:
        export_trace(_model(), loss, _inputs(), target, claimed_norms=[1.0] * B, max_grad_norm=1.0)
    assert str(target) in str(e.value) and "path" in str(e.value)
    assert not ran
    assert sorted(os.listdir(tmp_path)) == ["a_dir", "a_file"] and os.listdir(tmp_path / "a_dir") == []
