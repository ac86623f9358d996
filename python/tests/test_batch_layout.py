"""No verdict on a layout guess: each use's batch axis is found by backpropagating single
examples' losses, seq-first inputs are stated with `batch_axis=1`, and a model that mixes
examples is refused.

The truth each test holds the oracle to is a brute-force f64 per-example gradient: every
example's own loss differentiated alone with autograd, one at a time."""
import copy

import pytest
import torch

import ghost_oracle
from ghost_oracle.testing import exact_norms as brute_force_norms  # each example's loss alone
from ghost_oracle.torch import TraceExportError, assert_norms, export_trace

opacus = pytest.importorskip("opacus")
from opacus import GradSampleModule  # noqa: E402
from opacus.layers import DPMultiheadAttention  # noqa: E402

V, D, OUT = 11, 6, 5


class SeqFirstEmbedding(torch.nn.Module):
    """An Embedding and a Linear on seq-first ids (T×B), as Opacus's tests feed them with
    batch_first=False."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.fc = torch.nn.Linear(D, OUT)

    def forward(self, ids):
        return self.fc(torch.tanh(self.emb(ids)))


def seq_first_loss(model, ids):  # ids T×B: one loss per column
    y = model(ids)
    return (y ** 2).sum(-1).mean(0) + y[..., 0].sum(0)


class SeqFirstLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(D, OUT)
        self.b = torch.nn.Linear(OUT, 3)

    def forward(self, x):  # x T×B×D
        return self.b(torch.tanh(self.a(x)))


def seq_first_linear_loss(model, x):
    return (model(x) ** 2).sum((0, 2))


def f64(model, seed=5):
    torch.manual_seed(seed)
    return model.double()


def opacus_norms(model, per_example_loss, inputs, batch_first):
    """Opacus's hooks-mode per-sample norms, with the layout stated as its tests state it."""
    gsm = GradSampleModule(copy.deepcopy(model), batch_first=batch_first, loss_reduction="sum")
    per_example_loss(gsm, inputs).sum().backward()
    sq = sum((p.grad_sample.reshape(p.grad_sample.shape[0], -1).double() ** 2).sum(1)
             for p in gsm.parameters() if p.requires_grad)
    return sq.sqrt().detach()


def oracle_truth(tmp_path, model, per_example_loss, inputs, **kw):
    path = tmp_path / "layout.safetensors"
    b = per_example_loss(model, inputs).shape[0]
    export_trace(model, per_example_loss, inputs, path, claimed_norms=torch.ones(b), max_grad_norm=1.0, **kw)
    return torch.tensor([float(n) for n in ghost_oracle.check(path).true_norms], dtype=torch.float64)


@pytest.fixture
def seq_first_ids():
    torch.manual_seed(3)
    return torch.randint(0, V, (4, 4))  # T == B: the shapes alone cannot tell the axes apart


@pytest.fixture
def seq_first_x():
    torch.manual_seed(4)
    return torch.randn(4, 4, D, dtype=torch.float64)  # T×B×D, T == B


CASES = [
    ("embedding", SeqFirstEmbedding, seq_first_loss, "seq_first_ids"),
    ("linear", SeqFirstLinear, seq_first_linear_loss, "seq_first_x"),
]


@pytest.mark.parametrize("name, cls, loss, inputs", CASES, ids=[c[0] for c in CASES])
def test_seq_first_inputs_with_t_equal_b_are_judged_right(request, tmp_path, name, cls, loss, inputs):
    inputs = request.getfixturevalue(inputs)
    model = f64(cls())
    truth = brute_force_norms(model, loss, inputs)
    got = oracle_truth(tmp_path, model, loss, inputs, batch_axis=1)
    torch.testing.assert_close(got, truth, rtol=1e-9, atol=0)
    claim = opacus_norms(model, loss, inputs, batch_first=False)
    torch.testing.assert_close(claim, truth, rtol=1e-9, atol=0)
    report = assert_norms(model, loss, inputs, claimed_norms=claim, max_grad_norm=float(truth.median()),
                          batch_axis=1, clipper="opacus-seq-first")
    assert report.verdict == "pass"


@pytest.mark.parametrize("name, cls, loss, inputs", CASES, ids=[c[0] for c in CASES])
def test_seq_first_inputs_read_batch_first_are_refused_not_judged(request, tmp_path, name, cls, loss, inputs):
    inputs = request.getfixturevalue(inputs)
    model = f64(cls())
    with pytest.raises(TraceExportError, match=r"batch_axis=0.*Pass batch_axis=1") as e:
        export_trace(model, loss, inputs, tmp_path / "t.safetensors", claimed_norms=torch.ones(4), max_grad_norm=1.0)
    assert "fed the inputs directly" in str(e.value)
    assert not (tmp_path / "t.safetensors").exists()


@pytest.mark.parametrize("name, cls, loss, inputs", CASES, ids=[c[0] for c in CASES])
def test_a_claim_split_along_the_wrong_axis_fails(request, name, cls, loss, inputs):
    """Opacus told batch_first=True on seq-first data splits the gradient by position: the oracle,
    told the real layout, calls it wrong."""
    inputs = request.getfixturevalue(inputs)
    model = f64(cls())
    truth = brute_force_norms(model, loss, inputs)
    claim = opacus_norms(model, loss, inputs, batch_first=True)
    assert (claim - truth).abs().max() > 1e-3 * truth.max()
    with pytest.raises(AssertionError, match="privacy-violation|utility-distortion"):
        assert_norms(model, loss, inputs, claimed_norms=claim, max_grad_norm=float(truth.median()), batch_axis=1)


def test_flattened_rows_in_either_order_find_their_examples(tmp_path):
    """A use that sees B·T flattened rows, example-major or example-minor, is split right."""

    class Flat(torch.nn.Module):
        def __init__(self, minor):
            super().__init__()
            self.emb, self.fc, self.minor = torch.nn.Embedding(V, D), torch.nn.Linear(D, OUT), minor

        def forward(self, ids):  # ids B×T
            h = self.emb(ids)
            rows = h.transpose(0, 1).reshape(-1, D) if self.minor else h.reshape(-1, D)
            y = torch.tanh(self.fc(rows))
            return y.reshape(ids.shape[1], ids.shape[0], OUT).transpose(0, 1) if self.minor else y.reshape(
                *ids.shape, OUT)

    def loss(model, ids):
        return (model(ids) ** 2).sum((1, 2))

    torch.manual_seed(8)
    ids = torch.randint(0, V, (3, 5))
    for minor in (False, True):
        model = f64(Flat(minor))
        got = oracle_truth(tmp_path, model, loss, ids)
        torch.testing.assert_close(got, brute_force_norms(model, loss, ids), rtol=1e-9, atol=0)


class AttentionAcrossTheBatch(torch.nn.Module):
    """Shaped like Opacus's mixed-precision test model: B×T×D activations fed to a seq-first
    DPMultiheadAttention, which then attends across the batch."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, 8)
        self.attn = DPMultiheadAttention(8, 2)
        self.fc = torch.nn.Linear(8, OUT)

    def forward(self, ids):
        h = self.emb(ids)
        a, _ = self.attn(h, h, h)
        return self.fc(a)


def test_a_model_that_mixes_examples_is_refused(tmp_path):
    torch.manual_seed(9)
    ids = torch.randint(0, V, (4, 6))
    model = f64(AttentionAcrossTheBatch())

    def loss(m, x):
        return (m(x) ** 2).sum((1, 2))

    # The ground truth: example 0's loss depends on example 1's input, so no per-example
    # gradient exists (Opacus's split of the batch gradient is a split of nothing).
    emb = model.emb.weight
    x = ids.clone()
    x[1] = (x[1] + 1) % V
    assert not torch.allclose(loss(model, ids)[0], loss(model, x)[0])
    claim = opacus_norms(model, loss, ids, batch_first=True)
    path = tmp_path / "mixing.safetensors"
    with pytest.raises(TraceExportError, match="the model mixes examples") as e:
        export_trace(model, loss, ids, path, claimed_norms=claim, max_grad_norm=1.0)
    assert "module `emb` (Embedding)" in str(e.value)
    assert not path.exists()
    with pytest.raises(TraceExportError, match="the model mixes examples"):
        assert_norms(model, loss, ids, claimed_norms=claim, max_grad_norm=1.0)
    assert emb.grad is not None  # the batch's backward ran: the refusal comes from the probes


def test_mixing_is_found_above_the_probe_all_limit(tmp_path):
    """B = 12 > 8: a seeded choice of examples is probed, and the mixing is still found."""
    torch.manual_seed(10)
    ids = torch.randint(0, V, (12, 3))
    model = f64(AttentionAcrossTheBatch())
    with pytest.raises(TraceExportError, match="the model mixes examples"):
        export_trace(model, lambda m, x: (m(x) ** 2).sum((1, 2)), ids, tmp_path / "m.safetensors",
                     claimed_norms=torch.ones(12), max_grad_norm=1.0)


class Borrow(torch.nn.Module):
    """A linear layer, then example `to`'s hidden state gains `w` times example `frm`'s: the
    loss of `to` depends on the input of `frm`, a mixing confined to two examples."""

    def __init__(self, frm, to, w=0.5):
        super().__init__()
        self.a, self.b = torch.nn.Linear(D, OUT), torch.nn.Linear(OUT, 3)
        self.src, self.dst, self.w = frm, to, w

    def forward(self, x):
        h = torch.tanh(self.a(x))
        lent = torch.zeros_like(h)
        lent[self.dst] = h[self.src]
        return self.b(h + self.w * lent)


def _mixes(model, x, frm, to):
    """The ground truth: example `to`'s loss changes with example `frm`'s input."""
    loss = model(x).pow(2).sum(-1)
    y = x.clone()
    y[frm] += 1.0
    return not torch.allclose(loss[to], model(y).pow(2).sum(-1)[to])


@pytest.mark.parametrize("where", ["inside one probed group", "from an unprobed example into a probed one"])
def test_mixing_the_zero_test_of_a_group_cannot_see_is_refused(tmp_path, where):
    """B = 12: examples are probed four at a time. Mixing between two examples of one group never
    leaves the group, and a loss that is not probed reaching a probed example's part is in no
    probe at all: both show where the group's gradient at its own examples is not each example's
    power-of-two weight times the batch's there."""
    from ghost_oracle.torch.layout import _probe_groups

    b = 12
    first = _probe_groups(b)[0]
    outside = next(i for i in range(b) if i not in first)
    frm, to = (first[0], first[1]) if where.startswith("inside") else (first[0], outside)
    torch.manual_seed(12)
    model = f64(Borrow(frm, to))
    x = torch.randn(b, D, dtype=torch.float64)
    assert _mixes(model, x, frm, to)
    with pytest.raises(TraceExportError, match=f"the model mixes examples.*receives gradient at example {frm}"):
        export_trace(model, lambda m, v: m(v).pow(2).sum(-1), x, tmp_path / "m.safetensors",
                     claimed_norms=torch.ones(b), max_grad_norm=1.0)
    assert not (tmp_path / "m.safetensors").exists()


def test_the_group_check_holds_a_model_that_keeps_examples_apart(tmp_path):
    """The same model lending nothing (w = 0), B = 12 in float32 and float64: every group's
    gradient is its weights times the batch's, and the trace's norms are brute force's."""
    from ghost_oracle.torch.layout import _probe_groups

    first = _probe_groups(12)[0]
    for dtype in (torch.float32, torch.float64):
        torch.manual_seed(13)
        model = Borrow(first[0], first[1], w=0.0).to(dtype)
        x = torch.randn(12, D, dtype=dtype)
        loss = lambda m, v: m(v).pow(2).sum(-1)  # noqa: E731
        got = oracle_truth(tmp_path, model, loss, x)
        want = brute_force_norms(model.double(), loss, x.double())
        torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1e-9, atol=0)


def test_batch_norm_in_training_mode_is_refused(tmp_path):
    class Bn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.fc = torch.nn.Embedding(V, D), torch.nn.Linear(D, OUT)
            self.bn = torch.nn.BatchNorm1d(D, affine=False)

        def forward(self, ids):
            return self.fc(self.bn(self.emb(ids).transpose(1, 2)).transpose(1, 2))

    torch.manual_seed(11)
    ids = torch.randint(0, V, (3, 4))
    with pytest.raises(TraceExportError, match="the model mixes examples"):
        export_trace(f64(Bn()).train(), lambda m, x: (m(x) ** 2).sum((1, 2)), ids, tmp_path / "b.safetensors",
                     claimed_norms=torch.ones(3), max_grad_norm=1.0)


@pytest.mark.parametrize("bad", [2, -1, "0", True, 0.0])
def test_batch_axis_must_be_0_or_1(tmp_path, seq_first_ids, bad):
    with pytest.raises(ValueError, match="batch_axis must be 0"):
        export_trace(f64(SeqFirstEmbedding()), seq_first_loss, seq_first_ids, tmp_path / "t.safetensors",
                     claimed_norms=torch.ones(4), max_grad_norm=1.0, batch_axis=bad)
