"""The failure an `assert_*` raises: an AssertionError (what pytest reports as a failed test)
that carries the whole report, so a test can inspect the verdict, the worst example, the
tied parameter and the ε instead of matching substrings of the message."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._report import Report


class ClippingCheckFailed(AssertionError):
    """The oracle judged the claim wrong. `str(e)` is `e.report.explain()`; `e.report` is the
    `Report` (`verdict`, `worst`, `privacy`, `tied_parameters`, `step`, ...)."""

    __module__ = "ghost_oracle"  # where it is imported from, and how pytest names it

    def __init__(self, report: Report) -> None:
        super().__init__(report.explain())
        self.report = report
