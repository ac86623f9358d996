"""Progress of a long export on stderr: one line per stage, rewritten at most every two seconds,
only once the export has taken more than a few seconds (a small model's export stays silent).
At the Llama-3.2-1B shape an export takes minutes; this says where it is and how long is left."""
from __future__ import annotations

import sys
import time
from typing import TextIO

#: Seconds before the first line, and between two lines.
QUIET_S = 5.0
EVERY_S = 2.0


class Progress:
    """The export's progress line: `step` as each stage advances, `done` at the end."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.start = time.monotonic()
        self.last = 0.0
        self.stream = stream if stream is not None else sys.stderr
        self.shown = False

    def step(self, stage: str, done: int, total: int) -> None:
        """`done` of `total` units of `stage` are finished."""
        now = time.monotonic()
        elapsed = now - self.start
        if elapsed < QUIET_S or (now - self.last < EVERY_S and done < total):
            return
        self.last = now
        self._stage_start = getattr(self, "_stage_start", {})
        t0 = self._stage_start.setdefault(stage, (now, done))
        rate_s = (now - t0[0]) / (done - t0[1]) if done > t0[1] else None
        eta = f", {rate_s * (total - done):.0f} s left in it" if rate_s is not None and done < total else ""
        self.stream.write(f"\rghost-oracle export: {stage} {done}/{total}{eta} ({elapsed:.0f} s in all)\033[K")
        self.stream.flush()
        self.shown = True

    def done(self) -> None:
        if self.shown:
            self.stream.write(f"\rghost-oracle export: done in {time.monotonic() - self.start:.0f} s\033[K\n")
            self.stream.flush()
