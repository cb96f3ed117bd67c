"""Atomic file writes: a temp file in the target's directory, fsync, rename, fsync the directory.

An interrupted writer leaves the previous file intact and no partial file at the target.  Imports
no torch (``ampkit lint --fix`` uses it).

Temp files are named ``.NAME.<pid>-<host>.<random>.tmp``.  A writer killed mid-write (SIGKILL, an
OOM kill, a power cut) cannot remove its own; the next write of the same path removes every one
whose writer process no longer exists on this host, and never one whose writer still runs.

A failed write raises ``OSError`` (the errno kept) whose message names the target, not the temp
file, and says the cause in words: no space left, the file size limit, a read-only file system,
a directory in the way.

``atomic_write_set`` writes several files as one: all old or all new, with SIGINT, SIGTERM and
SIGHUP held until the set is complete (a report's JSON, Markdown and HTML).

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> atomic_write_bytes(d / "a.txt", b"hello")
>>> (d / "a.txt").read_bytes(), sorted(p.name for p in d.iterdir())
(b'hello', ['a.txt'])
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import socket
import stat
import tempfile
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, cast

from ampkit._util.signals import signals_deferred

__all__ = [
    "append_whole",
    "atomic_replace",
    "atomic_write_bytes",
    "atomic_write_set",
    "atomic_write_text",
    "fsync_dir",
    "remove_stale_temps",
]

# NAME_MAX is 255 bytes; the pid, host tag and random part add up to ~35 more, so a long target
# name is shortened in its temp names (the cleanup matches the same shortened prefix).
_STEM_MAX = 200
_TEMP_TAIL = re.compile(r"(\d+)-([0-9a-f]{8})\.[a-z0-9_]+\.tmp")


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


def _host_tag() -> str:
    # The same pid on another host sharing the file system (NFS) is another process; without the
    # host in the name a live writer there would look dead here and lose its temp file.
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def _temp_prefix(target: Path) -> str:
    return f".{target.name[:_STEM_MAX]}."


def _writer_is_dead(pid: int) -> bool:
    if pid <= 0 or os.name != "posix":  # os.kill(pid, 0) terminates the process on Windows
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: alive, owned by another user
        return False
    return False


def remove_stale_temps(path: str | os.PathLike[str]) -> list[Path]:
    """Remove the temp files that killed writes of ``path`` left behind; return the removed paths.

    A temp file is stale when it was written on this host by a process that no longer exists (a
    killed writer that its parent has not reaped yet still counts as alive).  Temp files of
    running writers, of other hosts, and of other targets are never touched.  Best effort: a
    file that cannot be removed is left.  Cost: one listing of the directory.
    """
    target = Path(path)
    prefix, host = _temp_prefix(target), _host_tag()
    removed: list[Path] = []
    try:
        entries = os.scandir(target.parent)
    except OSError:
        return removed
    with entries:
        for entry in entries:
            if not entry.name.startswith(prefix):
                continue
            match = _TEMP_TAIL.fullmatch(entry.name[len(prefix):])
            if match is None or match.group(2) != host or not _writer_is_dead(int(match.group(1))):
                continue
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def _cause(err: OSError, target: Path) -> str:
    parent = str(target.parent)
    causes = {
        errno.ENOSPC: "no space left on the device; free some space or write to another file system",
        errno.EDQUOT: "the disk quota is exceeded (no space left for this user); free some space or raise the quota",
        errno.EFBIG: "the file size limit is exceeded (the process's RLIMIT_FSIZE, `ulimit -f`, or the file "
                     "system's largest file); raise the limit or write to another file system",
        errno.EROFS: f"the directory {parent!r} is on a read-only file system; write to a writable directory",
        errno.EACCES: f"no permission to create files in {parent!r}; write to a directory you can write to",
        errno.EPERM: f"no permission to create files in {parent!r}; write to a directory you can write to",
        errno.EISDIR: "it is a directory; pass the path of a file",
        errno.ENOTDIR: f"{parent!r} or a directory above it is a file, not a directory; pass another path",
        errno.ENAMETOOLONG: "the file name is too long for the file system; pass a shorter name",
    }
    return causes.get(err.errno or 0, err.strerror or str(err))


def _explained(err: OSError, target: Path) -> OSError:
    """An OSError of the same class and errno whose message names ``target`` and the cause."""
    # OSError(errno, ...) picks the subclass (IsADirectoryError, PermissionError, ...); a message
    # without strerror/filename prints as is, with no "[Errno N]" and no temp file name.
    cls = type(OSError(err.errno, err.strerror)) if err.errno else OSError
    kept = "; the file already there is unchanged" if target.is_file() else ""
    new = cls(f"cannot write {str(target)!r}: {_cause(err, target)}{kept}")
    new.errno = err.errno
    return new


class _RecordingFile:
    """Forwards to a file and keeps the first OSError of a write or flush.

    ``torch.save`` turns that error into ``RuntimeError: [enforce fail at inline_container.cc]``,
    which names neither the file nor the cause; the recorded error restores both.
    """

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file
        self.error: OSError | None = None

    def _record(self, call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(*args)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def write(self, data: Any) -> int:
        return int(self._record(self._file.write, data))

    def flush(self) -> None:
        self._record(self._file.flush)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


def _prepare_directory(target: Path) -> None:
    if target.is_dir():
        raise _explained(IsADirectoryError(errno.EISDIR, "Is a directory"), target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError as exc:  # a file where a directory of the path should be
        raise _explained(NotADirectoryError(errno.ENOTDIR, "Not a directory"), target) from exc
    except OSError as exc:
        raise _explained(exc, target) from exc


def atomic_replace(path: str | os.PathLike[str], write: Callable[[IO[bytes]], object], *,
                   mode: int | None = None, check: Callable[[], object] | None = None) -> None:
    """Call ``write(file)`` on a temp file next to ``path``, fsync it, rename it over ``path``.

    ``mode``: the new file's permission bits; default what a plain ``open()`` would give
    (0666 minus the umask).  The parent directory is created when missing.  Temp files of
    earlier writes of ``path`` whose writer was killed are removed first (``remove_stale_temps``).
    A failure raises ``OSError`` naming ``path`` and the cause; an exception of ``write`` itself
    passes through unless a disk write caused it.  ``check``, when given, runs after the temp file
    is synced and just before the rename (the last moment to decide, e.g. that ``path`` was not
    changed meanwhile); an exception from it cancels the write, removes the temp file and passes
    through.
    """
    target = Path(path)
    _prepare_directory(target)
    remove_stale_temps(target)  # first: the leftovers may be what fills the disk
    tmp = _synced_temp(target, write, mode)
    try:
        if check is not None:
            check()
        _rename(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(target.parent)


def atomic_write_set(files: Mapping[str | os.PathLike[str], bytes], *, mode: int | None = None) -> None:
    """Write several files so that together they are all the old ones or all the new ones.

    Every file is first written to its temp file and synced; only then are they renamed, one
    after another.  SIGINT, SIGTERM and SIGHUP wait for the end (``signals.signals_deferred``),
    so a signal can neither leave a temp file behind nor stop between two renames; a failure
    while writing removes every temp file and leaves all the old files.  What it cannot cover:
    SIGKILL or a power cut between two renames (the set is then mixed), and a rename that fails
    after another succeeded, which a rename within one directory practically never does.  Errors
    as ``atomic_replace``.
    """
    targets = [(Path(p), data) for p, data in files.items()]
    for target, _ in targets:
        _prepare_directory(target)
        remove_stale_temps(target)
    temps: list[str] = []
    renamed = 0
    with signals_deferred():
        try:
            for target, data in targets:
                temps.append(_synced_temp(target, functools.partial(_write_all, data=data), mode))
            for tmp, (target, _) in zip(temps, targets):
                _rename(tmp, target)
                renamed += 1
        finally:
            for tmp in temps[renamed:]:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
    for parent in dict.fromkeys(target.parent for target, _ in targets):
        fsync_dir(parent)


def _write_all(f: IO[bytes], *, data: bytes) -> None:
    f.write(data)


def _synced_temp(target: Path, write: Callable[[IO[bytes]], object], mode: int | None) -> str:
    """A temp file next to ``target`` holding what ``write`` wrote, synced to disk; removed on failure."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{_temp_prefix(target)}{os.getpid()}-{_host_tag()}.",
                                   suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise _explained(exc, target) from exc
    ours = True  # False once the failure is write()'s own, which passes through as it is
    try:
        # mkstemp creates 0600; until this chmod the file is only stricter, never wider.
        os.fchmod(fd, (0o666 & ~_current_umask()) if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            recorder = _RecordingFile(f)
            try:
                write(cast(IO[bytes], recorder))
            except Exception as exc:
                ours = False
                if recorder.error is None:
                    raise
                raise _explained(recorder.error, target) from exc
            f.flush()
            os.fsync(f.fileno())
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if ours and isinstance(exc, OSError):
            raise _explained(exc, target) from exc
        raise
    return tmp


def _rename(tmp: str, target: Path) -> None:
    try:
        os.replace(tmp, target)
    except OSError as exc:
        raise _explained(exc, target) from exc


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, mode: int | None = None,
                       check: Callable[[], object] | None = None) -> None:
    """Write ``data`` to ``path`` atomically (see ``atomic_replace``, also for ``check``)."""
    atomic_replace(path, lambda f: f.write(data), mode=mode, check=check)


def atomic_write_text(path: str | os.PathLike[str], text: str, *, mode: int | None = None) -> None:
    """Write ``text`` as UTF-8 to ``path`` atomically (see ``atomic_replace``)."""
    atomic_write_bytes(path, text.encode("utf-8"), mode=mode)


def append_whole(fd: int, data: bytes, *, fsync: bool = False) -> None:
    """Append ``data`` to the file open at ``fd`` (opened for appending): all of it, or nothing.

    ``os.write`` may write only a part (a disk that fills up mid-write returns a short count and
    the next call fails with ENOSPC).  On any failure, an interrupt included, a regular file is cut
    back to its size before the call, so a reader that parses every line never meets a partial
    one; then the error passes through.  A device or pipe cannot be cut back.  Cost: one
    ``fstat``, plus one ``ftruncate`` on failure; correct only while no other process appends to
    the same file.
    """
    before = os.fstat(fd)
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
        if fsync:
            os.fsync(fd)
    except BaseException as exc:
        if not stat.S_ISREG(before.st_mode):
            raise
        try:
            os.ftruncate(fd, before.st_size)
        except OSError as undo:
            if isinstance(exc, OSError):
                raise OSError(exc.errno, f"{exc.strerror}; the partial write could not be cut back "
                                         f"({undo.strerror})") from exc
        raise
