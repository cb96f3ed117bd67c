"""Atomic file writes: a temp file in the target's directory, fsync, rename, fsync the directory.

An interrupted writer leaves the previous file intact and no partial file behind.  Imports no
torch (``ampkit lint --fix`` uses it).

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> atomic_write_bytes(d / "a.txt", b"hello")
>>> (d / "a.txt").read_bytes(), sorted(p.name for p in d.iterdir())
(b'hello', ['a.txt'])
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

__all__ = ["atomic_replace", "atomic_write_bytes", "atomic_write_text", "fsync_dir"]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Persist a directory entry change (a rename); without it a power cut can roll it back."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _current_umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; restore at once
    os.umask(mask)
    return mask


def atomic_replace(path: str | os.PathLike[str], write: Callable[[IO[bytes]], object], *,
                   mode: int | None = None) -> None:
    """Call ``write(file)`` on a temp file next to ``path``, fsync it, rename it over ``path``.

    ``mode``: the new file's permission bits; default what a plain ``open()`` would give
    (0666 minus the umask).  The parent directory is created when missing.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        # mkstemp creates 0600; until this chmod the file is only stricter, never wider.
        os.fchmod(fd, (0o666 & ~_current_umask()) if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(target.parent)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` atomically (see ``atomic_replace``)."""
    atomic_replace(path, lambda f: f.write(data), mode=mode)


def atomic_write_text(path: str | os.PathLike[str], text: str, *, mode: int | None = None) -> None:
    """Write ``text`` as UTF-8 to ``path`` atomically (see ``atomic_replace``)."""
    atomic_write_bytes(path, text.encode("utf-8"), mode=mode)
