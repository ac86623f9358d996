"""ghost-oracle's pytest plugin (the `pytest11` entry point `ghost_oracle`): session fixtures
with a tiny tied model, its batch, its per-example loss and its exact per-example norms
(`ghost_oracle.testing.TiedCase`). It imports torch and transformers only when a test asks for
a fixture, so that installing the package costs a test run that uses none of them nothing."""
from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from ghost_oracle.testing import TiedCase


@pytest.fixture(scope="session")
def tied_gpt2() -> TiedCase:
    """GPT-2 (float32, training mode), its lm_head tied to `transformer.wte.weight`."""
    from ghost_oracle import testing as t

    return t.tied_case(t.gpt2(), t.gpt2_ids(), t.gpt2_loss, "transformer.wte.weight")


@pytest.fixture(scope="session")
def tied_llama() -> TiedCase:
    """Llama (float64, grouped-query attention), its lm_head tied to `model.embed_tokens.weight`."""
    from ghost_oracle import testing as t

    return t.tied_case(t.llama(), t.llama_ids(), t.llama_loss, "model.embed_tokens.weight")


@pytest.fixture(scope="session")
def tied_qwen3() -> TiedCase:
    """Qwen3 (float64, per-head q/k norms), its lm_head tied to `model.embed_tokens.weight`."""
    from ghost_oracle import testing as t

    return t.tied_case(t.qwen3(), t.lm_ids(), t.lm_loss, "model.embed_tokens.weight")


@pytest.fixture(scope="session")
def tied_gemma3() -> TiedCase:
    """Gemma 3 (float64, scaled embedding, (1 + w) norms, sliding and full attention), its lm_head
    tied to `model.embed_tokens.weight`."""
    from ghost_oracle import testing as t

    return t.tied_case(t.gemma3(), t.lm_ids(), t.lm_loss, "model.embed_tokens.weight")
