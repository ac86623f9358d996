"""Convolutions with a kernel of 1 (a linear map across channels at each position) and norms
without parameters, where Opacus's own tests put them: its mixed-precision models (a ConvNd,
an InstanceNormNd without affine parameters, pooling and a Linear head) and its SampleConvNet
(a Conv1d with kernel 1 between a Conv1d and a Linear over the positions).

The truth every model is held to is brute force: each example's loss differentiated alone with
autograd (`ghost_oracle.testing.exact_norms`), in float64. The oracle's true norms equal it;
claimed exactly, the norms pass; one example's claim 0.1 % low fails."""
import copy

import pytest
import test_peer_suite as P
import torch
import torch.nn.functional as F

import ghost_oracle
from ghost_oracle.testing import exact_norms as brute_force
from ghost_oracle.torch import assert_norms, export_trace

B = 4


def loss_fn(model, x):
    y = model(x).flatten(1)
    return (y ** 2).sum(1) + y[:, 0]


def judged(model, x, tmp_path, loss=loss_fn):
    """The oracle's truth held to the brute force (rtol 1e-9); the exact claims pass and one
    example's claim 0.1 % low fails. Returns the trace's site specs."""
    truth = brute_force(model, loss, x)
    assert bool((truth > 0).all())
    c = float(truth.median())
    path = tmp_path / "t.safetensors"
    specs = export_trace(model, loss, x, path, claimed_norms=truth, max_grad_norm=c)
    got = torch.tensor([float(v) for v in ghost_oracle.check(path).true_norms], dtype=torch.float64)
    torch.testing.assert_close(got, truth, rtol=1e-9, atol=0)
    assert assert_norms(model, loss, x, truth, max_grad_norm=c).verdict == "pass"
    low = truth.clone()
    low[int(torch.argmax(truth))] *= 0.999  # above C: its clipped contribution would exceed C
    with pytest.raises(AssertionError, match="privacy-violation|utility-distortion"):
        assert_norms(model, loss, x, low, max_grad_norm=c)
    return specs


# ---------------------------------------------------------------------------------------------
# A convolution with kernel 1, module and functional, 1-, 2- and 3-d, with and without bias,
# groups 1 and 2.

CONV = {1: (torch.nn.Conv1d, F.conv1d), 2: (torch.nn.Conv2d, F.conv2d), 3: (torch.nn.Conv3d, F.conv3d)}
#: input shapes per spatial rank: several positions, and one (the kernel-1 conv on a B×C×1 view
#: is a Linear across channels)
SHAPES = {1: [(B, 4, 9), (B, 4, 1)], 2: [(B, 4, 3, 3), (B, 4, 1, 1)], 3: [(B, 4, 2, 3, 2), (B, 4, 1, 1, 1)]}


class KernelOne(torch.nn.Module):
    """A kernel-1 convolution (4 → 6 channels), then tanh."""

    def __init__(self, dims, functional, bias, groups):
        super().__init__()
        cls, self.fn = CONV[dims]
        self.functional, self.groups = functional, groups
        if functional:
            self.w = torch.nn.Parameter(torch.randn(6, 4 // groups, *(1,) * dims, dtype=torch.float64))
            self.b = torch.nn.Parameter(torch.randn(6, dtype=torch.float64)) if bias else None
        else:
            self.conv = cls(4, 6, 1, bias=bias, groups=groups).double()

    def forward(self, x):
        h = self.fn(x, self.w, self.b, groups=self.groups) if self.functional else self.conv(x)
        return torch.tanh(h)


KERNEL_ONE = [(dims, functional, bias, groups, shape)
              for dims in (1, 2, 3) for functional in (False, True) for bias in (True, False) for groups in (1, 2)
              for shape in SHAPES[dims]]


@pytest.mark.parametrize("dims,functional,bias,groups,shape", KERNEL_ONE,
                         ids=[f"conv{d}d-{'F' if f else 'module'}-{'bias' if b else 'nobias'}-g{g}-"
                              f"{'x'.join(map(str, s[2:]))}" for d, f, b, g, s in KERNEL_ONE])
def test_a_kernel_one_convolution_is_judged_against_an_autograd_loop(dims, functional, bias, groups, shape,
                                                                      tmp_path):
    torch.manual_seed(dims * 100 + groups * 10 + bias + 2 * functional + shape[-1])
    model = KernelOne(dims, functional, bias, groups)
    specs = judged(model, torch.randn(*shape, dtype=torch.float64), tmp_path)
    weight = "w" if functional else "conv.weight"
    assert {s["param"] for s in specs} == {n for n, _ in model.named_parameters()}
    assert [s["kind"] for s in specs if s["param"] == weight] == ["linear"]


class KernelOneAsLinear(torch.nn.Module):
    """A B×T×d sequence through a kernel-1 Conv1d on its transpose (channels d, positions T), and
    back: a Linear over d written as a convolution."""

    def __init__(self, functional):
        super().__init__()
        self.functional = functional
        self.conv = torch.nn.Conv1d(6, 3, 1).double()

    def forward(self, x):
        xt = x.transpose(1, 2)
        h = F.conv1d(xt, self.conv.weight, self.conv.bias) if self.functional else self.conv(xt)
        return torch.tanh(h.transpose(1, 2))


@pytest.mark.parametrize("functional", [False, True], ids=["module", "F.conv1d"])
@pytest.mark.parametrize("t", [9, 1, B])
def test_a_kernel_one_conv1d_used_as_a_linear_layer_is_judged(functional, t, tmp_path):
    torch.manual_seed(t)
    judged(KernelOneAsLinear(functional), torch.randn(B, t, 6, dtype=torch.float64), tmp_path)


# ---------------------------------------------------------------------------------------------
# Norms without parameters: no site, not refused, and what is around them judged.

class ParameterFreeNorms(torch.nn.Module):
    """A Conv2d, then norms that read no parameter: F.instance_norm, F.group_norm and
    F.layer_norm without weight or bias, InstanceNorm2d, GroupNorm and LayerNorm without affine
    parameters; a kernel-1 Conv2d and a Linear head."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3, padding=1)
        self.inorm = torch.nn.InstanceNorm2d(4)
        self.gnorm = torch.nn.GroupNorm(2, 4, affine=False)
        self.lnorm = torch.nn.LayerNorm(5, elementwise_affine=False)
        self.mix = torch.nn.Conv2d(4, 4, 1)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        h = self.conv(x)
        h = F.instance_norm(torch.tanh(h))
        h = F.group_norm(torch.tanh(h), 2)
        h = F.layer_norm(torch.tanh(h), (5,))
        h = self.lnorm(self.gnorm(self.inorm(torch.tanh(self.mix(h)))))
        return self.head(torch.tanh(h).flatten(2).mean(-1))


def test_norms_without_parameters_have_no_site_and_the_model_is_judged(tmp_path):
    torch.manual_seed(5)
    model = ParameterFreeNorms().double()
    specs = judged(model, torch.randn(B, 2, 3, 5, dtype=torch.float64), tmp_path)
    assert {s["param"] for s in specs} == {n for n, _ in model.named_parameters()}
    assert not any(s["kind"] == "layernorm" for s in specs)


# ---------------------------------------------------------------------------------------------
# The peer suite's models of this kind: judged, and a claim 0.1 % low fails.

PEER = [c for c in P.CASES if c[0] in P.CONV_PEERS]


@pytest.mark.parametrize("case", PEER, ids=[c[0] for c in PEER])
def test_the_peer_conv_models_are_judged(case, tmp_path):
    model, x, loss, axis = P.build(case)
    assert axis == 0
    judged(model, x, tmp_path, loss=loss)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", PEER, ids=[c[0] for c in PEER])
def test_the_peer_conv_models_are_traced_under_autocast_as_opacus_trains_them(case, dtype, tmp_path):
    """Opacus's mixed-precision tests run these models in float32 under autocast: traced, not
    refused, the norms without parameters without a site, and the truth within the low
    precision's rounding of the float64 brute force (autocast leaves float64 alone)."""
    model, x, _, _ = P.build(case)
    model, x = model.float(), x.float()

    def loss(m, x):
        with torch.autocast("cpu", dtype=dtype):
            y = m(x)
        y = y.float().flatten(1)
        return (y ** 2).sum(1) + y[:, 0]

    truth = brute_force(copy.deepcopy(model).double(), loss, x.double())
    path = tmp_path / "t.safetensors"
    specs = export_trace(model, loss, x, path, claimed_norms=truth, max_grad_norm=float(truth.median()))
    assert {s["param"] for s in specs} == {n for n, _ in model.named_parameters()}
    got = torch.tensor([float(v) for v in ghost_oracle.check(path).true_norms], dtype=torch.float64)
    torch.testing.assert_close(got, truth, rtol=2e-2, atol=0)
