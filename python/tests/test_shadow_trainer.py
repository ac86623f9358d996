"""Shadow mode in a Hugging Face `Trainer` run through `ShadowCallback`: Opacus's non-wrapping mode
(`make_private(wrap_model=False)`) on a tiny model, every step's per-example norms and its DP
step judged; the judge's true norms equal a brute-force f64 loop over the batches the Trainer fed
(recorded by the run's own hooks), Opacus's honest norms pass, and a linear grad sampler that drops
example 0's bias term fails every step's norms (and raises out of `trainer.train()` with
on_failure="raise")."""
from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer's own requirement

from opacus import PrivacyEngine  # noqa: E402
from opacus.grad_sample.grad_sample_module import GradSampleHooks  # noqa: E402
from torch import nn  # noqa: E402

import ghost_oracle  # noqa: E402
from ghost_oracle.shadow import session as shadow_sessions  # noqa: E402
from ghost_oracle.shadow.hf import ShadowCallback  # noqa: E402

BATCH, STEPS, VOCAB, CLASSES = 4, 3, 13, 3


class Tiny(nn.Module):
    """Token ids → logits; the loss is computed outside (the Trainer's compute_loss_func)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, input_ids):
        return self.head(torch.tanh(self.embed(input_ids)).mean(1))


class OpacusZeroGrad(transformers.TrainerCallback):
    """The run's own part of putting Opacus in a Trainer: the Trainer calls model.zero_grad(),
    which leaves Opacus's per-sample state; Opacus needs optimizer.zero_grad() each step."""

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        optimizer.zero_grad()


def train(tmp_path, shadow: ShadowCallback):
    """A Trainer run of STEPS steps; what each forward saw (a copy of the weights, the ids) and
    each loss's labels, recorded by the run's own hooks."""
    torch.manual_seed(0)
    data = [{"input_ids": torch.randint(0, VOCAB, (5,)), "labels": int(torch.randint(0, CLASSES, ()))}
            for _ in range(BATCH * STEPS)]
    model = Tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    _, dp_optimizer, _ = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=torch.utils.data.DataLoader(data, batch_size=BATCH),
        noise_multiplier=1.0, max_grad_norm=1.0, wrap_model=False, poisson_sampling=False)
    seen = {"forward": [], "labels": []}

    def record_forward(module, args, kwargs):
        seen["forward"].append((copy.deepcopy(module.state_dict()), kwargs["input_ids"].clone()))

    model.register_forward_pre_hook(record_forward, with_kwargs=True)

    def loss(outputs, labels, num_items_in_batch=None):
        seen["labels"].append(labels.clone())
        return nn.functional.cross_entropy(outputs, labels)  # a batch mean: Opacus's loss_reduction="mean"

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH, num_train_epochs=1, report_to=[],
        use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True, max_grad_norm=0.0, seed=0,
        remove_unused_columns=False, label_names=["labels"])  # labels go to the loss, not the model
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(dp_optimizer, None),
                                   compute_loss_func=loss, callbacks=[OpacusZeroGrad(), shadow])
    return trainer, seen


def brute_force_norms(state, ids, labels):
    """Each example's loss alone through a float64 copy, autograd: its gradient's norm. Opacus
    scales a mean loss's per-sample gradients by the batch size, so example i's is ∇ CE_i."""
    model = Tiny().to(torch.float64)
    model.load_state_dict({k: v.to(torch.float64) for k, v in state.items()})
    norms = []
    for i in range(len(ids)):
        grads = torch.autograd.grad(nn.functional.cross_entropy(model(ids[i:i + 1]), labels[i:i + 1]),
                                    list(model.parameters()))
        norms.append(math.sqrt(sum(float((g * g).sum()) for g in grads)))
    return norms


def test_a_trainer_run_is_judged_and_the_truth_is_the_brute_force(tmp_path):
    shadow = ShadowCallback(on_failure="record", report=tmp_path / "shadow.jsonl")
    trainer, seen = train(tmp_path, shadow)
    trainer.train()
    assert trainer.state.global_step == STEPS
    assert shadow_sessions.current() is None  # left at the end of training
    outcomes = shadow.session.outcomes
    norms = [o for o in outcomes if o.what == "norms"]
    steps = [o for o in outcomes if o.what == "step"]
    assert [(o.mode, o.module, o.wrapped, o.outcome, o.verdict) for o in norms] == \
        [("hooks", "Tiny", False, "judged", "pass")] * STEPS
    assert [(o.outcome, o.verdict) for o in steps] == [("judged", "pass")] * STEPS
    assert len(seen["forward"]) == len(seen["labels"]) == STEPS
    for o, (state, ids), labels in zip(norms, seen["forward"], seen["labels"], strict=True):
        truth = brute_force_norms(state, ids, labels)
        assert o.report.true_norms == pytest.approx(truth, rel=1e-6)
        assert o.report.claimed_norms == pytest.approx(truth, rel=1e-4)  # Opacus's float32 norms, honest
    assert len((tmp_path / "shadow.jsonl").read_text().splitlines()) == 2 * STEPS


def test_every_n_judges_one_step_in_n(tmp_path):
    shadow = ShadowCallback(on_failure="record", every=2)
    trainer, _ = train(tmp_path, shadow)
    trainer.train()
    judged = [o for o in shadow.session.outcomes if o.outcome == "judged"]
    # steps 0 and 2 of 3, each with its norms
    assert [(o.what, o.verdict) for o in judged] == [("norms", "pass"), ("step", "pass")] * 2


@pytest.fixture
def linear_sampler_dropping_example_0s_bias(monkeypatch):
    original = GradSampleHooks.GRAD_SAMPLERS[nn.Linear]

    def dropped(layer, activations, backprops):
        out = original(layer, activations, backprops)
        out[layer.bias] = out[layer.bias].clone()
        out[layer.bias][0] = 0
        return out

    monkeypatch.setitem(GradSampleHooks.GRAD_SAMPLERS, nn.Linear, dropped)


def test_a_wrong_linear_sampler_fails_every_step(tmp_path, linear_sampler_dropping_example_0s_bias):
    shadow = ShadowCallback(on_failure="record")
    trainer, seen = train(tmp_path, shadow)
    trainer.train()
    norms = [o for o in shadow.session.outcomes if o.what == "norms"]
    assert len(norms) == STEPS and all(o.failed for o in norms), [o.verdict for o in norms]
    for o, (state, ids), labels in zip(norms, seen["forward"], seen["labels"], strict=True):
        truth = brute_force_norms(state, ids, labels)
        assert o.report.true_norms == pytest.approx(truth, rel=1e-6)
        assert o.report.claimed_norms[0] < truth[0] * (1 - 1e-4)  # example 0 is claimed low


def test_on_failure_raise_stops_the_run(tmp_path, linear_sampler_dropping_example_0s_bias):
    shadow = ShadowCallback(on_failure="raise")
    trainer, _ = train(tmp_path, shadow)
    with pytest.raises(ghost_oracle.ShadowCheckFailed):
        trainer.train()
    assert trainer.state.global_step == 0  # raised at the first step's backward
    shadow.close()
    assert shadow_sessions.current() is None
