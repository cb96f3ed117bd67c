"""Watching processes from a test: is a pid running, its parent and descendants, which pids outlive a deadline;
and a background load that keeps every core busy."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path


def running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def survivors(pids: list[int], timeout: float) -> list[int]:
    """The pids still running after up to ``timeout`` seconds (polled every 50 ms)."""
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def descendants(root: int) -> list[int]:
    """Every process below ``root`` in the process tree (read from /proc; zombies included)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                children.setdefault(parent_of(int(entry.name)), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found.extend(kids)
        todo.extend(kids)
    return found


def with_command_line(marker: str) -> list[int]:
    """The running processes whose command line contains ``marker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if marker.encode() in (entry / "cmdline").read_bytes() and running(int(entry.name)):
                    pids.append(int(entry.name))
    return pids


@contextlib.contextmanager
def busy_cores() -> Iterator[None]:
    """Every core this process may run on busy: one Python process per core (at least 2) spinning a loop,
    each running before the block starts (it says so on its stdout) and killed after it, whatever happens."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(max(2, cores)):
            procs.append(subprocess.Popen([sys.executable, "-S", "-c", "print(flush=True)\nwhile True: pass"],
                                          stdout=subprocess.PIPE))
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == b"\n"
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
