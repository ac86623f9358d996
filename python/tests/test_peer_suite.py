"""Models shaped like those of Opacus's own test suite (tests/grad_samples/*, the fast gradient
clipping tests, the DP layers), with the inputs passed as its tests pass them, and Opacus's own
per-sample norms (hooks mode, and ghost mode where Opacus runs it) as the claims.

For every model, the oracle's truth is held to a brute-force f64 per-example gradient (each
example's loss differentiated alone), and every verdict to the brute-force comparison: a claim
within rounding of the truth must pass, a claim off by more must fail. A model whose examples
the model itself mixes must be refused, never judged."""
import copy

import pytest
import torch

import ghost_oracle
import ghost_oracle.opacus
from ghost_oracle.testing import exact_norms as brute_force  # each example's loss differentiated alone
from ghost_oracle.torch import TraceExportError, assert_norms, export_trace

opacus = pytest.importorskip("opacus")
from opacus import GradSampleModule  # noqa: E402
from opacus.grad_sample import GradSampleModuleFastGradientClipping  # noqa: E402
from opacus.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention  # noqa: E402

B = 4


def f64(seed):
    torch.manual_seed(seed)
    return torch.float64


class Wrap(torch.nn.Module):
    """One layer and a nonlinearity, so that the loss is not linear in the layer's output."""

    def __init__(self, layer, pick=None):
        super().__init__()
        self.layer, self.pick = layer, pick

    def forward(self, x):
        y = self.layer(x) if not isinstance(x, tuple) else self.layer(*x)
        y = self.pick(y) if self.pick is not None else y
        return torch.tanh(y)


def summed(batch_axis=0):
    def loss(model, x):
        y = model(x)
        return (y.movedim(batch_axis, 0) ** 2).flatten(1).sum(1) + y.movedim(batch_axis, 0).flatten(1)[:, 0]
    return loss


def first(y):
    return y[0] if isinstance(y, tuple) else y


class RnnClassifier(torch.nn.Module):
    def __init__(self, cls, batch_first, **kw):
        super().__init__()
        self.emb = torch.nn.Embedding(13, 4)
        self.rnn = cls(4, 5, batch_first=batch_first, **kw)
        self.fc = torch.nn.Linear(5 * (2 if kw.get("bidirectional") else 1), 3)
        self.batch_first = batch_first

    def forward(self, x):
        y, _ = self.rnn(self.emb(x))
        last = y[:, -1] if self.batch_first else y[-1]
        return self.fc(last)


class AttentionClassifier(torch.nn.Module):
    def __init__(self, cls, batch_first, **kw):
        super().__init__()
        self.emb = torch.nn.Embedding(13, 8)
        self.attn = cls(8, 2, batch_first=batch_first, **kw)
        self.fc = torch.nn.Linear(8, 3)
        self.batch_first = batch_first

    def forward(self, x):
        h = self.emb(x)
        a, _ = self.attn(h, h, h)
        return self.fc(a.mean(1 if self.batch_first else 0))


def ids(*shape):
    return torch.randint(0, 13, shape)


def randn(*shape):
    return torch.randn(*shape, dtype=torch.float64)


class Functional(torch.nn.Module):
    """Parameters used through functions, no modelled module around them."""

    def __init__(self):
        super().__init__()
        P = torch.nn.Parameter
        self.cw, self.cb = P(torch.randn(6, 2, 3, 3)), P(torch.randn(6))
        self.gw, self.gb = P(torch.rand(6) + 0.5), P(torch.randn(6))
        self.iw, self.ib = P(torch.rand(6) + 0.5), P(torch.randn(6))
        self.lw, self.lb, self.rw = P(torch.rand(5) + 0.5), P(torch.randn(5)), P(torch.rand(5) + 0.5)
        self.w, self.v = P(torch.randn(3, 5)), P(torch.randn(3, 2))

    def forward(self, x):
        F = torch.nn.functional
        h = F.conv2d(x, self.cw, self.cb, padding=1, groups=2)
        h = F.instance_norm(F.group_norm(h, 3, self.gw, self.gb), weight=self.iw, bias=self.ib)
        h = F.rms_norm(F.layer_norm(torch.tanh(h)[..., :5], (5,), self.lw, self.lb), (5,), self.rw)
        return torch.tanh(F.linear(h, self.w)) @ self.v


class TiedByMatmul(torch.nn.Module):
    """A head tied to the embedding, written as a matmul with its transpose, a layer used twice."""

    def __init__(self):
        super().__init__()
        self.emb, self.mix = torch.nn.Embedding(13, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.mix(torch.tanh(self.mix(self.emb(x)))) @ self.emb.weight.T


class ConvInstanceNorm(torch.nn.Module):
    """Opacus's mixed-precision test models (Conv1DModel, Conv2DModel, Conv3DModel): a ConvNd,
    an InstanceNormNd without affine parameters, ReLU, average pooling over every position and a
    Linear head."""

    def __init__(self, dims, c_in=3, hidden=8, out=4):
        super().__init__()
        conv = {1: torch.nn.Conv1d, 2: torch.nn.Conv2d, 3: torch.nn.Conv3d}[dims]
        norm = {1: torch.nn.InstanceNorm1d, 2: torch.nn.InstanceNorm2d, 3: torch.nn.InstanceNorm3d}[dims]
        self.conv, self.norm, self.fc = conv(c_in, hidden, kernel_size=3, padding=1), norm(hidden), \
            torch.nn.Linear(hidden, out)
        self.pool = {1: torch.nn.functional.avg_pool1d, 2: torch.nn.functional.avg_pool2d,
                     3: torch.nn.functional.avg_pool3d}[dims]

    def forward(self, x):
        h = torch.relu(self.norm(self.conv(x)))
        return self.fc(self.pool(h, tuple(h.shape[2:])).flatten(1))


class KernelOneConvNet(torch.nn.Module):
    """Opacus's SampleConvNet (privacy_engine_test, gradient_accumulation_test), smaller: a
    Conv2d, a Conv1d over the flattened image, a Conv1d with kernel 1 (a linear layer across
    channels at each position; Opacus's `convpf`, its weight here trainable), a Linear over the
    positions and a Linear head."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = torch.nn.Conv2d(1, 4, 4, 3), torch.nn.Conv1d(4, 6, 3, 1)
        self.convpf = torch.nn.Conv1d(6, 3, 1, 1)
        self.fc1, self.fc2 = torch.nn.Linear(7, 5), torch.nn.Linear(3 * 5, 3)

    def forward(self, x):
        h = torch.relu(self.conv1(x))  # B×4×3×3
        h = torch.relu(self.conv2(h.flatten(2)))  # B×6×7
        h = self.fc1(self.convpf(h))  # B×3×5
        return self.fc2(h.flatten(1))


# (name, model factory, inputs factory, the inputs' batch axis: 1 is Opacus's batch_first=False)
CASES = [
    ("linear-2d", lambda: Wrap(torch.nn.Linear(6, 5)), lambda: randn(B, 6), 0),
    ("linear-3d", lambda: Wrap(torch.nn.Linear(6, 5)), lambda: randn(B, 3, 6), 0),
    ("linear-4d", lambda: Wrap(torch.nn.Linear(6, 5)), lambda: randn(B, 2, 3, 6), 0),
    ("linear-seq-first", lambda: Wrap(torch.nn.Linear(6, 5)), lambda: randn(3, B, 6), 1),
    ("linear-no-bias", lambda: Wrap(torch.nn.Linear(6, 5, bias=False)), lambda: randn(B, 3, 6), 0),
    ("conv1d", lambda: Wrap(torch.nn.Conv1d(4, 6, 3, stride=2, padding=1)), lambda: randn(B, 4, 9), 0),
    ("conv1d-groups-dilation", lambda: Wrap(torch.nn.Conv1d(4, 6, 3, dilation=2, groups=2)),
     lambda: randn(B, 4, 11), 0),
    ("conv2d", lambda: Wrap(torch.nn.Conv2d(3, 4, 3, padding=1)), lambda: randn(B, 3, 6, 5), 0),
    ("conv2d-groups-stride", lambda: Wrap(torch.nn.Conv2d(4, 8, (3, 2), stride=(2, 1), groups=4)),
     lambda: randn(B, 4, 7, 6), 0),
    ("conv2d-same-reflect", lambda: Wrap(torch.nn.Conv2d(3, 3, 3, padding="same", padding_mode="reflect")),
     lambda: randn(B, 3, 5, 5), 0),
    ("conv2d-depthwise", lambda: Wrap(torch.nn.Conv2d(3, 3, 3, groups=3, bias=False)), lambda: randn(B, 3, 5, 5), 0),
    ("conv3d", lambda: Wrap(torch.nn.Conv3d(2, 4, 2, padding=1, groups=2)), lambda: randn(B, 2, 3, 4, 3), 0),
    ("groupnorm", lambda: Wrap(torch.nn.GroupNorm(2, 6)), lambda: randn(B, 6, 5), 0),
    ("groupnorm-2d", lambda: Wrap(torch.nn.GroupNorm(3, 6)), lambda: randn(B, 6, 3, 4), 0),
    ("instancenorm1d", lambda: Wrap(torch.nn.InstanceNorm1d(4, affine=True)), lambda: randn(B, 4, 7), 0),
    ("instancenorm2d", lambda: Wrap(torch.nn.InstanceNorm2d(4, affine=True)), lambda: randn(B, 4, 3, 5), 0),
    ("instancenorm3d", lambda: Wrap(torch.nn.InstanceNorm3d(2, affine=True)), lambda: randn(B, 2, 3, 2, 4), 0),
    ("layernorm", lambda: Wrap(torch.nn.LayerNorm(6)), lambda: randn(B, 3, 6), 0),
    ("layernorm-2-axes", lambda: Wrap(torch.nn.LayerNorm([3, 6])), lambda: randn(B, 2, 3, 6), 0),
    ("rmsnorm", lambda: Wrap(torch.nn.RMSNorm(6)), lambda: randn(B, 3, 6), 0),
    ("batchnorm-eval", lambda: Wrap(torch.nn.BatchNorm1d(6)).eval(), lambda: randn(B, 6, 3), 0),
    ("embedding", lambda: Wrap(torch.nn.Embedding(13, 4)), lambda: ids(B, 5), 0),
    ("embedding-3d-ids", lambda: Wrap(torch.nn.Embedding(13, 4, padding_idx=0)), lambda: ids(B, 2, 3), 0),
    ("embedding-seq-first", lambda: Wrap(torch.nn.Embedding(13, 4)), lambda: ids(B, B), 1),
    ("embeddingbag-sum", lambda: Wrap(torch.nn.EmbeddingBag(13, 4, mode="sum")), lambda: ids(B, 5), 0),
    ("embeddingbag-mean", lambda: Wrap(torch.nn.EmbeddingBag(13, 4, mode="mean")), lambda: ids(B, 5), 0),
    ("embeddingbag-offsets", lambda: Wrap(torch.nn.EmbeddingBag(13, 4, mode="mean")),
     lambda: (ids(9), torch.tensor([0, 2, 3, 7])), 0),
    ("sequence-bias", lambda: Wrap(opacus.layers.dp_multihead_attention.SequenceBias(6, batch_first=True)),
     lambda: randn(B, 3, 6), 0),
    ("dpmha", lambda: AttentionClassifier(DPMultiheadAttention, True), lambda: ids(B, 5), 0),
    ("dpmha-seq-first", lambda: AttentionClassifier(DPMultiheadAttention, False), lambda: ids(5, B), 1),
    ("dpmha-bias-kv", lambda: AttentionClassifier(DPMultiheadAttention, True, add_bias_kv=True, add_zero_attn=True),
     lambda: ids(B, 5), 0),
    ("mha", lambda: AttentionClassifier(torch.nn.MultiheadAttention, True), lambda: ids(B, 5), 0),
    ("dplstm", lambda: RnnClassifier(DPLSTM, True), lambda: ids(B, 4), 0),
    ("dplstm-seq-first-2-layers", lambda: RnnClassifier(DPLSTM, False, num_layers=2), lambda: ids(4, B), 1),
    ("dplstm-bidirectional", lambda: RnnClassifier(DPLSTM, True, bidirectional=True), lambda: ids(B, 3), 0),
    ("dpgru", lambda: RnnClassifier(DPGRU, True), lambda: ids(B, 4), 0),
    ("dprnn", lambda: RnnClassifier(DPRNN, True), lambda: ids(B, 4), 0),
    ("functional", Functional, lambda: randn(B, 4, 5, 6), 0),
    ("tied-by-matmul", TiedByMatmul, lambda: ids(B, 5), 0),
    ("conv1d-instancenorm", lambda: ConvInstanceNorm(1), lambda: randn(B, 3, 16), 0),
    ("conv2d-instancenorm", lambda: ConvInstanceNorm(2), lambda: randn(B, 3, 6, 6), 0),
    ("conv3d-instancenorm", lambda: ConvInstanceNorm(3), lambda: randn(B, 3, 4, 4, 4), 0),
    ("conv1d-kernel-1", KernelOneConvNet, lambda: randn(B, 1, 12, 12), 0),
    ("conv1d-kernel-1-alone", lambda: Wrap(torch.nn.Conv1d(6, 3, 1)), lambda: randn(B, 6, 9), 0),
]

#: The convolution models with a kernel of 1 or a norm without parameters (test_peer_conv.py
#: holds a claim 0.1 % low to failing on each).
CONV_PEERS = {"conv1d-instancenorm", "conv2d-instancenorm", "conv3d-instancenorm", "conv1d-kernel-1",
              "conv1d-kernel-1-alone"}


NO_OPACUS_CLAIM = {
    ("linear-4d", "ghost"), ("batchnorm-eval", "hooks"), ("batchnorm-eval", "ghost"), ("embedding-seq-first", "ghost"),
    ("embeddingbag-sum", "hooks"), ("embeddingbag-sum", "ghost"), ("embeddingbag-mean", "hooks"),
    ("embeddingbag-mean", "ghost"), ("dpmha-seq-first", "hooks"), ("dpmha-seq-first", "ghost"),
    ("dpmha-bias-kv", "hooks"), ("dpmha-bias-kv", "ghost"), ("mha", "hooks"), ("mha", "ghost"),
    ("dplstm-seq-first-2-layers", "hooks"), ("dplstm-seq-first-2-layers", "ghost"), ("tied-by-matmul", "ghost"),
}


def opacus_claim(model, loss, x, batch_first, ghost):
    """Opacus's per-sample norms, or None where Opacus refuses or fails on the model."""
    try:
        if ghost:
            gsm = GradSampleModuleFastGradientClipping(copy.deepcopy(model), batch_first=batch_first,
                                                       max_grad_norm=1.0, use_ghost_clipping=True,
                                                       loss_reduction="sum")
        else:
            gsm = GradSampleModule(copy.deepcopy(model), batch_first=batch_first, loss_reduction="sum")
        return ghost_oracle.opacus.norms(gsm, loss, x)
    except Exception:  # noqa: BLE001 (Opacus's own refusals and crashes: no claim to judge)
        return None


def build(case):
    name, make_model, make_inputs, axis = case
    f64(sum(map(ord, name)))
    model = make_model().double()
    if not name.endswith("-eval"):
        model.train()
    x = make_inputs()
    # the classifiers pool the sequence away: their outputs are batch-first whatever the inputs
    out_axis = axis if isinstance(model, Wrap) else 0  # (Functional and TiedByMatmul: batch-first)
    return model, x, summed(out_axis), axis


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_truth_is_each_examples_own_gradient(case, tmp_path):
    model, x, loss, axis = build(case)
    truth = brute_force(model, loss, x)
    path = tmp_path / "t.safetensors"
    export_trace(model, loss, x, path, claimed_norms=torch.ones(B), max_grad_norm=1.0, batch_axis=axis)
    got = torch.tensor([float(v) for v in ghost_oracle.check(path).true_norms], dtype=torch.float64)
    torch.testing.assert_close(got, truth, rtol=1e-9, atol=0)


@pytest.mark.parametrize("ghost", [False, True], ids=["hooks", "ghost"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_opacus_claims_get_the_verdict_brute_force_gives(case, ghost):
    model, x, loss, axis = build(case)
    claim = opacus_claim(model, loss, x, batch_first=axis == 0, ghost=ghost)
    # Where Opacus 1.6 raises (docs/results.md, "The peer suite"), there is no claim to judge;
    # the truth test above still judges the model. Pinned, so that a change is seen.
    assert (claim is None) == ((case[0], "ghost" if ghost else "hooks") in NO_OPACUS_CLAIM)
    if claim is None:
        return
    truth = brute_force(model, loss, x)
    c = float(truth.median())
    right = bool(((claim - truth).abs() <= 1e-6 * truth).all())
    if right:
        report = assert_norms(model, loss, x, claim, max_grad_norm=c, batch_axis=axis, clipper="opacus")
        assert report.verdict == "pass"
    else:
        with pytest.raises(AssertionError, match="privacy-violation|utility-distortion"):
            assert_norms(model, loss, x, claim, max_grad_norm=c, batch_axis=axis, clipper="opacus")


class AttentionAcrossTheBatch(torch.nn.Module):
    """Opacus's mixed-precision test model: B×T×D fed to a seq-first DPMultiheadAttention."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(13, 8)
        self.attn = DPMultiheadAttention(8, 2)
        self.fc = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = self.emb(x)
        a, _ = self.attn(h, h, h)
        return self.fc(a.mean(1))


class LinearThenBatchNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn = torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(6)

    def forward(self, x):
        return self.bn(self.fc(x))


@pytest.mark.parametrize("model", [AttentionAcrossTheBatch, lambda: Wrap(torch.nn.BatchNorm1d(6)), LinearThenBatchNorm],
                         ids=["attention-across-the-batch", "batchnorm-first", "batchnorm-after-a-linear"])
def test_a_model_that_mixes_examples_is_refused_whatever_opacus_claims(model):
    f64(3)
    m = model().double().train()
    x = ids(B, 5) if isinstance(m, AttentionAcrossTheBatch) else randn(B, 6, 3)
    loss = summed(0)
    claim = opacus_claim(m, loss, x, batch_first=True, ghost=False)
    with pytest.raises(TraceExportError, match="the model mixes examples"):
        assert_norms(m, loss, x, claim if claim is not None else torch.ones(B), max_grad_norm=1.0)
