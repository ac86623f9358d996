"""Shadow mode on tiny models run through Opacus 1.6 in each mode: Opacus's honest norms pass, a
mutated Opacus is caught, mixing is refused, an empty batch and computations over a budget are
skipped. The truth every judged computation is held to is a brute-force f64 per-example autograd
loop written here, not the oracle's own."""
import copy
import json

import pytest

torch = pytest.importorskip("torch")
opacus = pytest.importorskip("opacus")
from opacus.grad_sample import wrap_model  # noqa: E402
from opacus.grad_sample.grad_sample_module import GradSampleHooks  # noqa: E402
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (  # noqa: E402
    GradSampleHooksFastGradientClipping,
)
from torch import nn  # noqa: E402

import ghost_oracle  # noqa: E402
from ghost_oracle.shadow import ShadowCheckFailed  # noqa: E402

B = 4


class Tied(nn.Module):
    """An embedding tied to its head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


def models():
    """name -> (model factory, batch); each example's loss is f(out_i) = Σ tanh(out_i)² / 2."""
    g = torch.Generator().manual_seed(0)
    return {
        "linear": (lambda: nn.Linear(5, 3), torch.randn(B, 5, generator=g)),
        "conv2d": (lambda: nn.Conv2d(2, 3, 3), torch.randn(B, 2, 5, 5, generator=g)),
        "embedding": (lambda: nn.Embedding(9, 4), torch.randint(0, 9, (B, 3), generator=g)),
        "layernorm": (lambda: nn.LayerNorm(6), torch.randn(B, 3, 6, generator=g)),
        "groupnorm": (lambda: nn.GroupNorm(2, 4), torch.randn(B, 4, 3, generator=g)),
        "mlp": (lambda: nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)), torch.randn(B, 5, generator=g)),
        "tied": (Tied, torch.randint(0, 11, (B, 5), generator=g)),
    }


def example_losses(out):
    return torch.tanh(out).pow(2).flatten(1).sum(1) / 2


def brute_force_norms(model, x):
    """‖∇θ f(model(x_i))‖ per example: a float64 copy, one example at a time."""
    m = copy.deepcopy(model).double()
    norms = []
    for i in range(x.shape[0]):
        xi = x[i:i + 1].double() if x.is_floating_point() else x[i:i + 1]
        m.zero_grad()
        example_losses(m(xi)).sum().backward()
        # a tied parameter once, with the gradient of both its uses
        norms.append(torch.sqrt(sum(p.grad.pow(2).sum() for p in m.parameters() if p.grad is not None)).item())
    return torch.tensor(norms, dtype=torch.float64)


def run_opacus(model, x, mode, reduction, wrapped=True):
    """One forward and backward through Opacus, as a user writes it."""
    if mode == "ghost":
        gsm = wrap_model(model, grad_sample_mode="ghost", wrap_model=wrapped, loss_reduction=reduction,
                         max_grad_norm=1.0)
    else:
        gsm = wrap_model(model, grad_sample_mode=mode, wrap_model=wrapped, loss_reduction=reduction)
    net = gsm if wrapped else model
    losses = example_losses(net(x))
    (losses.mean() if reduction == "mean" else losses.sum()).backward()
    return gsm


def judged(session):
    """The one per-example-norms computation of the session (an optimizer step is its own)."""
    norms = [o for o in session.outcomes if o.what == "norms"]
    assert len(norms) == 1, [o.to_json() for o in session.outcomes]
    o = norms[0]
    assert o.outcome == "judged", o.to_json()
    return o


CASES = [(name, mode, reduction) for name in models() for mode in ("hooks", "functorch", "ew", "ghost")
         for reduction in ("sum", "mean")
         if not (name == "tied" and mode in ("ghost", "ew"))  # Opacus refuses tying in ghost mode; ew can't tie
         and not (mode == "functorch" and reduction == "mean")]  # one reduction is enough for functorch


@pytest.mark.parametrize(("name", "mode", "reduction"), CASES)
def test_honest_opacus_passes_and_its_truth_is_the_brute_force(name, mode, reduction):
    factory, x = models()[name]
    torch.manual_seed(1)
    model = factory()
    expected = brute_force_norms(model, x)
    with ghost_oracle.shadow(on_failure="record") as session:
        run_opacus(model, x, mode, reduction)
    o = judged(session)
    assert (o.mode, o.module, o.library, o.wrapped) == (mode, type(model).__name__, "opacus", True)
    assert o.verdict == "pass", o.explanation
    # the judge's truth, from the captured module and the surrogate loss alone, is the brute force
    torch.testing.assert_close(torch.as_tensor(o.report.true_norms), expected, rtol=2e-5, atol=1e-7)
    # and Opacus's claims are what the brute force says, within f32
    torch.testing.assert_close(torch.as_tensor(o.report.claimed_norms), expected, rtol=1e-4, atol=1e-6)
    assert o.max_rel_err < 1e-4


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_the_non_wrapping_route_is_judged(mode):
    factory, x = models()["mlp"]
    model = factory()
    truth = brute_force_norms(model, x)  # before Opacus hooks the model in place
    with ghost_oracle.shadow(on_failure="record") as session:
        run_opacus(model, x, mode, "sum", wrapped=False)
    o = judged(session)
    assert (o.mode, o.wrapped, o.verdict) == (mode, False, "pass")
    torch.testing.assert_close(torch.as_tensor(o.report.true_norms), truth, rtol=2e-5, atol=1e-7)


def test_a_linear_sampler_dropping_one_examples_bias_is_caught(monkeypatch):
    original = GradSampleHooks.GRAD_SAMPLERS[nn.Linear]

    def dropped(layer, activations, backprops):
        out = original(layer, activations, backprops)
        if layer.bias is not None:
            out[layer.bias] = out[layer.bias].clone()
            out[layer.bias][0] = 0
        return out

    monkeypatch.setitem(GradSampleHooks.GRAD_SAMPLERS, nn.Linear, dropped)
    factory, x = models()["mlp"]
    model = factory()
    truth = brute_force_norms(model, x)
    with ghost_oracle.shadow(on_failure="record") as session:
        run_opacus(model, x, "hooks", "mean")
    o = judged(session)
    assert o.failed and o.verdict != "pass"
    claimed = torch.as_tensor(o.report.claimed_norms)
    # the brute force agrees that example 0's claim is wrong and the others' right
    assert abs(claimed[0] - truth[0]) > 1e-3 * truth[0]
    torch.testing.assert_close(claimed[1:], truth[1:], rtol=1e-4, atol=1e-6)
    assert "opacus" in (o.explanation or "") or o.explanation


def test_an_embedding_norm_sampler_scaled_by_1_001_is_caught(monkeypatch):
    original = GradSampleHooksFastGradientClipping.NORM_SAMPLERS[nn.Embedding]

    def scaled(layer, activations, backprops):
        return {p: n * 1.001 for p, n in original(layer, activations, backprops).items()}

    monkeypatch.setitem(GradSampleHooksFastGradientClipping.NORM_SAMPLERS, nn.Embedding, scaled)
    factory, x = models()["embedding"]
    model = factory()
    truth = brute_force_norms(model, x)
    with ghost_oracle.shadow(on_failure="record") as session:
        run_opacus(model, x, "ghost", "sum")
    o = judged(session)
    assert o.failed, o.to_json()
    torch.testing.assert_close(torch.as_tensor(o.report.claimed_norms), truth * 1.001, rtol=1e-5, atol=1e-7)


def test_on_failure_raise_fails_the_backward_that_made_it(monkeypatch, tmp_path):
    original = GradSampleHooks.GRAD_SAMPLERS[nn.Linear]
    monkeypatch.setitem(GradSampleHooks.GRAD_SAMPLERS, nn.Linear,
                        lambda layer, a, b: {p: g * 1.01 for p, g in original(layer, a, b).items()})
    factory, x = models()["linear"]
    path = tmp_path / "r.jsonl"
    with pytest.raises(ShadowCheckFailed) as e, ghost_oracle.shadow(report=path):
        run_opacus(factory(), x, "hooks", "sum")
    assert e.value.outcome.verdict != "pass" and "Linear" in str(e.value)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["outcome"] == "judged" and lines[0]["verdict"] == e.value.outcome.verdict
    assert lines[0]["max_rel_err"] == pytest.approx(0.01, rel=1e-3)  # the 1 % the mutant added
    for key in ("test", "call", "library", "mode", "module", "outcome", "verdict", "max_rel_err", "message"):
        assert key in lines[0]


class BatchCenter(nn.Module):
    """What BatchNorm in training mode does to examples, without the buffers Opacus refuses:
    subtracts the batch mean, so that every example's output depends on the others."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True)


def test_a_layer_mixing_examples_is_refused():
    model = nn.Sequential(nn.Linear(5, 4), BatchCenter())
    x = torch.randn(B, 5)
    # the ground truth: example 0's gradient changes when example 1 does
    m = copy.deepcopy(model).double()

    def g0(batch):
        m.zero_grad()
        example_losses(m(batch))[0].backward()
        return m[0].weight.grad.clone()

    x2 = x.double().clone()
    a = g0(x2)
    x2[1] += 1
    assert not torch.allclose(a, g0(x2))
    with ghost_oracle.shadow(on_failure="record") as session:
        gsm = opacus.GradSampleModule(model)
        example_losses(gsm(x)).sum().backward()
    [o] = session.outcomes
    assert o.outcome == "refused" and o.verdict is None and not o.failed
    assert "mix" in o.message.lower(), o.message


def test_an_empty_batch_is_skipped():
    with ghost_oracle.shadow(on_failure="record") as session:
        run_opacus(nn.Linear(5, 3), torch.randn(0, 5), "hooks", "sum")
    [o] = session.outcomes
    assert (o.outcome, o.batch_size) == ("skipped", 0) and "empty" in o.message


def test_budgets_skip_with_the_reason():
    factory, x = models()["mlp"]
    with ghost_oracle.shadow(on_failure="record", max_params=10) as session:
        run_opacus(factory(), x, "hooks", "sum")
    with ghost_oracle.shadow(on_failure="record", max_memory=100) as small:
        run_opacus(factory(), x, "hooks", "sum")
    [o] = session.outcomes
    assert o.outcome == "skipped" and "58 trainable parameters > max_params=10" in o.message
    [o] = small.outcomes
    assert o.outcome == "skipped" and "max_memory=100" in o.message


def test_every_n_judges_one_in_n():
    factory, x = models()["linear"]
    model = factory()
    with ghost_oracle.shadow(on_failure="record", every=2) as session:
        gsm = wrap_model(model, grad_sample_mode="hooks")
        for _ in range(4):
            gsm.zero_grad()
            example_losses(gsm(x)).mean().backward()
    assert [o.outcome for o in session.outcomes] == ["judged", "skipped", "judged", "skipped"]
    assert [o.call for o in session.outcomes] == [0, 1, 2, 3]


def test_each_step_is_judged_at_its_own_parameters():
    """Two steps with an optimizer step between: each computation is judged on the parameters
    its forward used (the copy is taken at forward time)."""
    factory, x = models()["mlp"]
    model = factory()
    truths = []
    with ghost_oracle.shadow(on_failure="record") as session:
        gsm = wrap_model(model, grad_sample_mode="hooks", loss_reduction="sum")
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for _ in range(2):
            plain = factory()  # the same parameters, without Opacus's hooks
            plain.load_state_dict(model.state_dict())
            truths.append(brute_force_norms(plain, x))
            gsm.zero_grad()
            example_losses(gsm(x)).sum().backward()
            opt.step()
    assert [o.verdict for o in session.outcomes] == ["pass", "pass"]
    assert not torch.allclose(truths[0], truths[1], rtol=1e-3)
    for o, truth in zip(session.outcomes, truths, strict=True):
        torch.testing.assert_close(torch.as_tensor(o.report.true_norms), truth, rtol=2e-5, atol=1e-7)


def test_leaving_restores_torch_also_after_an_error():
    backward = torch.autograd.backward
    with pytest.raises(RuntimeError, match="boom"), ghost_oracle.shadow(on_failure="record"):
        with ghost_oracle.shadow(on_failure="record") as inner:
            assert torch.autograd.backward is not backward
        assert torch.autograd.backward is not backward  # the outer session is still active
        raise RuntimeError("boom")
    assert torch.autograd.backward is backward
    assert inner.outcomes == []
    # nothing is captured once every session has exited
    factory, x = models()["linear"]
    with ghost_oracle.shadow(on_failure="record") as later:
        pass
    run_opacus(factory(), x, "hooks", "sum")
    assert later.outcomes == []


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="on_failure"):
        ghost_oracle.shadow(on_failure="explode")
    with pytest.raises(ValueError, match="every"):
        ghost_oracle.shadow(every=0)
    with pytest.raises(ValueError, match="max_params"):
        ghost_oracle.shadow(max_params=-1)


def test_ghost_clipping_through_the_privacy_engine_is_one_computation_a_step():
    """make_private(grad_sample_mode="ghost"): the loss's backward() runs two backward passes (the
    norms, then the rescaled sum with Opacus's hooks off); the first is the computation."""
    from opacus import PrivacyEngine

    factory, x = models()["mlp"]
    model = factory()
    y = torch.randint(0, 2, (B,), generator=torch.Generator().manual_seed(3))
    m64 = copy.deepcopy(model).double()
    truth = []
    for i in range(B):  # each example's own loss
        m64.zero_grad()
        nn.functional.cross_entropy(m64(x[i:i + 1].double()), y[i:i + 1]).backward()
        truth.append(torch.sqrt(sum(p.grad.pow(2).sum() for p in m64.parameters())).item())
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=B)
    with ghost_oracle.shadow(on_failure="record") as session:
        gsm, opt, criterion, data = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=data,
            criterion=nn.CrossEntropyLoss(), noise_multiplier=0.0, max_grad_norm=1.0, grad_sample_mode="ghost",
            poisson_sampling=False)
        for xb, yb in data:
            criterion(gsm(xb), yb).backward()
            opt.step()
    o = judged(session)
    assert (o.mode, o.verdict) == ("ghost", "pass")
    torch.testing.assert_close(torch.as_tensor(o.report.true_norms), torch.tensor(truth, dtype=torch.float64),
                               rtol=2e-5, atol=1e-7)
    [step] = [s for s in session.outcomes if s.what == "step"]  # opt.step(), judged too
    assert (step.mode, step.verdict, step.batch_size) == ("ghost", "pass", B)
