"""Progress lines for work that prints nothing of its own (the doctor's end-of-run analysis).

A silent phase of a minute looks like a hang.  ``Heartbeat.phase`` arms a timer thread: a phase
that ends within ``every_s`` prints nothing, and one that lasts longer prints a line every
``every_s`` seconds, with the latest detail the work reported through ``beat`` (no line of its
own: the work does not need to know how long it has taken).  Cost: one timer thread per phase
that is still running, and a string per ``beat``.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

__all__ = ["Heartbeat"]


class Heartbeat:
    """Prints ``PREFIX: PHASE, DETAIL (N s)`` every ``every_s`` seconds while a phase runs.

    >>> import io
    >>> out = io.StringIO()
    >>> hb = Heartbeat("ampkit doctor", stream=out, every_s=0.01)
    >>> with hb.phase("checking step 8 against fp32"):
    ...     hb.beat("keep-fp32 search, trial 3")
    ...     time.sleep(0.2)
    >>> out.getvalue().splitlines()[0].startswith("ampkit doctor: checking step 8 against fp32, keep-fp32 search, trial 3 (")
    True
    """

    def __init__(self, prefix: str, *, stream: TextIO | None = None, every_s: float = 10.0) -> None:
        self.prefix = prefix
        self.stream = stream
        """Where lines go; None: ``sys.stderr`` as it is when a line is printed."""
        self.every_s = every_s
        self._phase = ""
        self._detail = ""
        self._started = 0.0
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Lines every ``every_s`` while the block runs; none when it is shorter."""
        with self._lock:
            self._phase, self._detail, self._started = name, "", time.monotonic()
            self._arm()
        try:
            yield
        finally:
            with self._lock:
                if self._timer is not None:
                    self._timer.cancel()
                self._timer = None
                self._phase = ""

    def beat(self, detail: str) -> None:
        """What the phase is doing now; shown on its next line."""
        self._detail = detail

    def _arm(self) -> None:
        self._timer = threading.Timer(self.every_s, self._tick)
        self._timer.daemon = True  # never keeps the process alive
        self._timer.start()

    def _tick(self) -> None:
        with self._lock:
            if not self._phase:
                return
            detail = f", {self._detail}" if self._detail else ""
            stream = self.stream if self.stream is not None else sys.stderr
            print(f"{self.prefix}: {self._phase}{detail} ({time.monotonic() - self._started:.0f} s)",
                  file=stream, flush=True)
            self._arm()
