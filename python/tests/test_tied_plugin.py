"""The tied ghost-clipping plug-in's contract beyond the norms: it stands alone (no import of the
judge), it refuses what it cannot see or compute, it passes other modes to Opacus untouched, and
a loss divided for gradient accumulation (as Hugging Face's Trainer does) keeps every
micro-batch."""
import ast
import copy
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")

from opacus import GradSampleModule, PrivacyEngine
from tied_runs import PerExampleLoss, loop_clipped_sum, max_rel, plugin_norms
from torch import nn

import ghost_oracle.tied
from ghost_oracle import testing as t
from ghost_oracle.tied.plugin import TiedDPTensor

PACKAGE = Path(ghost_oracle.tied.__file__).parent
ALLOWED_ROOTS = {"torch", "opacus", "__future__"}


def test_the_package_imports_only_torch_opacus_and_the_standard_library():
    """The plug-in is code under test: it must not share code with the oracle that judges it."""
    import sys

    stdlib = set(sys.stdlib_module_names)
    found = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level > 0:  # relative: must stay inside the package
                    assert node.module is None or not node.module.startswith("."), path
                    if node.level > 1:
                        found.append(f"{path.name}: from {'.' * node.level}{node.module or ''}")
                    continue
                names = [node.module or ""]
            else:
                continue
            for name in names:
                root = name.split(".")[0]
                if root not in ALLOWED_ROOTS and root not in stdlib:
                    found.append(f"{path.name}: {name}")
    assert len(list(PACKAGE.glob("*.py"))) >= 4
    assert found == [], f"ghost_oracle.tied imports beyond torch/opacus/stdlib: {found}"


class TiedToy(nn.Module):
    """An embedding, a hidden layer and a head tied to the embedding; `extra` adds a third use of
    the tied weight the hooks cannot see (a functional F.linear)."""

    def __init__(self, extra=False):
        super().__init__()
        torch.manual_seed(2)
        self.emb = nn.Embedding(11, 6)
        self.mix = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight
        self.extra = extra

    def forward(self, ids):
        h = torch.tanh(self.mix(self.emb(ids)))
        logits = self.head(h)
        if self.extra:
            logits = logits + 0.5 * nn.functional.linear(h, self.emb.weight)
        return logits


def toy_loss(model, ids):
    logits = model(ids)
    return nn.functional.cross_entropy(logits.reshape(-1, 11), ids.roll(1, 1).reshape(-1),
                                       reduction="none").view(ids.shape[0], -1).mean(1)


TOY_IDS = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(3))


def test_the_toy_without_a_hidden_use_gets_exact_norms():
    model = TiedToy().train()
    norms = plugin_norms(model, toy_loss, TOY_IDS)
    exact = t.exact_norms(model, toy_loss, TOY_IDS)
    assert float(((norms - exact).abs() / exact).max()) < 1e-5


def test_a_use_the_hooks_cannot_see_raises_naming_the_parameter():
    model = TiedToy(extra=True).train()
    with pytest.raises(RuntimeError, match=r"tied parameter `emb.weight`: its batch gradient differs .* a use the "
                                           r"hooks cannot see"):
        plugin_norms(model, toy_loss, TOY_IDS)


def test_a_tied_parameter_held_by_another_kind_of_layer_is_refused_by_name():
    class Scaled(nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.weight = weight

        def forward(self, h):
            return h * self.weight.mean()

    model = TiedToy()
    model.scaled = Scaled(model.emb.weight)
    with pytest.raises(ValueError, match=r"tied parameter `emb.weight` .* held by `scaled.weight`, a Scaled"):
        plugin_norms(model, toy_loss, TOY_IDS)


def test_other_modes_are_opacus_unchanged():
    model = TiedToy().train()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(4)), batch_size=4)
    made = ghost_oracle.tied.make_private(PrivacyEngine(), module=model,
                                          optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                          data_loader=loader, noise_multiplier=0.0, max_grad_norm=1.0,
                                          grad_sample_mode="hooks", poisson_sampling=False)
    assert len(made) == 3 and type(made[0]) is GradSampleModule


def test_the_engine_is_left_as_it_was():
    engine = PrivacyEngine()
    model = TiedToy().train()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(4)), batch_size=4)
    ghost_oracle.tied.make_private(engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                   criterion=PerExampleLoss("mean"), data_loader=loader, noise_multiplier=0.0,
                                   max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode="ghost")
    assert "_prepare_model" not in vars(engine) and "_prepare_criterion" not in vars(engine)


def test_a_loss_divided_for_accumulation_keeps_every_micro_batch():
    """(loss / 2).backward() for each of two micro-batches, then one step: the clipped sum holds
    both micro-batches' examples (Opacus's own loss wrapper keeps only the last)."""
    model = TiedToy().train()
    c = float(t.exact_norms(model, toy_loss, TOY_IDS).median()) * 0.4  # half the examples' halves clipped
    module = copy.deepcopy(model)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(4)), batch_size=4)
    gsm, optimizer, criterion, _ = ghost_oracle.tied.make_private(
        PrivacyEngine(), module=module, optimizer=torch.optim.SGD(module.parameters(), lr=1.0),
        criterion=PerExampleLoss("mean"), data_loader=loader, noise_multiplier=0.0, max_grad_norm=c,
        poisson_sampling=False, grad_sample_mode="ghost")
    optimizer.zero_grad(set_to_none=True)
    for mb in (TOY_IDS[:2], TOY_IDS[2:]):
        loss = criterion(toy_loss(gsm, mb)) / 2
        assert isinstance(loss, TiedDPTensor)
        loss.backward()
    assert optimizer.pre_step()
    clipped = {n: p.summed_grad for n, p in module.named_parameters()}
    truth, _ = loop_clipped_sum(model, lambda m, x: toy_loss(m, x) / 2, [TOY_IDS[:2], TOY_IDS[2:]], c)
    assert max_rel(clipped, truth) < 1e-5
