"""The JSONL report: one line per computation seen, each written whole and flushed as it is
decided, so that a run that crashes leaves every finished line readable and no half line."""
from __future__ import annotations

import json
import os
import threading
from typing import IO

from .computation import Outcome


class JsonlReport:
    """Appends `Outcome` lines to `path` (created, or emptied with `truncate=True`)."""

    def __init__(self, path: str | os.PathLike[str], *, truncate: bool = True) -> None:
        self.path = os.fspath(path)
        parent = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(parent):
            raise ValueError(f"report: directory {parent} does not exist (report={self.path!r})")
        self._lock = threading.Lock()
        self._file: IO[str] | None = open(self.path, "w" if truncate else "a", encoding="utf-8")  # noqa: SIM115

    def write(self, outcome: Outcome) -> None:
        # one write() of the whole line, then flush: a crash after it leaves the line complete
        line = json.dumps(outcome.to_json(), sort_keys=True, allow_nan=False) + "\n"
        with self._lock:
            if self._file is None:
                raise ValueError(f"report {self.path} is closed")
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                self._file = None
