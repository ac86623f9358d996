"""Shadow mode for a Hugging Face `Trainer` run: a `TrainerCallback` that enters a shadow session
when training begins and leaves it when training ends, so that every per-example gradient
computation and DP optimizer step Opacus makes inside `trainer.train()` is judged, with no change
to the Trainer or the model.

    from ghost_oracle.shadow.hf import ShadowCallback
    shadow = ShadowCallback(every=100, on_failure="raise", report="shadow.jsonl")
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(dp_optimizer, None),
                      compute_loss_func=loss, callbacks=[shadow])
    trainer.train()
    print("\\n".join(shadow.session.summary.lines()))

Opacus's non-wrapping mode (`make_private(..., wrap_model=False)`) is the one a Trainer can take:
the model stays the Trainer's own module, its hooks compute the per-sample gradients, and the
`DPOptimizer` goes in as the Trainer's optimizer. Two things the Trainer does are not Opacus's
and are the run's to arrange, not this callback's: the loss computed outside the model
(`compute_loss_func`, so that the model's output is per example; a loss the model returns is a
batch mean, which mixes examples, and is refused), and `optimizer.zero_grad()` at each step's
begin (the Trainer calls `model.zero_grad()`, which leaves Opacus's per-sample state in place).

This module imports transformers; `ghost_oracle.shadow` does not import it."""
from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback

from .computation import OnFailure
from .session import DEFAULT_MAX_PARAMS, Shadow


class ShadowCallback(TrainerCallback):
    """Shadow mode for the length of `trainer.train()`; the arguments are `ghost_oracle.shadow`'s.

    `session` is the `Shadow` of the last (or the current) training run: its `outcomes`,
    `failures` and `summary`. With `on_failure="raise"` a step judged wrong raises
    `ShadowCheckFailed` out of `trainer.train()`, and the session is left as the exception leaves
    the run (the callback closes it at the next `on_train_begin`, or call `close()`)."""

    def __init__(self, *, on_failure: OnFailure = "raise", report: str | os.PathLike[str] | None = None,
                 every: int = 1, max_params: int | None = DEFAULT_MAX_PARAMS, max_memory: int | str | None = None,
                 max_grad_norm: float = 1.0) -> None:
        # validated now (a bad argument is an error at construction, not when training starts)
        self._options: dict[str, Any] = dict(on_failure=on_failure, report=report, every=every,
                                             max_params=max_params, max_memory=max_memory,
                                             max_grad_norm=max_grad_norm)
        self.session: Shadow = Shadow(**self._options)
        self._active = False
        self._used = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._leave(failed=True)  # a run before this one that ended by an exception
        if self._used:  # a second train(): a fresh session (the report file is written anew)
            self.session = Shadow(**self._options)
        self._used = True
        self.session.__enter__()
        self._active = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._leave(failed=False)

    def close(self) -> None:
        """Leaves the session if it is still active (a run that ended by an exception): what is
        pending is judged and recorded, never raised, and the report is closed."""
        self._leave(failed=True)

    def _leave(self, *, failed: bool) -> None:
        if self._active:
            self._active = False
            # as a `with` block left by an exception: pending computations are recorded, not raised
            self.session.__exit__(RuntimeError if failed else None, None, None)
