"""Hold SIGINT, SIGTERM and SIGHUP for the length of a block that must not be cut in two (torch-free).

``signals_deferred()`` installs Python-level handlers that only record which signal came.
Python runs signal handlers in the main thread, whichever thread the kernel delivered the
signal to, so this holds in a process whose other threads (torch's, a watchdog's) could
receive it, which blocking the signal in the main thread alone (``pthread_sigmask``) does not.
When the block ends the previous handlers are restored and each recorded signal is
delivered to them once, in the order they came: ``KeyboardInterrupt`` for SIGINT under
Python's default handler, the default action (the process ends by that signal) for a
signal left at ``SIG_DFL``, the program's own handler where it installed one.

Handlers can be set in the main thread only; elsewhere the block runs without deferral.  A
signal whose handler was not set from Python (``getsignal`` is None) is left alone.  Cost:
two ``signal.signal`` calls per signal; hold it for the milliseconds of a rename, not for work
a user may want to stop.

>>> import os, signal
>>> try:
...     with signals_deferred():
...         os.kill(os.getpid(), signal.SIGINT)
...         done = "the block finished first"
... except KeyboardInterrupt:
...     print(done)
the block finished first
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

__all__ = ["DEFERRED_SIGNALS", "signals_deferred"]

DEFERRED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
"""The signals that end a run when a user or a scheduler asks (SIGHUP: the terminal closed)."""


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Record SIGINT/SIGTERM/SIGHUP during the block; deliver them to the previous handlers after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []

    def record(signum: int, frame: FrameType | None) -> None:
        if signum not in came:
            came.append(signum)

    previous: dict[int, Any] = {}
    try:
        for sig in DEFERRED_SIGNALS:
            handler = signal.getsignal(sig)
            if handler is not None:
                previous[sig] = signal.signal(sig, record)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in came:
            _deliver(signum, previous[signum])


def _deliver(signum: int, handler: Any) -> None:
    """Do what ``handler`` (restored already) would have done had the signal come now."""
    if handler == signal.SIG_IGN:
        return
    if handler == signal.SIG_DFL:
        # In this thread, so the default action (the end of the process) happens before anything
        # after the block runs; os.kill could be handled by another thread a moment later.
        signal.raise_signal(signum)
        return
    handler(signum, None)
