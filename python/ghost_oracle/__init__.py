"""ghost-oracle: ground truth for DP-SGD per-example gradient clipping, for pytest.

    import ghost_oracle
    report = ghost_oracle.check("trace.safetensors")     # a trace with a clipper's claimed norms
    assert report.passed, report.explain()

    from ghost_oracle.torch import assert_norms           # export + check + raise, in one call
    assert_norms(model, per_example_loss, batch, claimed_norms=my_norms, max_grad_norm=1.0)

    from ghost_oracle.torch import assert_update          # the step: clipped sum, noise, update
    assert_update(model, per_example_loss, batch, update, clipped_sum=summed, max_grad_norm=1.0,
                  noise_multiplier=1.0, batch_divisor=len(batch), clip_stabilizer=1e-6)

    import ghost_oracle.opacus                            # claimed norms straight from Opacus
    norms = ghost_oracle.opacus.norms(gsm, per_example_loss, batch)

    with ghost_oracle.shadow(report="shadow.jsonl"):       # judge every Opacus computation, unedited
        train_or_test()                                   # (also: pytest --ghost-oracle)

    from ghost_oracle.jax import assert_norms             # the same for a Flax linen model
    assert_norms(model, params, per_example_loss, ids, claimed_norms=my_norms, max_grad_norm=1.0)

    import ghost_oracle.jax_privacy                       # jax_privacy's clipped step, judged
    ghost_oracle.jax_privacy.assert_update(model, params, per_example_loss, batch, l2_clip_norm=1.0,
                                           noise_multiplier=1.0)

`check`, `audit` and `mutants` return a `Report`; bad input raises `ValueError` (or
`FileNotFoundError`) with the message the `ghost-oracle` CLI prints.

The submodules: `torch` and `jax` are the two front-ends of one trace exporter (PyTorch, and
Flax linen), each capturing a model's per-parameter factors and handing them to `_trace`, the
framework-neutral core (numpy only) that self-checks them against the framework's own gradient
and writes the trace; `opacus` and `jax_privacy` read claims straight from those libraries;
`shadow` judges every Opacus computation of a run without editing it; `tied` is exact ghost
clipping for tied parameters as an Opacus plug-in, code under test that imports nothing of the
rest. `torch`, `opacus`, `shadow`'s captures and `tied` need PyTorch (and Opacus), `jax` and
`jax_privacy` need JAX and Flax (and jax_privacy); the package itself needs only NumPy.
"""
from __future__ import annotations

import importlib
from typing import Any

from ._api import BUILTIN_CLIPPERS, MUTANTS, audit, check, mutants
from ._failure import ClippingCheckFailed
from ._native import __version__
from ._report import (
    VERDICTS,
    CaseResult,
    ClipperResult,
    NoiseCheck,
    NoisyUpdateCheck,
    Privacy,
    Report,
    StepResult,
    SumCheck,
)
from .shadow import ShadowCheckFailed, shadow

__all__ = [
    "BUILTIN_CLIPPERS",
    "MUTANTS",
    "VERDICTS",
    "CaseResult",
    "ClipperResult",
    "ClippingCheckFailed",
    "NoiseCheck",
    "NoisyUpdateCheck",
    "Privacy",
    "Report",
    "StepResult",
    "SumCheck",
    "ShadowCheckFailed",
    "__version__",
    "audit",
    "check",
    "mutants",
    "shadow",
]


def __getattr__(name: str) -> Any:
    # the front-ends and adapters import their frameworks (PyTorch / Opacus, JAX / Flax): only on
    # first use.
    if name in ("torch", "opacus", "jax", "jax_privacy"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
