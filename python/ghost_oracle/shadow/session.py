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
from types import TracebackType
from typing import Literal

from .._failure import ClippingCheckFailed
from .computation import Computation, Outcome
from .report import JsonlReport
from .summary import Summary

OnFailure = Literal["raise", "warn", "record"]

#: library name → (module whose `install() -> uninstall` hooks that library, the package that
#: must be importable for it to apply).
CAPTURES: dict[str, tuple[str, str]] = {
    "opacus": ("ghost_oracle.shadow.capture_opacus", "opacus"),
}

DEFAULT_MAX_PARAMS = 20_000_000


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
    return (f"ghost-oracle shadow: {o.library} {o.mode}{route} on {o.module} (B={o.batch_size}), computation "
            f"{o.call}{where}: {o.outcome}" + (f", verdict {o.verdict}" if o.verdict else "")
            + (f", max relative error {o.max_rel_err:.3g}" if o.max_rel_err is not None else ""))


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
        self._seen = 0  # computations seen (the `every` counter)
        self._call = 0  # index within the current test
        self._pending: list[tuple[Computation, Outcome]] = []
        self._owns_report = not isinstance(report, JsonlReport)
        self._report = (report if isinstance(report, JsonlReport)
                        else None if report is None else JsonlReport(report))

    # -- what captures call -------------------------------------------------------------------
    def start(self, library: str, mode: str, module: str, wrapped: bool, batch_size: int) -> tuple[Outcome, bool]:
        """A new computation: its record, and whether it is to be judged (every=N)."""
        o = Outcome(test=self.test, call=self._call, library=library, mode=mode, module=module, outcome="skipped",
                    wrapped=wrapped, batch_size=batch_size)
        self._call += 1
        take = self._seen % self.every == 0
        self._seen += 1
        return o, take

    def add(self, c: Computation, o: Outcome) -> None:
        """Queues a captured computation; it is judged once its backward pass has finished."""
        self._pending.append((c, o))

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
                c.model = c.inputs = c.per_example_loss = None  # the copies go as soon as they are judged
            o.seconds += time.perf_counter() - t0
            self._record(o)
            if o.failed and failed is None:
                failed = o
        if failed is not None:
            if self.on_failure == "raise":
                raise ShadowCheckFailed(failed)
            if self.on_failure == "warn":
                warnings.warn(describe(failed) + "\n" + (failed.explanation or ""), stacklevel=2)

    def _record(self, o: Outcome) -> None:
        self.seconds += o.seconds
        self.outcomes.append(o)
        self.summary.add(o)
        if self._report is not None:
            self._report.write(o)

    def set_test(self, test: str | None) -> None:
        """Starts a new test: its computations are numbered from 0 and carry its id."""
        self.flush()
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
