"""The tally of a shadowed run: judged, passed, failed, cannot-judge, refused and skipped by
reason, and the time shadow mode added; printed as pytest's terminal summary."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from .computation import Outcome


def _reason_key(message: str | None) -> str:
    """A refusal or skip reason with its numbers and names collapsed, so that reasons of one
    kind count together (`module \\`a.b\\` (Linear)` and `... (Conv2d)` stay apart by class)."""
    text = (message or "").splitlines()[0] if message else ""
    text = re.sub(r"`[^`]*`", "`…`", text)
    text = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", text)
    return text[:120]


@dataclass
class Summary:
    """Counts over outcomes; `add` one at a time."""

    seen: int = 0
    judged: int = 0
    passed: int = 0
    failed: int = 0
    cannot_judge: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    by_mode: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    def add(self, o: Outcome) -> None:
        self.seen += 1
        self.seconds += o.seconds
        if o.outcome == "judged":
            self.judged += 1
            self.by_mode[o.mode if o.what == "norms" else f"{o.mode} step"] += 1
            if o.verdict == "pass":
                self.passed += 1
            elif o.verdict == "cannot-judge":
                self.cannot_judge += 1
            else:
                self.failed += 1
        elif o.outcome == "refused":
            self.refused[_reason_key(o.message)] += 1
        else:
            self.skipped[_reason_key(o.message)] += 1

    def lines(self, overhead_seconds: float | None = None) -> list[str]:
        """The summary as printed."""
        n_ref, n_skip = sum(self.refused.values()), sum(self.skipped.values())
        pct = f" ({100.0 * self.judged / self.seen:.1f} %)" if self.seen else ""
        modes = ", ".join(f"{m} {k}" for m, k in sorted(self.by_mode.items()))
        out = [f"computations seen: {self.seen}; judged: {self.judged}{pct}" + (f" [{modes}]" if modes else ""),
               f"passed: {self.passed}; failed: {self.failed}; cannot-judge: {self.cannot_judge}",
               f"refused: {n_ref}"]
        out += [f"  {k:5d}  {r}" for r, k in self.refused.most_common()]
        out.append(f"skipped: {n_skip}")
        out += [f"  {k:5d}  {r}" for r, k in self.skipped.most_common()]
        t = self.seconds if overhead_seconds is None else overhead_seconds
        out.append(f"time shadow mode added: {t:.1f} s")
        return out
