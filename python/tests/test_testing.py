"""The pytest plugin's fixtures: tied models whose exact norms are each example's own gradient
norm (held to torch.func's vmapped per-example gradients), and that the oracle passes."""
import pytest
import torch
from conftest import func_norms

from ghost_oracle.torch import assert_norms

FIXTURES = ["tied_gpt2", "tied_llama", "tied_qwen3", "tied_gemma3"]


@pytest.mark.parametrize("name", FIXTURES)
def test_a_fixture_is_a_tied_model_with_its_exact_norms(request, name):
    m = request.getfixturevalue(name)
    head, emb = m.model.get_parameter(m.untie[1]), m.model.get_parameter(m.tied)
    assert head is emb
    # Two orders of the same arithmetic: they agree to the model's own precision (GPT-2 is
    # float32; Gemma's norms multiply by (1 + w) in float32 inside the float64 model).
    rtol = {"tied_gpt2": 1e-5, "tied_gemma3": 1e-7}.get(name, 1e-12)
    torch.testing.assert_close(m.exact, func_norms(m.model, m.loss, m.ids).double(), rtol=rtol, atol=0)
    assert m.c == pytest.approx(0.8 * float(m.exact.median()))
    report = assert_norms(m.model, m.loss, m.ids, claimed_norms=m.exact, max_grad_norm=m.c)
    assert m.tied in report.tied_parameters
