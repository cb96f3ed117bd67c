"""``ampkit._util.io``: temp files of killed writers are removed, those of live writers kept; failed
writes name the target and the cause.  Real processes, signals and file systems (a small tmpfs,
a read-only mount, RLIMIT_FSIZE), since root ignores permission bits."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from ampkit._util.io import atomic_write_bytes
from tests.helpers.mounts import run_after_mounting, tmpfs

SRC = str(Path(__file__).resolve().parents[2] / "src")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))}

# Writes 1 MiB into the temp file, says so, then blocks mid-write until killed.
BLOCKED_WRITER = """
import sys, time
from ampkit._util.io import atomic_replace
def write(f):
    f.write(b"x" * (1 << 20))
    f.flush()
    print("writing", flush=True)
    time.sleep(600)
atomic_replace(sys.argv[1], write)
"""

# Writes sys.argv[2] bytes to sys.argv[1]; prints the error message and what the directory holds.
WRITE_AND_REPORT = """
import os, sys
from ampkit._util.io import atomic_write_bytes
try:
    atomic_write_bytes(sys.argv[1], b"x" * int(sys.argv[2]))
    print("written")
except OSError as exc:
    print(type(exc).__name__, exc.errno, exc)
print(sorted(os.listdir(os.path.dirname(sys.argv[1]))))
"""


def start_blocked_writer(target: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED_WRITER, str(target)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line == "writing\n", proc.stderr.read() if proc.stderr else line
    return proc


def kill(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(timeout=30)  # reaped: a zombie still counts as a live writer


def temps(directory: Path, name: str) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(f".{name}.") and p.name.endswith(".tmp"))


def test_io_save_removes_the_temp_file_of_a_killed_writer(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    writer = start_blocked_writer(target)
    kill(writer)
    assert temps(tmp_path, "out.bin"), "a SIGKILLed writer leaves its temp file (the fault to clean up)"
    assert temps(tmp_path, "out.bin")[0].startswith(f".out.bin.{writer.pid}-")
    atomic_write_bytes(target, b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]
    assert target.read_bytes() == b"new"


def test_io_save_keeps_the_temp_file_of_a_live_writer(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    writer = start_blocked_writer(target)
    try:
        live = temps(tmp_path, "out.bin")
        atomic_write_bytes(target, b"mine")
        assert temps(tmp_path, "out.bin") == live and len(live) == 1
        assert (tmp_path / live[0]).stat().st_size == 1 << 20, "the live writer's data must be untouched"
        assert target.read_bytes() == b"mine"
    finally:
        kill(writer)


def test_io_save_keeps_temp_files_of_other_targets_and_other_hosts(tmp_path: Path) -> None:
    writer = start_blocked_writer(tmp_path / "out.bin")
    kill(writer)
    [leftover] = temps(tmp_path, "out.bin")  # .out.bin.<pid>-<host>.<random>.tmp
    pid_host, rest = leftover[len(".out.bin."):].split(".", 1)
    host = pid_host.split("-")[1]
    other_host = f".out.bin.{writer.pid}-{'0' * 8 if host != '0' * 8 else 'f' * 8}.{rest}"
    (tmp_path / other_host).write_bytes(b"partial, from another host on a shared file system")
    atomic_write_bytes(tmp_path / "out", b"1")  # its temp names start with ".out." too
    assert temps(tmp_path, "out.bin") == sorted([leftover, other_host])
    atomic_write_bytes(tmp_path / "out.bin", b"2")
    assert temps(tmp_path, "out.bin") == [other_host]


def test_io_write_to_a_directory_names_the_target_not_a_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    target.mkdir()
    with pytest.raises(IsADirectoryError) as err:
        atomic_write_bytes(target, b"{}")
    assert str(err.value).startswith(f"cannot write {str(target)!r}: it is a directory")
    assert ".report.json." not in str(err.value)
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_io_write_below_a_file_names_the_target_and_the_file_in_the_way(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("a file, not a directory")
    target = tmp_path / "out" / "report.json"
    with pytest.raises(NotADirectoryError, match=r"cannot write .*report.json'.*is a file, not a directory"):
        atomic_write_bytes(target, b"{}")


def test_io_write_callback_error_passes_through_unchanged(tmp_path: Path) -> None:
    from ampkit._util.io import atomic_replace

    def write(f: object) -> None:
        (tmp_path / "missing-input").read_bytes()  # the callback's own I/O error, not a failed write

    with pytest.raises(FileNotFoundError, match="missing-input"):
        atomic_replace(tmp_path / "out.bin", write)
    assert list(tmp_path.iterdir()) == []


def test_io_file_size_limit_names_the_target_and_the_limit(tmp_path: Path) -> None:
    target = tmp_path / "big.bin"

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    result = subprocess.run([sys.executable, "-c", WRITE_AND_REPORT, str(target), str(1 << 20)], env=ENV,
                            preexec_fn=limit, capture_output=True, text=True, timeout=60)
    first, listing = result.stdout.splitlines()
    assert first.startswith(f"OSError 27 cannot write {str(target)!r}: the file size limit is exceeded"), result
    assert listing == "[]", "the partial temp file must be removed"


def test_io_disk_full_names_the_target_and_no_space(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    result = run_after_mounting(tmpfs(tmp_path, "64k"), [sys.executable, "-c", WRITE_AND_REPORT, str(target),
                                                         str(1 << 20)], cwd=tmp_path, env=ENV, timeout=60)
    first, listing = result.stdout.splitlines()
    assert first == (f"OSError 28 cannot write {str(target)!r}: no space left on the device; free some space "
                     "or write to another file system"), result
    assert listing == "[]", "the partial temp file must be removed"


def test_io_read_only_directory_names_the_target_not_a_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    result = run_after_mounting(f"{tmpfs(tmp_path, '64k')} && mount -o remount,ro {tmp_path}",
                                [sys.executable, "-c", WRITE_AND_REPORT, str(target), "2"], cwd=tmp_path, env=ENV,
                                timeout=60)
    first, _ = result.stdout.splitlines()
    assert first.startswith(f"OSError 30 cannot write {str(target)!r}: the directory {str(tmp_path)!r} is on a "
                            "read-only file system"), result
    assert ".report.json." not in first


def test_io_check_before_the_rename_can_cancel_the_write(tmp_path: Path) -> None:
    target = tmp_path / "a.py"
    target.write_bytes(b"old")
    seen: list[list[str]] = []

    def refuse() -> None:
        seen.append(sorted(p.name for p in tmp_path.iterdir()))  # the synced temp file is there
        raise LookupError("changed meanwhile")

    with pytest.raises(LookupError, match="changed meanwhile"):
        atomic_write_bytes(target, b"new", check=refuse)
    assert target.read_bytes() == b"old"
    assert len(seen) == 1 and len(seen[0]) == 2 and seen[0][0].startswith(".a.py.")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.py"]  # the temp file is removed


# Writes the set {a, b} twice: a small old one, then a new one whose b is sys.argv[2] bytes.
WRITE_SET_AND_REPORT = """
import os, sys
from ampkit._util.io import atomic_write_set
d = sys.argv[1]
atomic_write_set({f"{d}/a": b"old a", f"{d}/b": b"old b"})
try:
    atomic_write_set({f"{d}/a": b"new a", f"{d}/b": b"x" * int(sys.argv[2])})
    print("written")
except OSError as exc:
    print(type(exc).__name__, exc.errno, exc)
print(open(f"{d}/a", "rb").read().decode(), sorted(os.listdir(d)))
"""

# A thread sends SIGTERM the moment the first temp file of the set appears (mid-write).
SIGTERM_DURING_A_SET = """
import os, signal, sys, threading
from ampkit._util.io import atomic_write_set
d = sys.argv[1]
def terminate_at_the_first_temp():
    while not any(name.endswith(".tmp") for name in os.listdir(d)):
        pass
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=terminate_at_the_first_temp, daemon=True).start()
atomic_write_set({f"{d}/{name}": name.encode() * (4 << 20) for name in "abc"})
print("the writer went on after the set")
"""


def test_io_write_set_that_fills_the_disk_leaves_every_old_file_and_no_temp(tmp_path: Path) -> None:
    result = run_after_mounting(tmpfs(tmp_path, "64k"), [sys.executable, "-c", WRITE_SET_AND_REPORT, str(tmp_path),
                                                         str(1 << 20)], cwd=tmp_path, env=ENV, timeout=60)
    first, listing = result.stdout.splitlines()
    assert first.startswith(f"OSError 28 cannot write {str(tmp_path / 'b')!r}: no space left"), result
    assert listing == "old a ['a', 'b']", "a must stay old although its new temp file was complete"


def test_io_write_set_sigterm_during_the_writes_completes_the_set_then_ends_by_it(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-c", SIGTERM_DURING_A_SET, str(tmp_path)], env=ENV,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == -15, result.stderr  # SIGTERM's default action, once the set is written
    assert result.stdout == "", "nothing after the set may run"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"], "no temp file is left"
    assert all((tmp_path / n).read_bytes() == n.encode() * (4 << 20) for n in "abc")
