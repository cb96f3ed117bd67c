"""Report paths checked before the work starts, and a place to put a report when they fail.

A report that cannot be written should stop a command before it trains for an hour, not
after.  ``absolute_path`` fixes a path once, at start, so a script that calls ``os.chdir``
does not move it; ``unwritable_reason`` proves a directory writable with a real file (a
permission-bit check would be wrong for root, read-only mounts and full disks alike);
``fallback_directory`` is where the report goes when writing still fails at the end.
Imports no torch.

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> unwritable_reason(d / "new" / "deeper") is None, sorted(p.name for p in d.iterdir())
(True, [])
>>> (d / "file").write_text("x")
1
>>> unwritable_reason(d / "file" / "sub").endswith("file is a file, not a directory")
True
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["absolute_path", "fallback_directory", "unwritable_reason"]


def absolute_path(path: str | os.PathLike[str]) -> Path:
    """``path`` made absolute against the current working directory (``~`` expanded), symlinks kept."""
    return Path(os.path.abspath(os.path.expanduser(os.fspath(path))))


def _missing_parts(directory: Path) -> tuple[list[Path], str | None]:
    """The directories to create (outermost first), or why none can be: a part that is a file."""
    missing: list[Path] = []
    here = directory
    while not here.exists():
        if here.is_symlink():
            return [], f"{here} is a broken symbolic link"
        missing.append(here)
        if here.parent == here:
            break
        here = here.parent
    if here.exists() and not here.is_dir():
        return [], f"{here} is a file, not a directory"
    return missing[::-1], None


def unwritable_reason(directory: str | os.PathLike[str]) -> str | None:
    """None when a file can be created in ``directory`` (created if missing), else why not.

    The probe creates the missing directories and one temp file, writes a byte, and removes
    all of it again: the check leaves nothing behind (about a millisecond).
    """
    target = Path(directory)
    missing, reason = _missing_parts(target)
    if reason is not None:
        return reason
    created: list[Path] = []
    try:
        for part in missing:
            part.mkdir()
            created.append(part)
        fd, name = tempfile.mkstemp(prefix=".ampkit-probe-", dir=target)
        try:
            os.write(fd, b"\0")
        finally:
            os.close(fd)
            os.unlink(name)
    except OSError as exc:
        where = exc.filename or target
        return f"cannot create a file in {where}: {exc.strerror or exc}"
    finally:
        for part in reversed(created):
            with contextlib.suppress(OSError):
                part.rmdir()
    return None


def fallback_directory(prefix: str) -> Path:
    """A new private directory in the system temp directory (``$TMPDIR``), for a report that
    could not be written where the user asked."""
    return Path(tempfile.mkdtemp(prefix=prefix))
