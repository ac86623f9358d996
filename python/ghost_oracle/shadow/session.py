"""A shadow-mode session: the computations captured while it is the innermost active one, their
judging, the report and the tally. Imports no framework: a capture is installed per library
(`CAPTURES`, keyed by library name) when the first session is entered and removed when the last
one exits."""
from __future__ import annotations

import importlib
import importlib.util
import os
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

from .computation import Computation, OnFailure, Outcome, ShadowCheckFailed, StepClaims, describe
from .report import JsonlReport
from .summary import Summary

#: library name → (module whose `install() -> uninstall` hooks that library, the package that
#: must be importable for it to apply).
CAPTURES: dict[str, tuple[str, str]] = {
    "opacus": ("ghost_oracle.shadow.capture_opacus", "opacus"),
}

DEFAULT_MAX_PARAMS = 20_000_000

#: the most computations one step window holds (their copies are kept until the step): a module
#: run more often than this without a DP optimizer's step is not stepping, and its window goes.
MAX_WINDOW = 64


@dataclass
class StepWindow:
    """The computations a DP optimizer's next step is to be judged over, on one module (`key`,
    trainable parameters `params`): `clipped`, those already clipped into its sum by skipped
    steps (`signal_skip_step`); `open`, those since the last `zero_grad()` (what the next
    clipping will take: several `backward()` calls accumulate). `take`: the step is to be judged
    (every=N); `lost`: why it cannot be (a computation of it not captured)."""

    key: int
    params: frozenset[int]
    take: bool
    clipped: list[Computation] = field(default_factory=list)
    open: list[Computation] = field(default_factory=list)
    lost: str | None = None

    @property
    def computations(self) -> list[Computation]:
        return self.clipped + self.open


_lock = threading.RLock()
_stack: list[Shadow] = []
_uninstall: list[Callable[[], None]] = []
_judging = threading.local()


def current() -> Shadow | None:
    """The innermost active session, or None (also while a judge is running: the judge's own
    forward and backward passes are not computations of the library)."""
    if getattr(_judging, "active", False):
        return None
    return _stack[-1] if _stack else None


class Shadow:
    """`with ghost_oracle.shadow(...) as session:` — see `ghost_oracle.shadow.shadow`."""

    def __init__(self, *, on_failure: OnFailure = "raise", report: str | os.PathLike[str] | JsonlReport | None = None,
                 every: int = 1, max_params: int | None = DEFAULT_MAX_PARAMS, max_memory: int | str | None = None,
                 max_grad_norm: float = 1.0, test: str | None = None) -> None:
        if on_failure not in ("raise", "warn", "record"):
            raise ValueError(f"on_failure must be 'raise', 'warn' or 'record', got {on_failure!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive integer (judge one computation in every), got {every!r}")
        if max_params is not None and (isinstance(max_params, bool) or not isinstance(max_params, int)
                                       or max_params < 1):
            raise ValueError(f"max_params must be a positive integer or None, got {max_params!r}")
        if max_memory is not None:
            from .._api import _max_memory
            _max_memory(max_memory)  # the check's own validation: bytes, or a size such as "8G"
        self.max_memory_bytes = None if max_memory is None else _parse_size(max_memory)
        self.on_failure: OnFailure = on_failure
        self.every = every
        self.max_params = max_params
        self.max_memory = max_memory
        self.max_grad_norm = float(max_grad_norm)
        self.test = test
        self.outcomes: list[Outcome] = []
        self.summary = Summary()
        self.seconds = 0.0  # time spent capturing and judging
        self._units = 0  # the `every` counter: computations, or steps once a step has been seen
        self._stepped = False  # a DP optimizer's step has been seen: `every` counts steps
        self._call = 0  # index within the current test
        self._pending: list[tuple[Computation, Outcome]] = []
        self._window: StepWindow | None = None
        self._owns_report = not isinstance(report, JsonlReport)
        self._report = (report if isinstance(report, JsonlReport)
                        else None if report is None else JsonlReport(report))

    # -- what captures call -------------------------------------------------------------------
    def start(self, library: str, mode: str, module: str, wrapped: bool, batch_size: int,
              key: int | None = None, params: frozenset[int] = frozenset()) -> tuple[Outcome, bool]:
        """A new computation on the module `key` (trainable parameters `params`): its record, and
        whether it is to be judged. every=N counts computations until a DP optimizer's step has
        been seen, then steps: every computation of a step window is taken or left together."""
        o = Outcome(test=self.test, call=self._call, library=library, mode=mode, module=module, outcome="skipped",
                    wrapped=wrapped, batch_size=batch_size)
        self._call += 1
        w = self._window
        if w is not None and (w.key != key or len(w.computations) >= MAX_WINDOW):
            self._drop_window()  # another module, or one that runs without stepping
            w = None
        if w is not None and self._stepped:
            return o, w.take
        take = self._units % self.every == 0
        self._units += 1
        if key is not None:
            if w is None:
                self._window = StepWindow(key=key, params=params, take=take)
            elif not take:
                w.take = False
        return o, take

    def add(self, c: Computation, o: Outcome) -> None:
        """Queues a captured computation; it is judged once its backward pass has finished."""
        self._pending.append((c, o))
        w = self._window
        if w is not None and c.step_key == w.key:
            w.open.append(c)
            if w.lost is None and (c.skip_reason is not None or c.refuse_reason is not None) \
                    and not c.empty:
                w.lost = f"computation {o.call} of it was not judged: {c.skip_reason or c.refuse_reason}"

    def _drop_window(self) -> None:
        w, self._window = self._window, None
        if w is not None:
            for c in w.computations:
                if c.complete:
                    c.model = c.inputs = c.per_example_loss = None

    # -- a DP optimizer's step ----------------------------------------------------------------
    def on_zero_grad(self, params: frozenset[int], keep_clipped: bool) -> None:
        """The user's `optimizer.zero_grad()`: what the next step clips starts anew; the sum of
        skipped steps is kept (`keep_clipped`, as Opacus keeps `summed_grad` after one)."""
        w = self._window
        if w is None or not (w.params & params):
            return
        self.flush()
        released, w.open = w.open, []
        if not keep_clipped:
            released += w.clipped
            w.clipped = []
        for c in released:
            c.model = c.inputs = c.per_example_loss = None
        if not w.computations:
            self._window = None

    def on_skipped_step(self, params: frozenset[int]) -> None:
        """A skipped step (`signal_skip_step`): the open computations are clipped into the sum."""
        self.flush()
        w = self._window
        if w is not None and w.params & params:
            w.clipped += w.open
            w.open = []

    def on_step(self, claims: StepClaims) -> None:
        """A DP optimizer took a step: judged over the window's computations, with the divisor
        the optimizer states (its expected batch size times the passes it says it accumulated,
        1 for a summed loss); where it counts other passes than the backward passes seen since
        the last `zero_grad()`, the outcome's message notes it.
        Raises `ShadowCheckFailed` with on_failure="raise" if the step is wrong."""
        from .judge import judge_step
        self.flush()  # the step's own computations first
        w, self._window = self._window, None
        first = not self._stepped
        self._stepped = True
        if first:
            self._units = 1  # the step just taken was unit 0
        seen = w.computations[0] if w is not None and w.computations else None
        o = Outcome(test=self.test, call=self._call, library=claims.library,
                    mode=seen.mode if seen is not None else claims.optimizer,
                    module=seen.module if seen is not None else claims.optimizer, outcome="skipped", what="step",
                    wrapped=seen.wrapped if seen is not None else True)
        self._call += 1
        t0 = time.perf_counter()
        if w is None or not (w.params & claims.params):
            o.message = (f"{claims.optimizer}.step(): no per-example gradient computation of its parameters was "
                         "captured since its last step")
        elif not w.take:
            o.message = f"every={self.every}: not this step"
        elif w.lost is not None:
            o.message = f"{claims.optimizer}.step(): {w.lost}"
        else:
            parts = w.computations
            o.batch_size = sum(c.batch_size for c in parts)
            accumulated = claims.accumulated_iterations
            divisor = 1.0
            if claims.loss_reduction == "mean":
                divisor = float((claims.expected_batch_size or 0) * (accumulated or 0))
            _judging.active = True
            try:
                if divisor <= 0:
                    o.outcome = "refused"
                    o.message = (f"{claims.optimizer}: no divisor stated (expected_batch_size="
                                 f"{claims.expected_batch_size}, accumulated_iterations={accumulated})")
                else:
                    judge_step(parts, claims, divisor, o, max_memory=self.max_memory)
            finally:
                _judging.active = False
            if o.outcome == "judged" and accumulated != len(w.open):
                # Opacus's two optimizers count differently (hooks: the grad samples accumulated;
                # ghost clipping: always 1): the stated divisor is judged, the difference noted
                note = (f"note: {claims.optimizer} states {accumulated} accumulated pass(es) (its divisor "
                        f"{divisor:g}); {len(w.open)} backward pass(es) ran since the last zero_grad()")
                o.message = note if o.message is None else o.message + "\n" + note
        if w is not None:
            for c in w.computations:
                c.model = c.inputs = c.per_example_loss = None
        o.seconds += time.perf_counter() - t0
        self._record(o)
        if o.failed:
            if self.on_failure == "raise":
                raise ShadowCheckFailed(o)
            if self.on_failure == "warn":
                warnings.warn(describe(o) + "\n" + (o.explanation or ""), stacklevel=3)

    def flush(self) -> None:
        """Judges every computation whose backward pass has finished (captures call it after each
        top-level backward; exiting the session calls it too). Raises `ShadowCheckFailed` with
        on_failure="raise" for the first wrong one."""
        from .judge import judge
        ready = [(c, o) for c, o in self._pending if c.complete]
        self._pending = [(c, o) for c, o in self._pending if not c.complete]
        failed: Outcome | None = None
        for c, o in ready:
            t0 = time.perf_counter()
            _judging.active = True
            try:
                judge(c, o, max_memory=self.max_memory)
            finally:
                _judging.active = False
                if not self._in_window(c):  # the copies go as soon as they are judged
                    c.model = c.inputs = c.per_example_loss = None
            o.seconds += time.perf_counter() - t0
            self._record(o)
            if o.failed and failed is None:
                failed = o
        if failed is not None:
            if self.on_failure == "raise":
                raise ShadowCheckFailed(failed)
            if self.on_failure == "warn":
                warnings.warn(describe(failed) + "\n" + (failed.explanation or ""), stacklevel=2)

    def _in_window(self, c: Computation) -> bool:
        w = self._window
        return w is not None and any(x is c for x in w.computations)

    def _record(self, o: Outcome) -> None:
        self.seconds += o.seconds
        self.outcomes.append(o)
        self.summary.add(o)
        if self._report is not None:
            self._report.write(o)

    def set_test(self, test: str | None) -> None:
        """Starts a new test: its computations are numbered from 0 and carry its id."""
        self.flush()
        self._drop_window()
        self.test = test
        self._call = 0

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.failed]

    # -- the context ------------------------------------------------------------------------
    def __enter__(self) -> Shadow:
        with _lock:
            if not _stack:
                for module, package in CAPTURES.values():
                    if importlib.util.find_spec(package) is not None:
                        _uninstall.append(importlib.import_module(module).install())
            _stack.append(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if exc_type is None:
                self.flush()
            else:  # the run failed: what finished is still judged, but its failure does not hide the error
                on_failure, self.on_failure = self.on_failure, "record"
                try:
                    self.flush()
                finally:
                    self.on_failure = on_failure
        finally:
            with _lock:
                if self in _stack:
                    _stack.remove(self)
                if not _stack:
                    while _uninstall:
                        _uninstall.pop()()
            self._pending.clear()
            self._drop_window()
            if self._report is not None and self._owns_report:
                self._report.close()


def _parse_size(value: int | str) -> int:
    if isinstance(value, int):
        return value
    s = value.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if s and s[-1] in units:
        return int(float(s[:-1]) * units[s[-1]])
    return int(float(s))
