"""The Opacus adapters on Opacus 1.6: per-sample norms of a tied GPT-2 pass, ghost clipping of
the untied workaround is flagged."""
import copy
import re

import pytest
import torch
from conftest import REPO, causal_lm_loss, gpt2_ids, untied_copy

import ghost_oracle.opacus
from ghost_oracle.torch import assert_norms

opacus = pytest.importorskip("opacus")
from opacus import GradSampleModule  # noqa: E402
from opacus.grad_sample import GradSampleModuleFastGradientClipping  # noqa: E402


def test_opacus_is_1_6():
    assert opacus.__version__.startswith("1.6")


def test_grad_sample_of_a_tied_parameter_sums_both_uses(tied_gpt2):
    m = tied_gpt2
    gsm = GradSampleModule(copy.deepcopy(m.model), loss_reduction="sum")
    m.loss(gsm, m.ids).sum().backward()
    wte = gsm._module.transformer.wte.weight
    assert gsm._module.lm_head.weight is wte
    assert torch.is_tensor(wte.grad_sample) and wte.grad_sample.shape == (4, *wte.shape)  # one tensor, summed
    norms = ghost_oracle.opacus.norms(gsm)  # reads the backward pass above
    torch.testing.assert_close(norms, m.exact.double(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_grad_sample_module_norms_pass_on_a_tied_gpt2(tied_gpt2, reduction):
    m = tied_gpt2
    gsm = GradSampleModule(copy.deepcopy(m.model), loss_reduction=reduction)
    norms = ghost_oracle.opacus.norms(gsm, m.loss, m.ids)
    assert norms.dtype == torch.float64 and norms.shape == (4,)
    assert all(getattr(p, "grad_sample", None) is None and p.grad is None for p in gsm.parameters())  # cleared
    report = assert_norms(m.model, m.loss, m.ids, claimed_norms=norms, max_grad_norm=m.c,
                          clipper="opacus-grad-sample")
    assert report.passed


def test_grad_sample_module_wrapping_the_audited_model_itself(tied_gpt2):
    m = tied_gpt2
    model = copy.deepcopy(m.model)
    gsm = GradSampleModule(model, loss_reduction="sum")  # hooks on `model`'s own modules
    report = assert_norms(model, m.loss, m.ids, claimed_norms=ghost_oracle.opacus.norms(gsm, m.loss, m.ids),
                          max_grad_norm=m.c)
    assert report.passed


def test_ghost_clipping_refuses_the_tied_model(tied_gpt2):
    m = tied_gpt2
    gsm = GradSampleModuleFastGradientClipping(copy.deepcopy(m.model), max_grad_norm=1.0, use_ghost_clipping=True,
                                               loss_reduction="sum")
    with pytest.raises(NotImplementedError, match="Parameter tying is not supported with Ghost Clipping"):
        ghost_oracle.opacus.norms(gsm, m.loss, m.ids)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_ghost_clipping_of_the_untied_workaround_is_flagged(tied_gpt2, reduction):
    m = tied_gpt2
    untied = untied_copy(m.model, *m.untie)
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    gsm = GradSampleModuleFastGradientClipping(untied, max_grad_norm=1.0, use_ghost_clipping=True,
                                               loss_reduction=reduction)
    norms = ghost_oracle.opacus.norms(gsm, m.loss, m.ids)
    with pytest.raises(AssertionError) as e:
        assert_norms(m.model, m.loss, m.ids, claimed_norms=norms, max_grad_norm=m.c, clipper="opacus-ghost-untied")
    msg = str(e.value)
    assert msg.startswith("ghost-oracle: clipper `opacus-ghost-untied`: privacy-violation")
    assert "tied parameter: `transformer.wte.weight`" in msg
    assert "the claim is the truth without the cross term" in msg


def test_norms_helper_errors(tied_gpt2):
    m = tied_gpt2
    with pytest.raises(TypeError, match="expected an Opacus GradSampleModule"):
        ghost_oracle.opacus.norms(m.model)
    gsm = GradSampleModule(copy.deepcopy(m.model), loss_reduction="sum")
    with pytest.raises(ValueError, match="no parameter has a grad_sample"):
        ghost_oracle.opacus.norms(gsm)
    with pytest.raises(ValueError, match="pass both per_example_loss and inputs"):
        ghost_oracle.opacus.norms(gsm, m.loss)
    with pytest.raises(ValueError, match=r"per_example_loss returned \(\)"):
        ghost_oracle.opacus.norms(gsm, lambda g, x: m.loss(g, x).sum(), m.ids)
    ghost = GradSampleModuleFastGradientClipping(untied_copy(m.model, *m.untie), max_grad_norm=1.0,
                                                 use_ghost_clipping=True, loss_reduction="sum")
    with pytest.raises(ValueError, match="no per-sample norms recorded"):
        ghost_oracle.opacus.norms(ghost)


def test_accumulated_batches_are_refused(tied_gpt2):
    m = tied_gpt2
    gsm = GradSampleModule(copy.deepcopy(m.model), loss_reduction="sum")
    for _ in range(2):
        m.loss(gsm, m.ids).sum().backward()
    with pytest.raises(ValueError, match="grad_sample holds 2 accumulated batches"):
        ghost_oracle.opacus.norms(gsm)


def test_default_position_ids_are_caught(tied_gpt2):
    """With Hugging Face's default 1×T position ids Opacus sums wpe's grad_sample over the batch."""
    m = tied_gpt2
    gsm = GradSampleModule(copy.deepcopy(m.model), loss_reduction="sum")

    def loss_with_default_positions(model, ids):
        return causal_lm_loss(model(ids).logits, ids)

    with pytest.raises(ValueError, match=r"batch size 1 .*pass explicit B×T position_ids"):
        ghost_oracle.opacus.norms(gsm, loss_with_default_positions, gpt2_ids())


def _documented_failure():
    """The ClippingCheckFailed message pasted in docs/python.md, as pytest printed it."""
    text = (REPO / "docs" / "python.md").read_text()
    block = text.split("## What a failure says", 1)[1].split("```", 2)[1]
    lines = [line[8:] for line in block.splitlines() if line.startswith("E ")]
    lines[0] = lines[0].removeprefix("ghost_oracle.ClippingCheckFailed: ")
    return "\n".join(lines)


def test_the_documented_failure_output_is_what_the_example_prints(tied_gpt2):
    """docs/python.md shows the example's failure (C = 2.5): same lines, numbers aside."""
    m = tied_gpt2
    gsm = GradSampleModuleFastGradientClipping(untied_copy(m.model, *m.untie), max_grad_norm=2.5,
                                               use_ghost_clipping=True, loss_reduction="sum")
    with pytest.raises(AssertionError) as e:
        assert_norms(m.model, m.loss, m.ids, claimed_norms=ghost_oracle.opacus.norms(gsm, m.loss, m.ids),
                     max_grad_norm=2.5, clipper="opacus-ghost-untied")
    number = re.compile(r"[-+]?\d+(\.\d+)?(e[-+]?\d+)?")
    documented, actual = _documented_failure(), str(e.value)
    assert [number.sub("#", x) for x in documented.splitlines()] == [number.sub("#", x) for x in actual.splitlines()]
    for figure in ("clipped contribution is 1.0050·C at C = 2.5", "σ_eff = 0.9950", "ε: stated 2.10, actual 2.13"):
        assert figure in documented and figure in actual
