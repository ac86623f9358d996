"""One per-example-gradient computation a library made, as shadow mode captured it, and the
outcome the oracle gave it. Framework-neutral: a capture (one per library and mode) fills a
`Computation`; the judge turns it into an `Outcome`."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from .._failure import ClippingCheckFailed

#: judged: the exporter traced it and the judge gave a verdict; refused: the exporter cannot
#: trace it faithfully (a layer it cannot model, examples that mix), with its reason; skipped:
#: not judged, by a rule stated in the reason (an empty batch, over a budget, every=N).
OutcomeKind = Literal["judged", "refused", "skipped"]


@dataclass
class Computation:
    """What the oracle needs to judge one computation, all of it observed from outside.

    `model` is a copy of the module the library wrapped, taken at forward time (a later optimizer
    step does not change it); `per_example_loss(model, inputs)` is the surrogate whose
    per-example gradients are the ones the library computed; `claimed_norms` are the norms the
    library clips with. `skip_reason` set: the computation is recorded as skipped, not judged."""

    library: str
    mode: str
    module: str
    wrapped: bool
    batch_size: int
    num_params: int
    model: Any = None
    inputs: Any = None
    per_example_loss: Callable[[Any, Any], Any] | None = None
    batch_axis: int = 0
    claimed_norms: Any = None
    max_grad_norm: float = 1.0
    skip_reason: str | None = None
    refuse_reason: str | None = None
    complete: bool = False  # the backward pass the claims come from has finished
    empty: bool = False  # a batch of no examples: skipped, and adds nothing to a step
    #: the module's identity and its trainable parameters' (ids), which tie the computation to
    #: the optimizer step that clips it; `names`: id → the parameter's name in the module
    step_key: int | None = None
    params: frozenset[int] = frozenset()
    names: dict[int, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepClaims:
    """What a DP optimizer's step claims, read from it right after it clipped, noised and divided
    (before the weights move): per parameter (by id) the clipped sum before noise and the
    update; the run's C, σ and γ; and what the divisor it states is made of (the expected batch
    size it was given, the passes it accumulated, its loss reduction). `refuse_reason` set: an optimizer whose
    step is not flat DP-SGD as `assert_update` judges it."""

    library: str
    optimizer: str
    params: frozenset[int]
    clipped_sum: dict[int, Any]
    update: dict[int, Any]
    max_grad_norm: float
    noise_multiplier: float
    clip_stabilizer: float
    expected_batch_size: int | None
    loss_reduction: str
    #: the backward passes the optimizer says it accumulated (Opacus's `accumulated_iterations`,
    #: read before it clipped): the divisor it states is expected_batch_size times this
    accumulated_iterations: int | None = None
    refuse_reason: str | None = None


@dataclass
class Outcome:
    """The record of one computation: one line of the JSONL report."""

    test: str | None
    call: int
    library: str
    mode: str
    module: str
    outcome: OutcomeKind
    wrapped: bool = True
    batch_size: int = 0
    #: "norms": one backward pass's per-example norms; "step": a DP optimizer's step (the
    #: clipped sum, the noise and the divisor, over every micro-batch it accumulated)
    what: str = "norms"
    verdict: str | None = None
    max_rel_err: float | None = None
    message: str | None = None
    explanation: str | None = None
    seconds: float = 0.0
    #: the judge's `Report` (judged only; not written to the JSONL report)
    report: Any = field(default=None, repr=False, compare=False)

    @property
    def failed(self) -> bool:
        """Judged and found wrong (a verdict that fails a gate; cannot-judge is not one)."""
        return self.outcome == "judged" and self.verdict not in ("pass", "cannot-judge")

    def to_json(self) -> dict[str, Any]:
        """The report's line: JSON has no NaN or infinity, so an undefined error is null."""
        err = self.max_rel_err
        return {
            "test": self.test, "call": self.call, "library": self.library, "mode": self.mode,
            "module": self.module, "wrapped": self.wrapped, "batch_size": self.batch_size,
            "what": self.what, "outcome": self.outcome, "verdict": self.verdict,
            "max_rel_err": None if err is None or not math.isfinite(err) else err,
            "message": self.message, "seconds": round(self.seconds, 6),
        }


#: What a session does with a wrong computation: raise `ShadowCheckFailed`, warn, or only record it.
OnFailure = Literal["raise", "warn", "record"]


class ShadowCheckFailed(ClippingCheckFailed):
    """A computation shadow mode judged was wrong. `.outcome` is its record, `.report` the
    judge's `Report`."""

    __module__ = "ghost_oracle"

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.report)
        self.outcome = outcome
        self.args = (describe(outcome) + "\n" + (outcome.explanation or ""),)


def describe(o: Outcome) -> str:
    where = f" in {o.test}" if o.test else ""
    route = "" if o.wrapped else " (wrap_model=False)"
    what = "computation" if o.what == "norms" else "optimizer step, computation"
    return (f"ghost-oracle shadow: {o.library} {o.mode}{route} on {o.module} (B={o.batch_size}), {what} "
            f"{o.call}{where}: {o.outcome}" + (f", verdict {o.verdict}" if o.verdict else "")
            + (f", max relative error {o.max_rel_err:.3g}" if o.max_rel_err is not None else ""))
