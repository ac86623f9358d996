"""A use shared by every example (nanoGPT's `wpe(arange(T))`, GPT-2's 1×T position lookup) is
recognised from what it was computed from, never from a size-1 axis: seq-first layers and
transposed layouts with T = 1 keep their shapes, B = 1 works, a model that mixes examples
through a use that looks shared is still refused, and batch-axis advice, once followed, works.

The truth every test holds the oracle to is brute force on a float64 deep copy of the model:
each example's loss differentiated alone with autograd, one example at a time. A claim of those
norms must pass; the same claim 0.5 % low on the example with the largest norm (above C, so
its clipped contribution exceeds C) must fail."""
import copy

import pytest
import torch

import ghost_oracle
from ghost_oracle.torch import TraceExportError, assert_norms, export_trace

opacus = pytest.importorskip("opacus")
transformers = pytest.importorskip("transformers")
from opacus.layers import DPLSTM, DPMultiheadAttention  # noqa: E402

V, D = 11, 6


def brute_force_norms(model, per_example_loss, inputs):
    """‖∇θ L_i‖ of each example's loss alone, by autograd, on a float64 deep copy."""
    m = copy.deepcopy(model).double()
    x = inputs.double() if torch.is_tensor(inputs) and inputs.is_floating_point() else inputs
    params = [p for p in m.parameters() if p.requires_grad]
    losses = per_example_loss(m, x)
    norms = []
    for i in range(losses.shape[0]):
        grads = torch.autograd.grad(losses[i], params, retain_graph=True, allow_unused=True)
        norms.append(torch.sqrt(sum((g ** 2).sum() for g in grads if g is not None)))
    return torch.stack(norms).detach()


def oracle_truth(tmp_path, model, per_example_loss, inputs, **kw):
    path = tmp_path / "shared.safetensors"
    b = per_example_loss(model, inputs).shape[0]
    export_trace(model, per_example_loss, inputs, path, claimed_norms=torch.ones(b), max_grad_norm=1.0, **kw)
    return torch.tensor([float(n) for n in ghost_oracle.check(path).true_norms], dtype=torch.float64)


def holds_to_the_truth(tmp_path, model, per_example_loss, inputs, **kw):
    """The oracle's truth is brute force's, exact claims pass, a claim 0.5 % low on one example
    fails."""
    truth = brute_force_norms(model, per_example_loss, inputs)
    assert bool((truth > 0).all())
    got = oracle_truth(tmp_path, model, per_example_loss, inputs, **kw)
    torch.testing.assert_close(got, truth, rtol=1e-9, atol=0)
    c = float(truth.min()) * 0.9 if truth.numel() == 1 else float(truth.median()) * 0.999
    report = assert_norms(model, per_example_loss, inputs, claimed_norms=truth, max_grad_norm=c, **kw)
    assert report.verdict == "pass"
    low = truth.clone()
    worst = int(truth.argmax())
    low[worst] *= 0.995
    with pytest.raises(AssertionError, match="privacy-violation"):
        assert_norms(model, per_example_loss, inputs, claimed_norms=low, max_grad_norm=c, **kw)


# ---------------------------------------------------------------------------------------------
# nanoGPT: a position table looked up with arange(T), T×d, added to the B×T×d token embeddings.


class NanoGPT(torch.nn.Module):
    def __init__(self, t_max=8):
        super().__init__()
        self.wte = torch.nn.Embedding(V, D)
        self.wpe = torch.nn.Embedding(t_max, D)
        self.ln = torch.nn.LayerNorm(D)
        self.head = torch.nn.Linear(D, V)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.head(self.ln(self.wte(ids) + self.wpe(pos)))


def lm_loss(model, ids):
    logits = model(ids)
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), (ids + 1) % V, reduction="none").sum(1)


@pytest.mark.parametrize("b, t", [(3, 5), (4, 4), (3, 1), (1, 4), (10, 2)],
                         ids=["T>B", "T==B", "T=1", "B=1", "B>8"])
def test_a_nanogpt_position_table_is_judged(tmp_path, b, t):
    torch.manual_seed(20 + b + t)
    model = NanoGPT().double()
    ids = torch.randint(0, V, (b, t))
    holds_to_the_truth(tmp_path, model, lm_loss, ids)


def test_per_example_gradients_of_a_shared_use_one_backward_at_a_time(tmp_path, monkeypatch):
    """B > 8 probes four examples; the shared table's other examples come from one batched
    backward, or, where autograd cannot batch it, one backward each: both give brute force's."""
    import ghost_oracle.torch.layout as layout

    grad = torch.autograd.grad
    batched = []

    def no_batching(*args, **kwargs):
        if kwargs.get("is_grads_batched"):
            batched.append(True)
            raise RuntimeError("no batching rule")
        return grad(*args, **kwargs)

    monkeypatch.setattr(layout.torch.autograd, "grad", no_batching)
    torch.manual_seed(31)
    model = NanoGPT().double()
    ids = torch.randint(0, V, (10, 3))
    got = oracle_truth(tmp_path, model, lm_loss, ids)
    assert batched  # the batched backward was tried first
    torch.testing.assert_close(got, brute_force_norms(model, lm_loss, ids), rtol=1e-9, atol=0)


def test_a_float32_nanogpt_position_table_is_judged(tmp_path):
    """At float32 the truth is within the float32 rounding of brute force's f64."""
    torch.manual_seed(3)
    model = NanoGPT()
    ids = torch.randint(0, V, (4, 4))
    truth = brute_force_norms(model, lm_loss, ids)
    got = oracle_truth(tmp_path, model, lm_loss, ids)
    torch.testing.assert_close(got, truth, rtol=1e-5, atol=0)


# ---------------------------------------------------------------------------------------------
# GPT-2: its 1×T position ids, from Hugging Face's own forward and given explicitly.


def tiny_gpt2():
    torch.manual_seed(7)
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=8, n_embd=12, n_layer=1, n_head=3, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  attn_implementation="eager")
    return transformers.GPT2LMHeadModel(cfg).double().eval()


def gpt2_default_positions(model, ids):
    logits = model(ids).logits
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), (ids + 1) % V, reduction="none").sum(1)


def gpt2_1xT_positions(model, ids):
    logits = model(ids, position_ids=torch.arange(ids.shape[1]).unsqueeze(0)).logits
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), (ids + 1) % V, reduction="none").sum(1)


@pytest.mark.parametrize("loss", [gpt2_default_positions, gpt2_1xT_positions], ids=["default", "1xT"])
@pytest.mark.parametrize("t", [5, 1])
def test_gpt2_position_lookup_is_judged(tmp_path, loss, t):
    torch.manual_seed(8)
    holds_to_the_truth(tmp_path, tiny_gpt2(), loss, torch.randint(0, V, (3, t)))


def test_gpt2_position_ids_given_once_in_the_batch_dict(tmp_path):
    """A 1×T `position_ids` in the inputs holds no example's content: its lookup is shared."""
    torch.manual_seed(9)
    ids = torch.randint(0, V, (3, 5))
    batch = {"input_ids": ids, "position_ids": torch.arange(5).unsqueeze(0)}

    def loss(model, x):
        logits = model(**x).logits
        return torch.nn.functional.cross_entropy(logits.transpose(1, 2), (x["input_ids"] + 1) % V,
                                                 reduction="none").sum(1)

    holds_to_the_truth(tmp_path, tiny_gpt2(), loss, batch)


# ---------------------------------------------------------------------------------------------
# Attention with T = 1 and T > 1, seq-first and batch-first: nothing is stretched to the batch.


class Attention(torch.nn.Module):
    def __init__(self, batch_first, opacus_layer=False):
        super().__init__()
        self.inp = torch.nn.Linear(3, D)
        cls = DPMultiheadAttention if opacus_layer else torch.nn.MultiheadAttention
        self.attn = cls(D, 2, batch_first=batch_first)
        self.out = torch.nn.Linear(D, 2)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        a, _ = self.attn(h, h, h)
        return self.out(a)


def seq_first_loss(model, x):  # x T×B×3: one loss per column
    return (model(x) ** 2).sum((0, 2))


def batch_first_loss(model, x):  # x B×T×3
    return (model(x) ** 2).sum((1, 2))


@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq-first", "batch-first"])
def test_multihead_attention_with_any_t_is_judged(tmp_path, batch_first, t):
    torch.manual_seed(10 + t)
    model = Attention(batch_first).double()
    b = 3
    if batch_first:
        holds_to_the_truth(tmp_path, model, batch_first_loss, torch.randn(b, t, 3, dtype=torch.float64))
    else:
        holds_to_the_truth(tmp_path, model, seq_first_loss, torch.randn(t, b, 3, dtype=torch.float64),
                           batch_axis=1)


@pytest.mark.parametrize("batch_first", [False, True], ids=["seq-first", "batch-first"])
def test_opacus_multihead_attention_with_t_1_is_judged(tmp_path, batch_first):
    torch.manual_seed(12)
    model = Attention(batch_first, opacus_layer=True).double()
    if batch_first:
        holds_to_the_truth(tmp_path, model, batch_first_loss, torch.randn(4, 1, 3, dtype=torch.float64))
    else:
        holds_to_the_truth(tmp_path, model, seq_first_loss, torch.randn(1, 4, 3, dtype=torch.float64), batch_axis=1)


class TransposedAttention(torch.nn.Module):
    """Batch-first inputs, a seq-first attention inside: the layout is transposed twice."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(3, D)
        self.attn = torch.nn.MultiheadAttention(D, 2)
        self.out = torch.nn.Linear(D, 2)

    def forward(self, x):  # B×T×3
        h = torch.tanh(self.inp(x)).transpose(0, 1)
        a, _ = self.attn(h, h, h)
        return self.out(a.transpose(0, 1))


@pytest.mark.parametrize("t", [1, 3])
def test_a_transposed_layout_with_t_1_is_judged(tmp_path, t):
    torch.manual_seed(13)
    holds_to_the_truth(tmp_path, TransposedAttention().double(), batch_first_loss,
                       torch.randn(3, t, 3, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------
# Seq-first recurrent stacks with T = 1, given batch_axis=1.


class SeqFirstCell(torch.nn.Module):
    """An RNN cell stepped over T×B×D inputs, a Linear head at every step."""

    def __init__(self):
        super().__init__()
        self.ih, self.hh, self.head = torch.nn.Linear(D, 5), torch.nn.Linear(5, 5), torch.nn.Linear(5, 3)

    def forward(self, x):
        h = torch.zeros(x.shape[1], 5, dtype=x.dtype)
        outs = []
        for step in x:
            h = torch.tanh(self.ih(step) + self.hh(h))
            outs.append(self.head(h))
        return torch.stack(outs)


class SeqFirstLSTM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = DPLSTM(D, 5, batch_first=False)
        self.head = torch.nn.Linear(5, 3)

    def forward(self, x):
        y, _ = self.lstm(x)
        return self.head(y)


@pytest.mark.parametrize("cls", [SeqFirstCell, SeqFirstLSTM])
@pytest.mark.parametrize("t", [1, 3])
def test_a_seq_first_stack_with_t_1_is_judged_with_batch_axis_1(tmp_path, cls, t):
    torch.manual_seed(14)
    holds_to_the_truth(tmp_path, cls().double(), seq_first_loss, torch.randn(t, 4, D, dtype=torch.float64),
                       batch_axis=1)


# ---------------------------------------------------------------------------------------------
# Mixing through a use that looks shared: still refused, never judged.


class MeanOfTheBatch(torch.nn.Module):
    """Float inputs: every example's output gets a Linear of the batch's mean."""

    def __init__(self):
        super().__init__()
        self.own, self.pooled = torch.nn.Linear(3, 4), torch.nn.Linear(3, 4)

    def forward(self, x):  # B×T×3
        return self.own(x) + self.pooled(x.mean(0))


class MeanOfTheBatchIds(torch.nn.Module):
    """Integer ids: the batch's mean id at each position, through a Linear, reaches everyone."""

    def __init__(self, t):
        super().__init__()
        self.emb, self.pooled = torch.nn.Embedding(V, 4), torch.nn.Linear(t, 4)

    def forward(self, ids):  # B×T
        return self.emb(ids) + self.pooled(ids.double().mean(0)).unsqueeze(0)


class SumOfTheBatchIds(torch.nn.Module):
    """Integer ids: a lookup of the batch's summed ids, T×d like a position table."""

    def __init__(self):
        super().__init__()
        self.emb, self.mixed = torch.nn.Embedding(V, 4), torch.nn.Embedding(8 * V, 4)

    def forward(self, ids):
        return self.emb(ids) + self.mixed(ids.sum(0))


class MeanWrittenIntoABuffer(torch.nn.Module):
    """The batch's mean written in place into a fresh buffer, read through a view made before."""

    def __init__(self):
        super().__init__()
        self.own, self.pooled = torch.nn.Linear(3, 4), torch.nn.Linear(3, 4)

    def forward(self, x):  # B×T×3
        buf = torch.zeros(x.shape[1] + 1, 3, dtype=x.dtype)
        view = buf[1:]
        buf[1:].copy_(x.mean(0).detach())  # no gradient to the inputs: only the data flows
        return self.own(x) + self.pooled(view)


class Same(torch.autograd.Function):
    """Returns its input as it got it: autograd hands back a new tensor, a view of it."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class MeanThroughAFunction(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.own, self.pooled = torch.nn.Linear(3, 4), torch.nn.Linear(3, 4)

    def forward(self, x):
        # a leaf of its own that requires gradients, so that autograd wraps what the Function returns
        return self.own(x) + self.pooled(Same.apply(x.mean(0).detach().requires_grad_()))


def sum_loss(model, x):
    return (torch.tanh(model(x)) ** 2).flatten(1).sum(1)


@pytest.mark.parametrize("case", ["float-mean", "ids-mean", "ids-sum", "float-mean-t-equals-b", "written-in-place",
                                  "autograd-function"])
def test_a_model_that_mixes_through_a_shared_looking_use_is_refused(tmp_path, case):
    torch.manual_seed(15)
    if case == "float-mean":
        model, x = MeanOfTheBatch().double(), torch.randn(3, 5, 3, dtype=torch.float64)
    elif case == "written-in-place":
        model, x = MeanWrittenIntoABuffer().double(), torch.randn(3, 5, 3, dtype=torch.float64)
    elif case == "autograd-function":
        model, x = MeanThroughAFunction().double(), torch.randn(3, 5, 3, dtype=torch.float64)
    elif case == "float-mean-t-equals-b":
        model, x = MeanOfTheBatch().double(), torch.randn(3, 3, 3, dtype=torch.float64)
    elif case == "ids-mean":
        model, x = MeanOfTheBatchIds(5).double(), torch.randint(0, V, (3, 5))
    else:
        model, x = SumOfTheBatchIds().double(), torch.randint(0, V, (3, 5))
    # The ground truth: example 0's loss changes with example 1's input alone.
    x2 = x.clone()
    x2[1] = x2[1] + 1 if x.is_floating_point() else (x2[1] + 1) % V
    assert not torch.allclose(sum_loss(model, x)[0], sum_loss(model, x2)[0])
    path = tmp_path / "mixing.safetensors"
    with pytest.raises(TraceExportError, match="the model mixes examples"):
        export_trace(model, sum_loss, x, path, claimed_norms=torch.ones(3), max_grad_norm=1.0)
    assert not path.exists()
    truth = brute_force_norms(model, sum_loss, x)
    with pytest.raises(TraceExportError, match="the model mixes examples"):
        assert_norms(model, sum_loss, x, claimed_norms=truth, max_grad_norm=1.0)


class PositionsFromABatchValue(torch.nn.Module):
    """Positions offset by a value of the batch read into Python: the exporter cannot follow it."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(V, 4), torch.nn.Embedding(V + 8, 4)

    def forward(self, ids):
        return self.wte(ids) + self.wpe(torch.arange(ids.shape[1]) + int(ids[0, 0]))


def test_a_shared_looking_use_after_a_read_of_the_batch_into_python_is_refused_by_name(tmp_path):
    torch.manual_seed(16)
    ids = torch.randint(0, V, (3, 4))
    with pytest.raises(TraceExportError, match=r"module `wpe` \(Embedding\).*read values of the batch into Python"
                                               r".*Tensor.__int__"):
        export_trace(PositionsFromABatchValue().double(), sum_loss, ids, tmp_path / "t.safetensors",
                     claimed_norms=torch.ones(3), max_grad_norm=1.0)


# ---------------------------------------------------------------------------------------------
# Batch-axis advice: told to pass an axis, the model passes with it, in both directions.


class TokenLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(D, 5), torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class SeqFirstInside(torch.nn.Module):
    """Batch-first inputs read through a transposed view (seq-first inside) before any
    parameter: with T == B the view has the inputs' shape and storage, not their strides."""

    def __init__(self):
        super().__init__()
        self.cell = SeqFirstCell()

    def forward(self, x):  # B×T×D
        return self.cell(x.transpose(0, 1)).transpose(0, 1)


def advised_axis(tmp_path, model, loss, x, given):
    with pytest.raises(TraceExportError, match=r"Pass batch_axis=(\d)") as e:
        export_trace(model, loss, x, tmp_path / "t.safetensors", claimed_norms=torch.ones(x.shape[1 - given]),
                     max_grad_norm=1.0, batch_axis=given)
    import re

    return int(re.search(r"Pass batch_axis=(\d)", str(e.value)).group(1))


@pytest.mark.parametrize("model_cls, loss, examples_along", [
    (TokenLinear, seq_first_loss, 1), (TokenLinear, batch_first_loss, 0),
    (SeqFirstCell, seq_first_loss, 1), (SeqFirstInside, batch_first_loss, 0),
], ids=["linear seq-first", "linear batch-first", "cell seq-first", "cell batch-first inputs"])
def test_batch_axis_advice_once_followed_works(tmp_path, model_cls, loss, examples_along):
    """T == B, so the inputs' shape cannot tell the axes apart: given the wrong axis the
    exporter says which one holds the examples, and given that one the oracle's truth is brute
    force's; given it, it never advises the other."""
    torch.manual_seed(17)
    model = model_cls().double()
    x = torch.randn(4, 4, D, dtype=torch.float64)
    wrong = 1 - examples_along
    assert advised_axis(tmp_path, model, loss, x, wrong) == examples_along
    holds_to_the_truth(tmp_path, model, loss, x, batch_axis=examples_along)


def test_a_seq_first_model_given_batch_axis_1_with_t_1_is_not_told_to_pass_0(tmp_path):
    torch.manual_seed(18)
    x = torch.randn(1, 5, D, dtype=torch.float64)  # T = 1
    for model in (TokenLinear().double(), SeqFirstCell().double()):
        got = oracle_truth(tmp_path, model, seq_first_loss, x, batch_axis=1)
        torch.testing.assert_close(got, brute_force_norms(model, seq_first_loss, x), rtol=1e-9, atol=0)
