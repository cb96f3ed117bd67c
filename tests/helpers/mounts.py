"""File-system faults that bind root too: run a command in a private mount namespace.

Tests run as root, which ignores ``chmod``; a read-only bind mount or a tiny tmpfs does bind it.
The mounts live in a namespace of their own (``unshare --mount``), so nothing outside the
command sees them.  Where the machine cannot create them, the test is skipped with the reason.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

_CANNOT_MOUNT = 97
"""Exit status of the wrapper when the mount commands fail (the test is then skipped)."""


def read_only(folder: Path) -> str:
    """Shell commands that make ``folder`` read-only (a read-only bind mount of itself)."""
    return f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder}"


def tmpfs(folder: Path, size: str) -> str:
    """Shell commands that put a tmpfs of ``size`` (e.g. ``64k``) over ``folder``: a disk that fills up."""
    return f"mount -t tmpfs -o size={size} tmpfs {folder}"


def run_after_mounting(mount: str, argv: Sequence[str], *, cwd: Path | None = None,
                       env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in a private mount namespace after the shell commands ``mount`` succeeded."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a mount namespace here: {probe.stderr.strip()}")
    script = f'{{ {mount}; }} || exit {_CANNOT_MOUNT}; exec "$@"'
    result = subprocess.run(["unshare", "--mount", "sh", "-c", script, "sh", *argv], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=timeout)
    if result.returncode == _CANNOT_MOUNT:
        pytest.skip(f"cannot mount here: {result.stderr.strip()}")
    return result
