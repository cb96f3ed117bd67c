"""How a script run by ``ampkit doctor`` ended, and the traps that let the doctor report first.

A run is *partial* when the script did not get to its normal end: ``sigint`` (Ctrl-C),
``sigterm`` (a CI timeout, a scheduler), ``sighup`` (its terminal closed, an ssh session
dropped), ``exception`` (it raised) or ``os_exit`` (it called ``os._exit``, which skips every
``finally`` and ``atexit``).  A normal end, ``sys.exit(n)``
included, is not partial.

``trap_ends`` turns SIGTERM and SIGHUP into ``ScriptTerminated`` in the main thread (each only
while it still has its default action: a script that installed its own handler keeps it), and replaces
``os._exit`` with a function that first lets the doctor write its findings.  Both are undone
when the block ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["ENDINGS", "SIGNAL_EXIT_STATUS", "ScriptTerminated", "trap_ends"]

ENDINGS = ("sigint", "sigterm", "sighup", "exception", "os_exit")
"""The values of the doctor JSON's ``ended`` (present when ``partial`` is true)."""

SIGNAL_EXIT_STATUS = {"sigint": 130, "sigterm": 143, "sighup": 129}
"""The doctor's exit status after a signal: 128 + the signal number, as a shell reports it."""


_TRAPPED = {getattr(signal, name.upper()): name for name in ("sigterm", "sighup") if hasattr(signal, name.upper())}
"""The signals ``trap_ends`` turns into ``ScriptTerminated``, and their ``ended`` names."""


class ScriptTerminated(BaseException):
    """SIGTERM or SIGHUP arrived while the script ran.  A BaseException, like KeyboardInterrupt,
    so that the script's ``except Exception`` does not swallow it."""

    @property
    def ended(self) -> str:
        """``sigterm`` or ``sighup``: the doctor JSON's ``ended``."""
        return _TRAPPED.get(self.args[0] if self.args else None, "sigterm")


def _raise_terminated(signum: int, frame: Any) -> None:
    raise ScriptTerminated(signum)


@contextmanager
def _signals_trapped() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    previous = {sig: signal.getsignal(sig) for sig in _TRAPPED}
    trapped = [sig for sig, handler in previous.items() if handler is signal.SIG_DFL]
    for sig in trapped:
        signal.signal(sig, _raise_terminated)
    try:
        yield
    finally:
        for sig in trapped:
            signal.signal(sig, previous[sig])


@contextmanager
def _os_exit_trapped(before_exit: Callable[[int], int] | None) -> Iterator[None]:
    if before_exit is None:
        yield
        return
    real_exit = os._exit
    pid = os.getpid()

    def _exit(status: int) -> Any:
        # A forked child (DataLoader or multiprocessing worker) shares this patched function but
        # not the doctor: it must exit at once.  Other threads exit at once too, since the doctor
        # concludes on the main thread's state.
        if os.getpid() != pid or threading.current_thread() is not threading.main_thread():
            real_exit(status)
        os._exit = real_exit  # a second call while the doctor writes exits for real
        code = 1
        try:
            code = before_exit(status)
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()  # os._exit drops buffered output
            real_exit(code)

    os._exit = _exit
    try:
        yield
    finally:
        os._exit = real_exit


@contextmanager
def trap_ends(before_os_exit: Callable[[int], int] | None) -> Iterator[None]:
    """Trap SIGTERM and SIGHUP and, when ``before_os_exit`` is given, ``os._exit``.

    ``before_os_exit(status)`` runs when the script calls ``os._exit(status)``; it returns the
    status the process then exits with (the real ``os._exit``, whatever it raises).
    """
    with _signals_trapped(), _os_exit_trapped(before_os_exit):
        yield
