"""Opacus's ghost clipping on a tiny tied GPT-2, then the same call through
ghost_oracle.opacus.make_private: its norms against an autograd loop's.

    PYTHONPATH=python python3 examples/tied_opacus_quickstart.py
"""
import copy
import warnings

import torch
from opacus import PrivacyEngine

import ghost_oracle.opacus
from ghost_oracle import testing

warnings.filterwarnings("ignore")


class PerExampleLoss(torch.nn.Module):
    reduction = "mean"

    def forward(self, losses):
        return losses if self.reduction == "none" else losses.mean()


model, ids = testing.gpt2(), testing.gpt2_ids()  # one layer, V = 19, tied head, B = 4, T = 12


def loss(m, x):
    return testing.causal_lm_loss(m(input_ids=x).logits, x)  # the ordinary call: 1 × T position ids


def private(make_private, **engine_args):
    m = copy.deepcopy(model)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(4)), batch_size=4)
    return make_private(module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), criterion=PerExampleLoss(),
                        data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False,
                        grad_sample_mode="ghost", **engine_args)


module, optimizer, criterion, _ = private(PrivacyEngine().make_private)
try:
    criterion(loss(module, ids)).backward()
except NotImplementedError as e:
    print(f"Opacus:  NotImplementedError: {e}")

engine = PrivacyEngine()
module, optimizer, criterion, _ = private(lambda **kw: ghost_oracle.opacus.make_private(engine, **kw))
criterion(loss(module, ids)).backward()
optimizer.step()
print(f"plug-in: {[round(float(n), 6) for n in module.per_sample_gradient_norms]}")
print(f"exact:   {[round(float(n), 6) for n in testing.exact_norms(model, loss, ids)]}")
