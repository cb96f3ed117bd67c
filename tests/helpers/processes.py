"""Watching processes from a test: is a pid still running, and which pids outlive a deadline."""

from __future__ import annotations

import time
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
