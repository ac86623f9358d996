"""Shadow mode judges DP optimizer steps: Opacus 1.6's `DPOptimizer.step()` (hooks mode) and
its ghost-clipping optimizer, with one or several `backward()` calls before one `step()`, and
`BatchMemoryManager`'s skipped steps. Honest steps pass; a mutated Opacus (the noise scaled, a
wrong divisor, a clipped sum missing one example) fails. The truth each verdict is held to is a
brute-force f64 loop written here: each example's gradient alone, clipped by min(1, C/(n + γ))."""
import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")
from opacus import PrivacyEngine  # noqa: E402
from opacus.optimizers import DPOptimizer  # noqa: E402
from torch import nn  # noqa: E402

import ghost_oracle  # noqa: E402
from ghost_oracle.shadow import ShadowCheckFailed  # noqa: E402

B = 8
GAMMA = 1e-6  # Opacus's γ


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 3))


def data(seed=1, n=B):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def per_example_grads(model, x, y):
    """[n, P]: each example's own f64 gradient of its cross entropy, one at a time."""
    m = copy.deepcopy(model).double()
    rows = []
    for i in range(len(x)):
        m.zero_grad()
        nn.functional.cross_entropy(m(x[i:i + 1].double()), y[i:i + 1]).backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in m.parameters()]))
    return torch.stack(rows)


def clipped_sum(model, x, y, c):
    g = per_example_grads(model, x, y)
    factors = (c / (g.norm(dim=1) + GAMMA)).clamp(max=1.0)
    return (factors[:, None] * g).sum(0)


def flat(tensors):
    return torch.cat([t.detach().double().reshape(-1) for t in tensors])


def private(model, mode="hooks", sigma=0.0, c=0.5, batch=B, seed=2):
    x, y = data(n=batch)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    made = PrivacyEngine().make_private(
        module=model, optimizer=opt, data_loader=loader, criterion=nn.CrossEntropyLoss(),
        noise_multiplier=sigma, max_grad_norm=c, grad_sample_mode=mode, poisson_sampling=False,
        noise_generator=torch.Generator().manual_seed(seed))
    if mode == "ghost":
        gsm, opt, criterion, _ = made
    else:
        (gsm, opt, _), criterion = made, nn.CrossEntropyLoss()
    return gsm, opt, criterion


def private_step(model, x, y, passes=1, **kwargs):
    """One step of a private `model` over (x, y), split into `passes` backward passes; the optimizer."""
    gsm, opt, criterion = private(model, **kwargs)
    opt.zero_grad()
    n = len(x) // passes
    for k in range(passes):
        criterion(gsm(x[k * n:(k + 1) * n]), y[k * n:(k + 1) * n]).backward()
    opt.step()
    return opt


def steps(session):
    return [o for o in session.outcomes if o.what == "step"]


def test_a_hooks_mode_step_passes_and_opacus_clipped_sum_is_the_brute_force():
    model = mlp()
    before = copy.deepcopy(model)
    x, y = data()
    with ghost_oracle.shadow(on_failure="record") as session:
        opt = private_step(model, x, y)
        summed = flat(p.summed_grad for p in opt.params)
    [step] = steps(session)
    assert (step.outcome, step.verdict, step.mode, step.batch_size) == ("judged", "pass", "hooks", B), step.to_json()
    s = step.report.step
    assert s is not None and s.batch_divisor == B and s.clipped_sum.passed and s.update.passed
    truth = clipped_sum(before, x, y, 0.5)
    torch.testing.assert_close(summed, truth, rtol=1e-5, atol=1e-7)
    assert sum(1 for f in s.true_coefficients if f < 1) >= 1  # some example is clipped


def test_a_noisy_step_passes_and_the_noise_is_judged():
    model = mlp()
    x, y = data()
    with ghost_oracle.shadow(on_failure="raise") as session:
        private_step(model, x, y, sigma=1.0)
    [step] = steps(session)
    assert step.verdict == "pass" and step.report.step.noise, step.to_json()


def test_noise_scaled_by_two_fails(monkeypatch):
    import opacus.optimizers.optimizer as optimizer_module

    original = optimizer_module._generate_noise
    monkeypatch.setattr(optimizer_module, "_generate_noise", lambda std, *a, **k: original(2 * std, *a, **k))
    model = mlp()
    x, y = data()
    with pytest.raises(ShadowCheckFailed) as e, ghost_oracle.shadow(on_failure="raise"):
        gsm, opt, criterion = private(model, sigma=1.0)  # the step raises: `opt` is bound before it
        opt.zero_grad()
        criterion(gsm(x), y).backward()
        opt.step()
    o = e.value.outcome
    assert o.what == "step" and o.verdict == "utility-distortion" and "optimizer step" in str(e.value)
    assert "more noise" in o.explanation
    # the brute force: the update times D, less the clipped sum, is noise of 2σC, not σC
    summed = flat(p.summed_grad for p in opt.params)
    noise = flat(p.grad for p in opt.params) * B - summed
    assert 1.7 < float(noise.std()) / 0.5 < 2.3


def test_a_wrong_divisor_fails(monkeypatch):
    def scale_grad(self):
        for p in self.params:
            p.grad /= self.expected_batch_size * self.accumulated_iterations + 1  # off by one example

    monkeypatch.setattr(DPOptimizer, "scale_grad", scale_grad)
    model = mlp()
    before = copy.deepcopy(model)
    x, y = data()
    with ghost_oracle.shadow(on_failure="record") as session:
        opt = private_step(model, x, y)
        update = flat(p.grad for p in opt.params)
    [step] = steps(session)
    assert step.failed and "implied divisor" in step.explanation, step.to_json()
    # the brute force: the update is the clipped sum over B + 1, not B
    truth = clipped_sum(before, x, y, 0.5)
    torch.testing.assert_close(update, truth / (B + 1), rtol=1e-5, atol=1e-7)


def test_a_clipped_sum_missing_one_example_fails(monkeypatch):
    original = DPOptimizer.clip_and_accumulate

    def dropping(self):
        for p in self.params:
            gs = p.grad_sample.clone()
            gs[0] = 0  # example 0 never reaches the sum
            p.grad_sample = gs
        original(self)

    monkeypatch.setattr(DPOptimizer, "clip_and_accumulate", dropping)
    model = mlp()
    before = copy.deepcopy(model)
    x, y = data()
    with ghost_oracle.shadow(on_failure="record") as session:
        opt = private_step(model, x, y)
        summed = flat(p.summed_grad for p in opt.params)
    [norms] = [o for o in session.outcomes if o.what == "norms"]
    [step] = steps(session)
    assert norms.verdict == "pass"  # the norms Opacus clipped by were right
    assert step.failed and "example 0 of 8 is missing" in step.explanation, step.explanation
    # the brute force: the sum is the clipped sum of examples 1..B-1
    torch.testing.assert_close(summed, clipped_sum(before, x[1:], y[1:], 0.5), rtol=1e-5, atol=1e-7)


def test_hooks_mode_two_backward_calls_before_one_step_pass():
    model = mlp()
    before = copy.deepcopy(model)
    x, y = data(n=2 * B)
    with ghost_oracle.shadow(on_failure="raise") as session:
        opt = private_step(model, x, y, passes=2)
        summed = flat(p.summed_grad for p in opt.params)
    [step] = steps(session)
    assert (step.verdict, step.batch_size) == ("pass", 2 * B)
    assert step.report.step.batch_divisor == 2 * B  # expected batch size × 2 accumulated passes
    torch.testing.assert_close(summed, clipped_sum(before, x, y, 0.5), rtol=1e-5, atol=1e-7)


def test_skipped_steps_of_a_batch_memory_manager_make_one_step():
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    model = mlp()
    before = copy.deepcopy(model)
    x, y = data(n=B)
    with ghost_oracle.shadow(on_failure="raise") as session:
        gsm, opt, criterion = private(model)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=B)
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=B // 2, optimizer=opt) as physical:
            for xb, yb in physical:
                opt.zero_grad()
                criterion(gsm(xb), yb).backward()
                opt.step()
                if not opt._is_last_step_skipped:
                    summed = flat(p.summed_grad for p in opt.params)
    [step] = steps(session)
    assert (step.verdict, step.batch_size, step.report.step.batch_divisor) == ("pass", B, B)
    assert len([o for o in session.outcomes if o.what == "norms"]) == 2
    torch.testing.assert_close(summed, clipped_sum(before, x, y, 0.5), rtol=1e-5, atol=1e-7)


def test_a_ghost_mode_step_passes():
    model = mlp()
    before = copy.deepcopy(model)
    x, y = data()
    with ghost_oracle.shadow(on_failure="raise") as session:
        opt = private_step(model, x, y, mode="ghost")
        summed = flat(p.summed_grad for p in opt.params)
    [step] = steps(session)
    assert (step.mode, step.verdict) == ("ghost", "pass")
    torch.testing.assert_close(summed, clipped_sum(before, x, y, 0.5), rtol=1e-5, atol=1e-7)


def test_ghost_mode_two_backward_calls_before_one_step_fail():
    """Opacus 1.6's ghost loss (`DPTensorFastGradientClipping.backward`) calls
    `optimizer.zero_grad()` between its two passes, which drops the clipped gradient an earlier
    `backward()` left in `p.grad`: the step's clipped sum holds the last micro-batch only. Its
    optimizer also states `accumulated_iterations` = 1 whatever ran (hooks mode's counts the
    passes), so it divides by the expected batch size alone."""
    model = mlp()
    before = copy.deepcopy(model)
    x, y = data(n=2 * B)
    with ghost_oracle.shadow(on_failure="record") as session:
        opt = private_step(model, x, y, passes=2, mode="ghost")
        summed = flat(p.summed_grad for p in opt.params)
    norms = [o for o in session.outcomes if o.what == "norms"]
    assert [o.verdict for o in norms] == ["pass", "pass"]  # each pass's norms are right
    [step] = steps(session)
    assert step.failed and step.batch_size == 2 * B, step.to_json()
    assert "examples 0, 1, 2, 3, 4, 5, 6, 7 of 16 are missing" in step.explanation, step.explanation
    # the divisor judged is the one it states, E × 1; the two passes it ran are noted
    assert step.report.step.batch_divisor == B
    assert "states 1 accumulated pass(es)" in step.message and "2 backward pass(es) ran" in step.message
    # the brute force: Opacus's sum is the second micro-batch's alone
    torch.testing.assert_close(summed, clipped_sum(before, x[B:], y[B:], 0.5), rtol=1e-5, atol=1e-7)
    assert not torch.allclose(summed, clipped_sum(before, x, y, 0.5), rtol=1e-3)


def test_every_n_judges_one_step_in_n():
    model = mlp()
    x, y = data()
    with ghost_oracle.shadow(on_failure="raise", every=2) as session:
        gsm, opt, criterion = private(model)
        for _ in range(4):
            opt.zero_grad()
            criterion(gsm(x), y).backward()
            opt.step()
    assert [(o.what, o.outcome) for o in session.outcomes] == [
        ("norms", "judged"), ("step", "judged"), ("norms", "skipped"), ("step", "skipped"),
        ("norms", "judged"), ("step", "judged"), ("norms", "skipped"), ("step", "skipped")]
    assert all(o.verdict == "pass" for o in session.outcomes if o.outcome == "judged")
