"""Finding and signalling the rank processes of a launch (torch-free).

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
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable
from pathlib import Path

__all__ = ["live_pids", "signal_groups"]


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
