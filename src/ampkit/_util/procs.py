"""Finding and signalling the rank processes of a launch, and tying their lives to the launcher's (torch-free).

Each rank writes its pid to ``rank<R>.pid`` in the launch's log directory and leads its own
process group, so a launch that must stop (a timeout, Ctrl-C) signals whole groups: the rank
and whatever it started.  A pid in a file may belong to another process by now (pids are
reused), so a pid counts only while its command line still names the launched program.

>>> import os, tempfile
>>> from pathlib import Path
>>> d = Path(tempfile.mkdtemp())
>>> _ = (d / "rank0.pid").write_text(str(os.getpid()))
>>> live_pids([d / "rank0.pid", d / "rank1.pid"], b"no-such-program") == []
True
>>> own = Path("/proc/self/cmdline").read_bytes().split(b"\\0")[0]
>>> live_pids([d / "rank0.pid", d / "rank1.pid"], own) == [os.getpid()]
True

No orphans, however the launcher dies (SIGKILL included, which no handler sees):

* ``die_with_caller()`` is the ``preexec_fn`` of the launcher's ``Popen``: on Linux the child
  gets SIGKILL from the kernel when the *thread* that called ``Popen`` ends
  (``PR_SET_PDEATHSIG``), so that thread must stay in the call for the child's whole life --
  ``launch_torchrun`` waits there.
* ``die_with_parent()`` runs first thing in each grandchild (a rank, started by torchrun): the
  same parent-death signal, plus a watchdog thread that SIGKILLs the process when its parent
  changes or the launcher is gone -- the fallback where ``prctl`` does not exist and for a
  parent that died before the signal was armed.
* ``sigterm_unwinds()`` turns SIGTERM of the launcher (and, when asked, SIGHUP: a closed
  terminal) into an exception while a launch runs, so its cleanup stops the children in order
  and removes its scratch files; then the launcher still dies by that signal.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import FrameType

__all__ = ["die_with_caller", "die_with_parent", "live_pids", "set_parent_death_signal", "signal_groups",
           "sigterm_unwinds"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def live_pids(pid_files: Iterable[Path], marker: bytes) -> list[int]:
    """The pids written in ``pid_files`` whose process still runs a command line containing ``marker``.

    A missing or unreadable file, or a pid that exited or now runs something else, is left out.
    """
    pids = []
    for pid_file in pid_files:
        with contextlib.suppress(OSError, ValueError):
            pid = int(pid_file.read_text())
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
    return pids


def signal_groups(pids: Iterable[int], sig: signal.Signals) -> None:
    """Send ``sig`` to the process group each pid leads; a group that is gone (or not ours) is skipped.

    >>> import subprocess, sys
    >>> p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    >>> signal_groups([p.pid], signal.SIGTERM)
    >>> p.wait() == -signal.SIGTERM
    True
    """
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` on Linux, else None (looked up before a fork: the child only calls it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl  # type: ignore[no-any-return]


def set_parent_death_signal(sig: signal.Signals = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when the parent thread that started it ends.

    Linux only (``prctl(PR_SET_PDEATHSIG)``); False where it is not available.  The signal is
    bound to the parent's *thread*, not its process, and is cleared in children this process forks.
    """
    prctl = _prctl()
    return prctl is not None and prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def die_with_caller() -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets SIGKILL when the calling thread ends.

    However the caller dies, SIGKILL included; Linux only (elsewhere the child's own children
    watch, see ``die_with_parent``).  A child whose parent died between fork and ``prctl``
    kills itself at once.  Everything is looked up before the fork, so the child runs only a
    foreign call and two system calls.
    """
    prctl, parent, sigkill = _prctl(), os.getpid(), int(signal.SIGKILL)

    def preexec() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sigkill)

    return preexec


def _parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` from /proc, or None where /proc cannot tell."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _exists(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (dead, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _die() -> None:
    """SIGKILL this process, and first its process group when it leads one (its own children)."""
    if os.getpgid(0) == os.getpid():
        os.killpg(0, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent(launcher_pid: int | None = None, *, interval: float = 0.5, death_signal: bool = True) -> None:
    """Make this process die with its parent and, when given, with ``launcher_pid`` (its parent's parent).

    ``death_signal``: arm the Linux parent-death signal (SIGKILL when the parent's thread that
    started us ends).  Always: a daemon thread checks every ``interval`` seconds that the parent
    is still the one we started under and the launcher still runs, and otherwise SIGKILLs this
    process (and its process group when it leads one) -- the fallback where there is no
    ``prctl``, and for a launcher that dies while our parent lives on.  A parent that is already
    gone, or is not the launcher's child, ends this process at once.  Costs one wake-up per interval.
    """
    parent = os.getppid()
    if death_signal:
        set_parent_death_signal()
    grandparent = _parent_of(parent) if launcher_pid is not None else None

    def orphaned() -> bool:
        return os.getppid() != parent or (launcher_pid is not None and not _exists(launcher_pid))

    if orphaned() or (grandparent is not None and grandparent != launcher_pid):
        _die()

    def watch() -> None:
        while not orphaned():
            stop.wait(interval)
        _die()

    stop = threading.Event()  # never set: the watchdog ends with the process
    threading.Thread(target=watch, name="ampkit-die-with-parent", daemon=True).start()


class _Terminated(BaseException):
    """A signal named in ``sigterm_unwinds`` arrived inside its block."""


@contextlib.contextmanager
def sigterm_unwinds(*, signals: Iterable[signal.Signals] = (signal.SIGTERM,)) -> Iterator[None]:
    """While the block runs, SIGTERM raises inside it, so its cleanup runs; then the process dies by SIGTERM.

    ``signals``: the signals treated so (SIGTERM alone by default; add SIGHUP where a closed
    terminal must clean up too); the process dies by whichever came first.  Only in the main
    thread (where Python runs signal handlers) and only for a signal that has its default
    action: a program's own handler, or SIGHUP ignored under ``nohup``, is left alone.  Any of
    them arriving during the cleanup is ignored; SIGKILL still ends everything at once.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # Each signal on its own: one a program handles or ignores keeps that; the others still unwind.
    taken = [sig for sig in dict.fromkeys(signals) if signal.getsignal(sig) == signal.SIG_DFL]
    came: list[int] = []

    def unwind(signum: int, frame: FrameType | None) -> None:
        for sig in taken:  # a second signal must not cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        came.append(signum)
        raise _Terminated

    for sig in taken:
        signal.signal(sig, unwind)
    try:
        yield
    except _Terminated:
        signal.signal(came[0], signal.SIG_DFL)
        # raise_signal, not os.kill: delivered to this thread, so the default action (the process
        # ends here) comes before anything after the block could run in the meantime.
        signal.raise_signal(came[0])
        raise SystemExit(128 + came[0]) from None  # only if the signal is blocked
    finally:
        for sig in taken:
            signal.signal(sig, signal.SIG_DFL)
