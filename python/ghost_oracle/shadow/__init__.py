"""Shadow mode: while active, every per-example-gradient computation a supported library makes is
captured from outside (no change to the code that runs it) and judged by the oracle.

    import ghost_oracle
    with ghost_oracle.shadow(on_failure="raise", report="shadow.jsonl"):
        ...                      # an Opacus test, or a training loop: unchanged

Opacus 1.6: every `GradSampleModule` kind (hooks, functorch, ew, ghost, ghost_fsdp on one
process) and the non-wrapping `GradSampleHooks` route (`wrap_model=False`). At the forward of
the module the library wraps, a copy of it (its parameters' values then), its inputs and a hook
on its output are taken; when the backward pass ends, the norms the library clips with are read
(`p.grad_sample` norms as `DPOptimizer` computes them, or the ghost norms of `_norm_sample`);
after `backward()` returns, the exporter traces the copy with the surrogate loss
s·⟨out_i, stopgrad(∂L/∂out_i)⟩ (`surrogate`) and the f64 judge gives the verdict (`judge`).
What the exporter refuses (a layer it cannot model, examples that mix) is recorded as refused
with its reason, an empty batch or a computation over `max_params`/`max_memory` as skipped.
`DPOptimizer.step()` and the ghost-clipping optimizer's are judged too: the clipped sum, the
noise and the divisor, over every micro-batch since the last `zero_grad()`, as `assert_update`
judges them (`capture_opacus_optimizer`, `judge.judge_step`).
See docs/shadow.md. This package imports no framework until a session is entered."""
from __future__ import annotations

import os

from .computation import Computation, OnFailure, Outcome, ShadowCheckFailed
from .report import JsonlReport
from .session import DEFAULT_MAX_PARAMS, Shadow
from .summary import Summary

__all__ = ["DEFAULT_MAX_PARAMS", "Computation", "JsonlReport", "OnFailure", "Outcome", "Shadow",
           "ShadowCheckFailed", "Summary", "shadow"]


def shadow(*, on_failure: OnFailure = "raise", report: str | os.PathLike[str] | None = None, every: int = 1,
           max_params: int | None = DEFAULT_MAX_PARAMS, max_memory: int | str | None = None,
           max_grad_norm: float = 1.0) -> Shadow:
    """A context manager under which the per-example gradient norms a DP library computes are
    judged by the oracle.

    Args:
        on_failure: "raise": the `backward()` after which a wrong computation was judged raises
            `ShadowCheckFailed` (an AssertionError carrying the report); "warn": a warning;
            "record": nothing (read `session.outcomes` / `session.failures`).
        report: a path: one JSON line per computation seen (test, call, library, mode, module,
            outcome, verdict, max_rel_err, message, ...), each flushed as it is decided.
        every: judge one in `every` (the others are recorded as skipped): computations until a
            DP optimizer's step has been seen, then steps, each with all its computations.
        max_params: a computation on a module with more trainable parameters is skipped with
            the reason (default 20 M; None: no limit).
        max_memory: the most memory a computation's capture and check may take ("8G", "512M"
            or bytes); above it the computation is skipped with the reason.
        max_grad_norm: the C the verdict's privacy figures assume where the library's module
            does not carry one (ghost clipping's does).

    Returns:
        the `Shadow` session (`outcomes`, `failures`, `summary`, `flush()`).
    """
    return Shadow(on_failure=on_failure, report=report, every=every, max_params=max_params, max_memory=max_memory,
                  max_grad_norm=max_grad_norm)
