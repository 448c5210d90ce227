"""A one-line progress bar for the examples' loops (no dependency): on a terminal only, and only for
runs long enough to want one, so logs and tests read plain lines."""

from __future__ import annotations

import sys
import time
from typing import TextIO

LONG_RUN = 20  # steps: shorter runs finish before a bar is worth drawing


class Progress:
    """`update(done, text)` redraws `[#####-----] done/total text, s/step` in place."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None, enabled: bool | None = None,
                 width: int = 30) -> None:
        self.total, self.label, self.width = total, label, width
        self.stream = stream or sys.stderr
        self.enabled = (self.stream.isatty() and total >= LONG_RUN) if enabled is None else enabled
        self._start = time.perf_counter()

    def update(self, done: int, text: str = "") -> None:
        if not self.enabled:
            return
        filled = self.width * done // self.total
        per_step = (time.perf_counter() - self._start) / max(done, 1)
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {done}/{self.total} {text} {per_step:.2f} s/step")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
