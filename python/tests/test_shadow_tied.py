"""Shadow mode judges this project's tied ghost-clipping plug-in (`ghost_oracle.opacus.make_private`)
as it judges Opacus: its per-example norms and its optimizer's step, on a tiny tied GPT-2, with
one or two `backward()` calls before one `step()`; Opacus's hooks mode on the same model passes
too, and the plug-in with its tied cross term dropped is caught. The truth is the test's own f64
autograd loop over the examples; shadow mode's capture imports nothing of the plug-in."""
import ast
import copy
import pathlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("opacus")
from opacus import PrivacyEngine  # noqa: E402

import ghost_oracle  # noqa: E402
import ghost_oracle.opacus as dpo  # noqa: E402
from ghost_oracle import testing as t  # noqa: E402
from ghost_oracle.tied import TiedGradSampleModule  # noqa: E402

GAMMA = 1e-6  # Opacus's γ


class PerExampleLoss(torch.nn.Module):
    """The criterion handed to make_private: its input is already the B per-example losses."""

    def __init__(self, reduction="mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, losses):
        if self.reduction == "none":
            return losses
        return losses.mean() if self.reduction == "mean" else losses.sum()


def brute_force(model, ids):
    """[B, P]: each example's own f64 gradient of its loss (a tied parameter once, its uses summed)."""
    m = copy.deepcopy(model).double()
    rows = []
    for i in range(len(ids)):
        m.zero_grad()
        t.gpt2_loss(m, ids[i:i + 1]).sum().backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in m.parameters()]))
    return torch.stack(rows)


@pytest.fixture(scope="module")
def case():
    model, ids = t.gpt2(), t.gpt2_ids()
    g = brute_force(model, ids)
    norms = g.norm(dim=1)
    c = float(norms.median()) * 0.8  # some examples are clipped, some not
    clipped = ((c / (norms + GAMMA)).clamp(max=1.0)[:, None] * g).sum(0)
    return model, ids, c, norms, clipped


def run(model, ids, c, *, mode, micro_batches=1, sigma=0.0):
    """One DP step of `model` (a copy) on `ids` under shadow mode: `micro_batches` backward()
    calls, then one step(); the loader's batch is the whole logical batch."""
    module = copy.deepcopy(model)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=len(ids))
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    kwargs = dict(module=module, optimizer=opt, data_loader=loader, noise_multiplier=sigma, max_grad_norm=c,
                  poisson_sampling=False, grad_sample_mode=mode, noise_generator=torch.Generator().manual_seed(3))
    with ghost_oracle.shadow(on_failure="record") as session:
        if mode == "ghost":
            gsm, opt, criterion, _ = dpo.make_private(PrivacyEngine(), criterion=PerExampleLoss(), **kwargs)
        else:
            gsm, opt, _ = PrivacyEngine().make_private(**kwargs)
            criterion = PerExampleLoss()
        opt.zero_grad()
        for mb in ids.chunk(micro_batches):
            criterion(t.gpt2_loss(gsm, mb)).backward()
        opt.step()
        summed = torch.cat([p.summed_grad.detach().double().reshape(-1) for p in opt.params])
    norms = [o for o in session.outcomes if o.what == "norms"]
    [step] = [o for o in session.outcomes if o.what == "step"]
    return norms, step, summed


@pytest.mark.parametrize(("mode", "micro_batches"), [("hooks", 1), ("ghost", 1), ("ghost", 2)])
def test_tied_gpt2_passes_and_the_truth_is_the_brute_force(case, mode, micro_batches):
    model, ids, c, true_norms, true_clipped = case
    norms, step, summed = run(model, ids, c, mode=mode, micro_batches=micro_batches)
    assert [o.verdict for o in norms] == ["pass"] * micro_batches, [o.to_json() for o in norms]
    assert (step.verdict, step.batch_size, step.module) == ("pass", len(ids), "GPT2LMHeadModel"), step.explanation
    # the judge's truth is the brute force's, and so is the library's clipped sum
    torch.testing.assert_close(torch.as_tensor(step.report.true_norms), true_norms, rtol=2e-5, atol=1e-7)
    torch.testing.assert_close(summed, true_clipped, rtol=2e-4, atol=1e-6)
    assert step.report.tied_parameters  # the tie is seen as one parameter with two uses


def test_the_plug_in_with_its_cross_term_dropped_is_caught(case, monkeypatch):
    monkeypatch.setattr(TiedGradSampleModule, "include_cross_terms", False)
    model, ids, c, true_norms, true_clipped = case
    norms, step, summed = run(model, ids, c, mode="ghost")
    [o] = norms
    assert o.failed and "cross term" in o.explanation, o.to_json()
    assert step.failed, step.to_json()
    # the brute force agrees: the claimed norms and the clipped sum are off
    claimed = torch.as_tensor(o.report.claimed_norms)
    assert float(((claimed - true_norms).abs() / true_norms).max()) > 1e-3
    assert not torch.allclose(summed, true_clipped, rtol=1e-4, atol=1e-6)


def test_shadow_mode_shares_no_code_with_the_plug_in():
    """The capture and the judge import nothing of `ghost_oracle.tied`, nor it of them."""
    root = pathlib.Path(ghost_oracle.__file__).parent

    def imports(path):
        tree = ast.parse(path.read_text())
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                out.add("." * node.level + (node.module or ""))
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
        return out

    shadow = [p for p in (root / "shadow").glob("*.py")]
    assert len(shadow) >= 8
    for path in shadow:
        assert not any("tied" in name for name in imports(path)), path
    for path in (root / "tied").glob("*.py"):
        assert not any("shadow" in name for name in imports(path)), path
