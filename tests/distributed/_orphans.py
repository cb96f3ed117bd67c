"""Helpers of the orphan tests: find a launch's torchrun and ranks, wait for them to end, clean up."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from tests.helpers.processes import descendants, parent_of
from tests.helpers.processes import survivors as _survivors

START_TIMEOUT_S = 120.0
"""Starting torchrun and 2 ranks that import torch takes ~10 s on 2 busy cores; this bounds a hang."""
GONE_TIMEOUT_S = 15.0
_MARKERS = (b"torch.distributed.run", b"ampkit.distributed._rank_main")


def _has(path: Path, text: str) -> bool:
    return path.exists() and text in path.read_text()


def wait_for_ranks(rank_dir: Path, nproc: int, proc: subprocess.Popen[bytes],
                   ready: str = "") -> tuple[int, list[int]]:
    """Once every rank wrote its pid, and ``ready`` on its stdout: (torchrun's pid, the rank pids)."""
    files = [rank_dir / f"rank{r}.pid" for r in range(nproc)]
    outs = [rank_dir / f"rank{r}.stdout" for r in range(nproc)]
    deadline = time.monotonic() + START_TIMEOUT_S
    while not all(_has(f, "") and f.read_text() and _has(o, ready) for f, o in zip(files, outs)):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the ranks never started (parent exit {proc.returncode}); {rank_dir}")
        time.sleep(0.1)
    ranks = [int(f.read_text()) for f in files]
    launchers = {parent_of(pid) for pid in ranks}
    assert len(launchers) == 1, launchers
    torchrun = launchers.pop()
    assert parent_of(torchrun) == proc.pid, "torchrun must be a child of the parent process"
    return torchrun, ranks


def survivors(pids: list[int], timeout: float = GONE_TIMEOUT_S) -> list[int]:
    """The pids still running after up to ``timeout`` seconds."""
    return _survivors(pids, timeout)


@contextlib.contextmanager
def reaping(proc: subprocess.Popen[bytes], pids: list[int]) -> Iterator[None]:
    """Whatever the test asserted, SIGKILL the parent and every launch process still running.

    ``pids`` may grow inside the block (the torchrun and rank pids once known); the parent's
    descendants at the end are added, for a launch that failed before its ranks were found.
    """
    try:
        yield
    finally:
        leftovers = [*pids, *(descendants(proc.pid) if proc.poll() is None else [])]
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
        for pid in leftovers:
            with contextlib.suppress(OSError):
                if any(m in Path(f"/proc/{pid}/cmdline").read_bytes() for m in _MARKERS):  # not a reused pid
                    os.kill(pid, signal.SIGKILL)
