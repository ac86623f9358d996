"""Gate Opacus's per-example gradient norms in pytest with ghost-oracle.

A tiny GPT-2 whose LM head is tied to its input embedding (as in every GPT-2 checkpoint). DP-SGD
clips each example's gradient to norm C; if the norm a clipper computes is too small, the
example's clipped contribution exceeds C and the run's (ε, δ) no longer holds. `assert_norms`
checks the norms a clipper claims against ghost-oracle's f64 ground truth and raises a readable
AssertionError (`ghost_oracle.ClippingCheckFailed`, with the whole report) when they are wrong.
`assert_update` does the same for the step the library takes: its clipped sum before noise, its
noise and its update, against the exact Σ_i c*_i g*_i.

    pip install ./python torch transformers opacus   # ./python: ghost-oracle's package, and its
    pytest examples/test_opacus_clipper.py -s        # pytest plugin (the tied_gpt2 fixture)
"""
import copy

import pytest
import torch
from opacus import GradSampleModule
from opacus.grad_sample import GradSampleModuleFastGradientClipping

import ghost_oracle.opacus
import ghost_oracle.testing
from ghost_oracle.torch import assert_norms, assert_update

MAX_GRAD_NORM = 2.5  # C: below most examples' norms, so that they are clipped
NOISE_MULTIPLIER = 1.0


# `tied_gpt2` is a fixture of ghost-oracle's pytest plugin (ghost_oracle.testing): a tiny
# GPT-2 whose lm_head is its input embedding, a batch of 4 × 12 ids, and each example's own
# loss (mean next-token cross entropy, with explicit B×T position_ids: with the default 1×T
# ones Opacus sums the position embedding's per-sample gradients over the batch).
@pytest.fixture(scope="module")
def model(tied_gpt2):
    return tied_gpt2.model


@pytest.fixture(scope="module")
def ids(tied_gpt2):
    return tied_gpt2.ids


def per_example_loss(model, ids):
    return ghost_oracle.testing.gpt2_loss(model, ids)


def test_opacus_per_sample_norms_are_exact(model, ids):
    """GradSampleModule sums the per-sample gradients of both uses of the tied embedding."""
    gsm = GradSampleModule(copy.deepcopy(model), loss_reduction="sum")
    norms = ghost_oracle.opacus.norms(gsm, per_example_loss, ids)
    report = assert_norms(model, per_example_loss, ids, claimed_norms=norms, max_grad_norm=MAX_GRAD_NORM,
                          noise_multiplier=NOISE_MULTIPLIER, clipper="opacus-grad-sample")
    print(report)


def test_opacus_ghost_clipping_on_an_untied_copy_breaks_privacy(model, ids):
    """Ghost clipping refuses a tied model; the usual workaround runs it on a copy whose head is a
    separate parameter. The function is the same, but the norm loses the cross term between the
    embedding and head gradients of the one real parameter: ghost-oracle catches it."""
    untied = copy.deepcopy(model)
    untied.lm_head.weight = torch.nn.Parameter(untied.transformer.wte.weight.detach().clone())
    gsm = GradSampleModuleFastGradientClipping(untied, max_grad_norm=MAX_GRAD_NORM, use_ghost_clipping=True,
                                               loss_reduction="sum")
    norms = ghost_oracle.opacus.norms(gsm, per_example_loss, ids)

    with pytest.raises(ghost_oracle.ClippingCheckFailed) as failure:
        assert_norms(model, per_example_loss, ids, claimed_norms=norms, max_grad_norm=MAX_GRAD_NORM,
                     noise_multiplier=NOISE_MULTIPLIER, clipper="opacus-ghost-untied")
    print(failure.value)  # what a failing gate shows in the pytest log
    report = failure.value.report
    assert report.verdict == "privacy-violation"
    assert report.max_sensitivity_ratio > 1.0  # a clipped contribution above C
    assert "transformer.wte.weight" in report.tied_parameters


@pytest.mark.parametrize("noise_multiplier", [0.0, NOISE_MULTIPLIER])
def test_opacus_step_is_the_exact_clipped_sum_plus_the_stated_noise(model, ids, noise_multiplier):
    """A real Opacus step (hooks mode) up to the update: at σ = 0 the update times its divisor is
    the exact clipped sum; at σ = 1 the clipped sum is exact and u·D − K is N(0, σ²C²) on every
    tensor, the tied embedding included (noised once, not once per use)."""
    step = ghost_oracle.opacus.dp_step(model, per_example_loss, ids, max_grad_norm=MAX_GRAD_NORM,
                                       noise_multiplier=noise_multiplier, seed=13)
    report = assert_update(model, per_example_loss, step.inputs, step.update, clipped_sum=step.clipped_sum,
                           max_grad_norm=MAX_GRAD_NORM, noise_multiplier=noise_multiplier,
                           batch_divisor=step.batch_divisor, clip_stabilizer=step.clip_stabilizer,
                           claimed_norms=step.norms, clipper="opacus-step")
    assert report.step.clipped_sum.passed
