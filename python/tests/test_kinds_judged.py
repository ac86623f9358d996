"""Layers that are judged, not refused: norms without affine parameters (nothing to trace),
`EmbeddingBag(mode="max")`, GroupNorm with one value a group, `nn.MultiheadAttention` with
`add_bias_kv`, ragged bags with per-sample weights; and the refusals that remain, each naming
the module and what is really wrong.

The truth every judged model is held to is a brute-force per-example gradient: each example's
loss differentiated alone with autograd, on a float64 deep copy of the model. Its norms, claimed
exactly, pass; the same claims with one example's norm 0.5 % low fail."""
import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

import ghost_oracle
from ghost_oracle.torch import TraceExportError, assert_norms, export_trace, register_module, unregister_module

B = 4
DTYPES = [torch.float64, torch.float32]
DTYPE_IDS = ["f64", "f32"]


def per_example_loss(batch_axis=0):
    def loss(model, x):
        y = model(x)
        y = y.movedim(batch_axis, 0).flatten(1)
        return (y ** 2).sum(1) + y[:, 0]
    return loss


def _double(x):
    if torch.is_tensor(x):
        return x.double() if x.is_floating_point() else x
    if isinstance(x, tuple):
        return tuple(_double(v) for v in x)
    return x


def brute_force(model, loss, x, own_precision=False):
    """‖∇θ loss_i‖ for every example i, each loss differentiated alone, on a float64 copy (or,
    `own_precision`, on a copy at the model's own precision: the norms an f32 clipper computes)."""
    m = copy.deepcopy(model) if own_precision else copy.deepcopy(model).double()
    if not own_precision:
        x = _double(x)
    params = [p for p in m.parameters() if p.requires_grad]
    losses = loss(m, x)
    norms = []
    for i in range(losses.shape[0]):
        grads = torch.autograd.grad(losses[i], params, retain_graph=True, allow_unused=True)
        norms.append(math.sqrt(sum(float((g ** 2).sum()) for g in grads if g is not None)))
    return torch.tensor(norms, dtype=torch.float64)


def judged(model, x, tmp_path, batch_axis=0, loss=None):
    """Holds the oracle's truth to the brute force, and its verdicts to the claims: exact claims
    pass, one example's claim 0.5 % low fails. Returns the trace's site specs and its path."""
    loss = loss or per_example_loss(batch_axis)
    truth = brute_force(model, loss, x)
    assert bool((truth > 0).all())
    c = float(truth.median())
    path = tmp_path / "t.safetensors"
    specs = export_trace(model, loss, x, path, claimed_norms=truth, max_grad_norm=c, batch_axis=batch_axis)
    got = torch.tensor([float(v) for v in ghost_oracle.check(path).true_norms], dtype=torch.float64)
    f64 = all(p.dtype == torch.float64 for p in model.parameters())
    torch.testing.assert_close(got, truth, rtol=1e-9 if f64 else 2e-5, atol=0)
    # The claims: the exact norms as a clipper at the model's precision computes them (in f64,
    # the truth itself). f32's own forward and backward round; how far an f64 truth may be from
    # them is the bound on the model's own rounding, not these layers' factors.
    exact = truth if f64 else brute_force(model, loss, x, own_precision=True)
    report = assert_norms(model, loss, x, exact, max_grad_norm=c, batch_axis=batch_axis)
    assert report.verdict == "pass"
    low = exact.clone()
    k = int(torch.argmax(exact))  # above C: its clipped contribution would exceed C
    low[k] *= 0.995
    with pytest.raises(AssertionError, match="privacy-violation|utility-distortion"):
        assert_norms(model, loss, x, low, max_grad_norm=c, batch_axis=batch_axis)
    return specs, path


def build(make, dtype, seed=7):
    torch.manual_seed(seed)
    return make().to(dtype)


def randn(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype)


def site_params(specs):
    return {(s["param"], s["kind"]) for s in specs}


# ---------------------------------------------------------------------------------------------
# Norms with nothing to trace: no site, no error; the parameters around them still judged.

class Around(torch.nn.Module):
    """A Linear, the norm, a nonlinearity and a head: the norm's backward is autograd's."""

    def __init__(self, norm, d_in=5, d=6):
        super().__init__()
        self.inp, self.norm, self.head = torch.nn.Linear(d_in, d), norm, torch.nn.Linear(d, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.inp(x))))


class ConvAround(torch.nn.Module):
    """A ConvNd, the norm, a nonlinearity, mean pooling over positions and a head."""

    def __init__(self, dims, norm, c=4, padding=1):
        super().__init__()
        conv = {1: torch.nn.Conv1d, 2: torch.nn.Conv2d, 3: torch.nn.Conv3d}[dims]
        self.conv, self.norm, self.head = conv(2, c, 2, padding=padding), norm, torch.nn.Linear(c, 3)

    def forward(self, x):
        h = torch.tanh(self.norm(self.conv(x)))
        return self.head(h.flatten(2).mean(-1))


def rms_norm(d, **kw):
    return torch.nn.RMSNorm(d, **kw)


PARAMETER_FREE = [
    ("layernorm-2d", lambda: Around(torch.nn.LayerNorm(6, elementwise_affine=False)), (B, 5)),
    ("layernorm-4d", lambda: Around(torch.nn.LayerNorm(6, elementwise_affine=False)), (B, 2, 3, 5)),
    ("rmsnorm-3d", lambda: Around(rms_norm(6, elementwise_affine=False)), (B, 3, 5)),
    ("groupnorm-2d", lambda: Around(torch.nn.GroupNorm(2, 6, affine=False)), (B, 5)),
    ("batchnorm-eval-2d", lambda: Around(torch.nn.BatchNorm1d(6, affine=False)), (B, 5)),
    ("groupnorm-conv2d", lambda: ConvAround(2, torch.nn.GroupNorm(2, 4, affine=False)), (B, 2, 3, 4)),
    ("instancenorm1d-conv1d", lambda: ConvAround(1, torch.nn.InstanceNorm1d(4)), (B, 2, 5)),
    ("instancenorm2d-conv2d", lambda: ConvAround(2, torch.nn.InstanceNorm2d(4)), (B, 2, 3, 4)),
    ("instancenorm3d-conv3d", lambda: ConvAround(3, torch.nn.InstanceNorm3d(4)), (B, 2, 2, 3, 2)),
    ("batchnorm2d-eval-conv2d", lambda: ConvAround(2, torch.nn.BatchNorm2d(4, affine=False)), (B, 2, 3, 4)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", PARAMETER_FREE, ids=[c[0] for c in PARAMETER_FREE])
def test_a_norm_without_affine_parameters_has_no_site_and_the_rest_is_judged(case, dtype, tmp_path):
    name, make, shape = case
    model = build(make, dtype)
    if "eval" in name:
        model.norm.train()  # running statistics that are not the defaults
        with torch.no_grad():
            model(randn(8, *shape[1:], dtype=dtype))
        model.eval()
    assert not list(model.norm.parameters())
    specs, _ = judged(model, randn(*shape, dtype=dtype), tmp_path)
    assert {s["param"] for s in specs} == {n for n, _ in model.named_parameters()}


class FunctionalNorms(torch.nn.Module):
    """Functional norms without a weight, with a bias only, or with neither."""

    def __init__(self, variant):
        super().__init__()
        self.variant = variant
        self.inp, self.head = torch.nn.Linear(5, 6), torch.nn.Linear(6, 3)
        self.b = torch.nn.Parameter(torch.randn(6))

    def forward(self, x):
        h = self.inp(x)
        if self.variant == "layer_norm":
            h = F.layer_norm(h, (6,))
        elif self.variant == "layer_norm-bias":
            h = F.layer_norm(h, (6,), None, self.b)
        elif self.variant == "group_norm":
            h = F.group_norm(h, 3)
        else:
            h = F.group_norm(h, 3, None, self.b)
        return self.head(torch.tanh(h))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("variant", ["layer_norm", "layer_norm-bias", "group_norm", "group_norm-bias"])
def test_a_functional_norm_traces_only_the_parameters_it_reads(variant, dtype, tmp_path):
    model = build(lambda: FunctionalNorms(variant), dtype)
    if not variant.endswith("-bias"):
        model.b.requires_grad_(False)  # not read: no gradient
    specs, _ = judged(model, randn(B, 5, dtype=dtype), tmp_path)
    assert (("b", "bias") in site_params(specs)) == variant.endswith("-bias")
    assert not any(kind == "layernorm" for _, kind in site_params(specs))


NORMS_WITH_ONE_AFFINE = [
    ("layernorm-weight-only", lambda: torch.nn.LayerNorm(6, bias=False), {"weight"}, (B, 3, 5)),
    ("layernorm-frozen-weight", lambda: torch.nn.LayerNorm(6), {"bias"}, (B, 3, 5)),
    ("groupnorm-frozen-weight", lambda: torch.nn.GroupNorm(3, 6), {"bias"}, (B, 5)),
    ("groupnorm-frozen-bias", lambda: torch.nn.GroupNorm(3, 6), {"weight"}, (B, 5)),
    ("rmsnorm-frozen-weight", lambda: rms_norm(6), set(), (B, 2, 3, 5)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", NORMS_WITH_ONE_AFFINE, ids=[c[0] for c in NORMS_WITH_ONE_AFFINE])
def test_a_norm_traces_only_its_trainable_affine_parameters(case, dtype, tmp_path):
    name, make_norm, traced, shape = case
    model = build(lambda: Around(make_norm()), dtype)
    with torch.no_grad():  # not the identity, so that the weight matters
        for p in model.norm.parameters():
            p.add_(0.3 * torch.randn_like(p))
    for attr, p in model.norm.named_parameters():
        p.requires_grad_(attr in traced)
    specs, _ = judged(model, randn(*shape, dtype=dtype), tmp_path)
    kinds = {p.rsplit(".", 1)[1]: k for p, k in site_params(specs) if p.startswith("norm.")}
    assert kinds == {a: ("layernorm" if a == "weight" else "bias") for a in traced}


# ---------------------------------------------------------------------------------------------
# EmbeddingBag(mode="max"): the gradient of each (bag, feature) goes to the row that won it.

class Bag(torch.nn.Module):
    def __init__(self, bag):
        super().__init__()
        self.bag, self.head = bag, torch.nn.Linear(bag.embedding_dim, 3)

    def forward(self, x):
        h = self.bag(x) if torch.is_tensor(x) else self.bag(*x)
        return self.head(torch.tanh(h))


MAX_BAGS = [
    ("2d-ids", lambda: torch.nn.EmbeddingBag(13, 5, mode="max"), lambda: torch.randint(0, 13, (B, 6))),
    ("padding", lambda: torch.nn.EmbeddingBag(13, 5, mode="max", padding_idx=0),
     lambda: torch.tensor([[0, 3, 5], [0, 0, 7], [1, 0, 2], [4, 4, 0]])),
    ("offsets", lambda: torch.nn.EmbeddingBag(13, 5, mode="max"),
     lambda: (torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9]), torch.tensor([0, 2, 3, 7]))),
    ("offsets-include-last", lambda: torch.nn.EmbeddingBag(13, 5, mode="max", include_last_offset=True),
     lambda: (torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9]), torch.tensor([0, 4, 5, 6, 9]))),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", MAX_BAGS, ids=[c[0] for c in MAX_BAGS])
def test_an_embedding_bag_in_max_mode_is_judged(case, dtype, tmp_path):
    _, make_bag, make_ids = case
    model = build(lambda: Bag(make_bag()), dtype)
    specs, _ = judged(model, make_ids(), tmp_path)
    assert ("bag.weight", "embedding") in site_params(specs)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_max_mode_sends_each_features_gradient_to_the_row_the_forward_chose_among_ties(dtype, tmp_path):
    """Rows equal in some features: the forward's choice among ties, not any argmax, gets the
    gradient (a tie broken the other way moves it to another row, which the brute force sees)."""
    model = build(lambda: Bag(torch.nn.EmbeddingBag(6, 3, mode="max")), dtype)
    with torch.no_grad():
        model.bag.weight.copy_(torch.tensor([[1.0, 2, 3], [1, 2, 0], [0, 2, 3], [1, 1, 1], [3, 0, 0], [1, 2, 3]]))
    ids = torch.tensor([[0, 1, 2], [2, 1, 0], [3, 4, 3], [5, 0, 3]])
    judged(model, ids, tmp_path)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_max_mode_with_an_empty_bag_has_no_row_for_it(dtype, tmp_path):
    model = build(lambda: Bag(torch.nn.EmbeddingBag(13, 5, mode="max")), dtype)
    ids, offsets = torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([0, 2, 2, 5])  # bag 1 is empty
    loss = per_example_loss()
    path = tmp_path / "t.safetensors"
    export_trace(model, loss, (ids, offsets), path, claimed_norms=torch.ones(B), max_grad_norm=1.0)
    with safe_open(path, "pt") as f:
        bp = f.get_tensor("bag.weight.backprops")
    assert bool((bp[1] == 0).all()) and bool((bp[0] != 0).any())
    # the empty bag's example still has the head's gradient
    truth = brute_force(model, loss, (ids, offsets))
    got = torch.tensor([float(v) for v in ghost_oracle.check(path).true_norms], dtype=torch.float64)
    torch.testing.assert_close(got, truth, rtol=1e-9 if dtype == torch.float64 else 2e-5, atol=0)


# ---------------------------------------------------------------------------------------------
# GroupNorm with one value a group: x̂ = x − mean = 0, the weight's gradient 0, the bias's not.

class OnePosition(Around):
    """The norm on B×C×1: channels with one position each."""

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.inp(x).unsqueeze(-1)).squeeze(-1)))


ONE_VALUE_GROUPS = [
    ("after-a-linear-2d", lambda: Around(torch.nn.GroupNorm(6, 6)), (B, 5)),
    ("one-position-3d", lambda: OnePosition(torch.nn.GroupNorm(6, 6)), (B, 5)),
    ("conv2d-one-pixel-4d", lambda: ConvAround(2, torch.nn.GroupNorm(4, 4), padding=0), (B, 2, 2, 2)),
]


@pytest.mark.parametrize("frozen", [None, "weight"], ids=["affine", "frozen-weight"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", ONE_VALUE_GROUPS, ids=[c[0] for c in ONE_VALUE_GROUPS])
def test_groupnorm_with_one_value_a_group_is_judged_with_an_exact_zero_weight_gradient(case, dtype, frozen,
                                                                                       tmp_path):
    name, make, shape = case
    model = build(make, dtype)
    with torch.no_grad():
        model.norm.weight.add_(0.5)
        model.norm.bias.add_(0.3 * torch.randn_like(model.norm.bias))
    if frozen:
        model.norm.weight.requires_grad_(False)
    if dtype == torch.float32:
        # The model's own f32 forward and backward form x̂ = 0 (and the gradient below it, 0
        # too) by a cancellation scaled by 1/√ε, 316 at the default ε: its output is then off
        # the exact one by 2e-5 of its size, rounding of the model's (judged by the bound on the
        # model's own rounding), not of this norm's factors, which are exact at any ε.
        model.norm.eps = 1.0
    specs, path = judged(model, randn(*shape, dtype=dtype), tmp_path)
    assert ("norm.bias", "bias") in site_params(specs)
    if not frozen:
        with safe_open(path, "pt") as f:
            assert bool((f.get_tensor("norm.weight.activations") == 0).all())


class PaddedConv(torch.nn.Module):
    """A strided, padded 1×1 convolution on 3 positions reads positions 0 (padding), 1 and 4
    (padding): an example whose position 1 is 0 has every channel constant, its bias."""

    def __init__(self, norm):
        super().__init__()
        self.conv, self.norm, self.head = torch.nn.Conv1d(2, 4, 1, stride=2, padding=1), norm, torch.nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.norm(self.conv(x)))
        return self.head(h.mean(-1))


CONSTANT_GROUPS = [
    ("groupnorm-a-channel-a-group", lambda: torch.nn.GroupNorm(4, 4)),
    ("groupnorm-two-channels-a-group", lambda: torch.nn.GroupNorm(2, 4)),
    ("instancenorm1d", lambda: torch.nn.InstanceNorm1d(4, affine=True)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CONSTANT_GROUPS, ids=[c[0] for c in CONSTANT_GROUPS])
def test_a_group_whose_values_are_all_equal_has_an_exact_zero_xhat(case, dtype, tmp_path):
    """Examples 0 and 2 have constant channels (x̂ = 0 there, its rounding amplified by 1/√ε in
    autograd's own gradient), examples 1 and 3 not."""
    _, make_norm = case
    model = build(lambda: PaddedConv(make_norm()), dtype)
    with torch.no_grad():
        model.norm.weight.add_(0.5)
        model.norm.bias.add_(0.3 * torch.randn_like(model.norm.bias))
    if dtype == torch.float32:
        model.norm.eps = 1.0  # as for one value a group: the model's own f32 rounding is not this test's
    x = randn(B, 2, 3, dtype=dtype)
    x[0::2, :, 1] = 0
    judged(model, x, tmp_path)


class NormFirst(torch.nn.Module):
    def __init__(self, norm, d):
        super().__init__()
        self.norm, self.head = norm, torch.nn.Linear(d, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(x)))


@pytest.mark.parametrize("functional", [False, True], ids=["module", "functional"])
@pytest.mark.parametrize("d", [1, 6], ids=["one-feature", "constant-rows"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_a_layernorm_row_of_equal_values_has_an_exact_zero_xhat(d, dtype, functional, tmp_path):
    eps = 1e-5 if dtype == torch.float64 else 1.0  # as for GroupNorm: the model's own f32 rounding aside
    norm = torch.nn.LayerNorm(d, eps=eps)
    if functional:
        class Fn(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w, self.b = torch.nn.Parameter(torch.rand(d) + 0.5), torch.nn.Parameter(torch.randn(d))

            def forward(self, x):
                return F.layer_norm(x, (d,), self.w, self.b, eps)

        norm = Fn()
    model = build(lambda: NormFirst(norm, d), dtype)
    x = randn(B, 3, d, dtype=dtype)
    x[0::2, 1, :] = 0.7  # rows of equal values in examples 0 and 2 (every row, with one feature)
    judged(model, x, tmp_path)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_functional_groupnorm_with_one_value_a_group_is_judged(dtype, tmp_path):
    class Fn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.head = torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)
            self.w = torch.nn.Parameter(torch.rand(4) + 0.5)
            self.b = torch.nn.Parameter(torch.randn(4))

        def forward(self, x):
            eps = 1e-5 if self.w.dtype == torch.float64 else 1.0  # as above
            return self.head(torch.tanh(F.group_norm(self.inp(x), 4, self.w, self.b, eps)))

    judged(build(Fn, dtype), randn(B, 5, dtype=dtype), tmp_path)


# ---------------------------------------------------------------------------------------------
# nn.MultiheadAttention with add_bias_kv: bias_k and bias_v appended to every example's keys
# and values, `bias_k.repeat(1, B, 1)`: each example's gradient is its copy's.

class Attention(torch.nn.Module):
    def __init__(self, batch_first, **kw):
        super().__init__()
        self.inp = torch.nn.Linear(3, 8)
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=batch_first, **kw)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        a, _ = self.attn(h, h, h)
        return self.head(a)


@pytest.mark.parametrize("zero_attn", [False, True], ids=["", "add-zero-attn"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "seq-first"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_multihead_attention_with_bias_kv_is_judged(dtype, batch_first, zero_attn, tmp_path):
    model = build(lambda: Attention(batch_first, add_bias_kv=True, add_zero_attn=zero_attn), dtype)
    x = randn(B, 5, 3, dtype=dtype) if batch_first else randn(5, B, 3, dtype=dtype)
    specs, _ = judged(model, x, tmp_path, batch_axis=0 if batch_first else 1)
    assert {("attn.bias_k", "bias"), ("attn.bias_v", "bias")} <= site_params(specs)


class CrossAttention(torch.nn.Module):
    """Queries from one sequence, keys and values from another: `in_proj_weight` and
    `in_proj_bias` are split into their query, key and value rows (or, with kdim and vdim, only
    the bias is)."""

    def __init__(self, batch_first, **kw):
        super().__init__()
        self.q, self.kv = torch.nn.Linear(3, 8), torch.nn.Linear(3, kw.get("kdim", 8))
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=batch_first, **kw)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        q, kv = torch.tanh(self.q(x)), torch.tanh(self.kv(x.flip(-1)))
        a, _ = self.attn(q, kv, kv)
        return self.head(a)


CROSS = [("packed", {}), ("kdim-vdim", {"kdim": 5, "vdim": 5}), ("bias-kv", {"add_bias_kv": True})]


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "seq-first"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CROSS, ids=[c[0] for c in CROSS])
def test_cross_attention_with_its_projection_split_into_blocks_of_rows_is_judged(case, dtype, batch_first,
                                                                                 tmp_path):
    _, kw = case
    model = build(lambda: CrossAttention(batch_first, **kw), dtype)
    x = randn(B, 5, 3, dtype=dtype) if batch_first else randn(5, B, 3, dtype=dtype)
    specs, _ = judged(model, x, tmp_path, batch_axis=0 if batch_first else 1)
    assert ("attn.in_proj_bias", "bias") in site_params(specs)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_a_parameter_expanded_to_the_batch_is_a_bias_of_every_example(dtype, tmp_path):
    """A class token `cls.expand(B, -1, -1)` prepended to every example's sequence."""
    class ClassToken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cls = torch.nn.Parameter(torch.randn(1, 1, 4))
            self.inp, self.head = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)

        def forward(self, x):
            h = torch.cat([self.cls.expand(x.shape[0], -1, -1), self.inp(x)], 1)
            return self.head(torch.tanh(h).cumsum(1))

    specs, _ = judged(build(ClassToken, dtype), randn(B, 3, 3, dtype=dtype), tmp_path)
    assert ("cls", "bias") in site_params(specs)


@pytest.mark.parametrize("t", [3, B], ids=["T-3", "T-equals-B"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_a_parameter_expanded_without_the_batch_is_shared_by_every_example(t, dtype, tmp_path):
    """`bias.expand(T, d)` added to every example's T×d: computed from no example, its output
    is shared by all of them, even where T happens to be B."""
    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = torch.nn.Parameter(torch.randn(4))
            self.inp, self.head = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.head(torch.tanh(self.inp(x) + self.pos.expand(x.shape[1], -1)))

    specs, _ = judged(build(Shared, dtype), randn(B, t, 3, dtype=dtype), tmp_path)
    assert ("pos", "bias") in site_params(specs)


# ---------------------------------------------------------------------------------------------
# Ragged bags with per-sample weights: the flat weights split into examples by the offsets.

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("offsets", [[0, 2, 2, 3], [0, 1, 1, 1], [0, 1, 2, 3]], ids=["uneven", "one-full", "even"])
def test_ragged_bags_with_per_sample_weights_are_split_by_their_offsets(offsets, dtype, tmp_path):
    """As many flat ids as examples, so that the weights' one axis has B entries, as the
    examples' would: they still belong to the bags the offsets cut, not to the examples by index."""
    model = build(lambda: Bag(torch.nn.EmbeddingBag(13, 5, mode="sum")), dtype)
    x = (torch.tensor([3, 5, 7, 9]), torch.tensor(offsets), torch.rand(B, dtype=dtype) + 0.5)
    judged(model, x, tmp_path)


def test_per_sample_weights_read_across_bags_are_refused_as_mixing():
    class Shuffled(Bag):
        def forward(self, x):
            ids, offsets, w = x
            return super().forward((ids, offsets, w.flip(0)))  # each bag weighted by another's weights

    model = build(lambda: Shuffled(torch.nn.EmbeddingBag(13, 5, mode="sum")), torch.float64)
    x = (torch.tensor([3, 5, 7, 9]), torch.tensor([0, 2, 2, 3]), torch.rand(B, dtype=torch.float64) + 0.5)
    with pytest.raises(TraceExportError, match="mixes examples"):
        assert_norms(model, per_example_loss(), x, torch.ones(B), max_grad_norm=1.0)


# ---------------------------------------------------------------------------------------------
# The refusals that remain say what is wrong, naming the module.

def refused(model, x, match):
    with pytest.raises(TraceExportError, match=match):
        export_trace(model, per_example_loss(), x, "unused.safetensors", claimed_norms=torch.ones(B),
                     max_grad_norm=1.0)


def test_scale_grad_by_freq_is_refused_as_depending_on_the_other_examples():
    for make in (lambda: Bag(torch.nn.EmbeddingBag(13, 5, scale_grad_by_freq=True)),
                 lambda: torch.nn.Sequential(torch.nn.Embedding(13, 5, scale_grad_by_freq=True), torch.nn.Tanh())):
        model = build(make, torch.float64)
        name = "bag" if isinstance(model, Bag) else "0"
        refused(model, torch.randint(0, 13, (B, 4)),
                rf"module `{name}` \(Embedding(Bag)?\): scale_grad_by_freq=True divides each row's gradient by the "
                "number of times its id occurs in the whole batch")


def test_max_norm_is_refused_as_changing_the_table_it_reads():
    refused(build(lambda: Bag(torch.nn.EmbeddingBag(13, 5, max_norm=1.0)), torch.float64),
            torch.randint(0, 13, (B, 4)), r"module `bag` \(EmbeddingBag\): max_norm=1.0 is not modelled: the forward "
            "renormalizes, in place")

    class Functional(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(13, 5))

        def forward(self, ids):
            return torch.tanh(F.embedding(ids, self.table, max_norm=1.0))

    refused(build(Functional, torch.float64), torch.randint(0, 13, (B, 4)),
            r"a call of embedding on parameter `table`: max_norm=1.0 is not modelled")


def test_a_class_declared_as_a_kind_without_that_kinds_weight_is_refused_naming_its_parameters():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 4))

        def forward(self, x):
            return torch.tanh(x @ self.w.T)

    register_module(Odd, "linear")
    try:
        refused(build(Odd, torch.float64), randn(B, 4),
                r"module `` \(Odd\): traced as linear, which reads the module's parameter `weight`, it has no "
                r"attribute `weight` \(its own parameters: `w`\)")
    finally:
        unregister_module(Odd)


def test_a_weight_computed_from_other_parameters_is_refused_as_such():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the older weight norm, which keeps the class
        model = torch.nn.Sequential(torch.nn.utils.weight_norm(torch.nn.Linear(4, 3).double()), torch.nn.Tanh())
    refused(model, randn(B, 4), r"module `0` \(Linear\): traced as linear, its `weight` is a tensor computed from "
            "other parameters")


def test_a_subclass_of_a_modelled_class_is_named_as_a_subclass_not_as_a_use_of_another_kind():
    class ScaledLinear(torch.nn.Linear):
        def forward(self, x):
            return F.linear(x, 2.0 * self.weight, self.bias)

    model = build(lambda: torch.nn.Sequential(ScaledLinear(4, 3), torch.nn.Tanh()), torch.float64)
    refused(model, randn(B, 4), r"parameter `0.weight` .* module `0` is a ScaledLinear, a subclass of "
            r"torch.nn.modules.linear.Linear, and the exporter traces a class by its exact type")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_a_functional_call_with_a_frozen_weight_traces_its_bias(dtype, tmp_path):
    class FrozenWeight(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 4), requires_grad=False)
            self.b = torch.nn.Parameter(torch.randn(3))
            self.inp = torch.nn.Linear(5, 4)

        def forward(self, x):
            return F.linear(torch.tanh(self.inp(x)), self.w, self.b)

    specs, _ = judged(build(FrozenWeight, dtype), randn(B, 5, dtype=dtype), tmp_path)
    assert ("b", "bias") in site_params(specs)
