"""``ampkit lint`` under faults: a file edited during ``--fix``, an unreadable directory, CR-only
line endings, a file the linter fails on.  Each leaves the rest of the run intact and is reported."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ampkit.cli.main import main
from ampkit.lint import lint_paths, source
from ampkit.lint.core import Rule

SRC = str(Path(__file__).resolve().parents[2] / "src")
LEGACY = "import torch\nscaler = torch.cuda.amp.GradScaler()\n"

# An audit hook cannot be removed: it stays installed, acting only while a test arms it.
_ARMED: list[tuple[str, Path, bytes]] = []


def _edit_when_the_fix_starts_writing(event: str, args: tuple[Any, ...]) -> None:
    # tempfile.mkstemp is where atomic_replace starts the rewrite: the fix is computed from the
    # bytes read earlier, and an editor saving the file now is the race --fix must not lose.
    if event == "tempfile.mkstemp" and _ARMED and os.path.basename(str(args[0])).startswith(_ARMED[0][0]):
        _, target, edit = _ARMED.pop()
        target.write_bytes(edit)


sys.addaudithook(_edit_when_the_fix_starts_writing)


def test_checker_fix_keeps_an_edit_made_while_it_runs(tmp_path: Path, capsys: Any) -> None:
    target = tmp_path / "train.py"
    target.write_text(LEGACY)
    edit = (LEGACY + "# saved by an editor while the fix ran\n").encode()
    _ARMED.append((".train.py.", target, edit))
    try:
        code = main(["lint", "--fix", str(target)])
    finally:
        _ARMED.clear()
    err = capsys.readouterr().err
    assert target.read_bytes() == edit  # the edit survives; the fix is not written over it
    assert code == 2
    assert f"{target}: the file changed during --fix, so the fix was not written" in err
    assert "run `ampkit lint --fix` again" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]  # no temporary file left


def test_checker_fix_of_a_cr_only_file_keeps_its_line_endings_and_the_run_goes_on(tmp_path: Path) -> None:
    (tmp_path / "a_mac.py").write_bytes(LEGACY.replace("\n", "\r").encode() + b"x = 1\r")
    (tmp_path / "b_unix.py").write_text(LEGACY)
    report = lint_paths([str(tmp_path)], fix=True)
    assert (report.files, report.fixed, report.errors, report.violations) == (2, 2, [], [])
    assert (tmp_path / "a_mac.py").read_bytes() == b'import torch\rscaler = torch.amp.GradScaler("cuda")\rx = 1\r'
    assert (tmp_path / "b_unix.py").read_text() == 'import torch\nscaler = torch.amp.GradScaler("cuda")\n'


def test_checker_cr_only_file_reports_positions_and_noqa_by_line(tmp_path: Path) -> None:
    path = tmp_path / "mac.py"
    path.write_bytes(b"import torch\rx = 1\rs = torch.cuda.amp.GradScaler()\rt = torch.load('p')  # noqa: AMP113\r")
    report = lint_paths([str(path)])
    assert [(v.line, v.col, v.code) for v in report.violations] == [(3, 5, "AMP101")]
    assert report.lines == 4


def _broken(ctx: Any) -> Iterator[Any]:
    if b"BREAK_THE_LINTER" in ctx.source:
        raise RuntimeError("injected rule failure")
    return iter(())


def test_checker_one_file_the_linter_fails_on_does_not_stop_the_run(tmp_path: Path, capsys: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # No input is known to break a rule (each such input is a fixed bug), so the failure is
    # injected: a rule that raises on one file.
    rule = Rule(code="AMP101", name="broken", summary="raises", needs=((b"BREAK_THE_LINTER",),), check=_broken)
    monkeypatch.setattr(source, "RULES", (*source.RULES, rule))
    (tmp_path / "a.py").write_text("import torch\nBREAK_THE_LINTER = torch.load('p')\n")
    (tmp_path / "b.py").write_text("import torch\nstate = torch.load('p')\n")
    code = main(["lint", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 2
    assert f"{tmp_path / 'b.py'}:2:9: AMP113" in out and "a.py:" not in out
    assert f"{tmp_path / 'a.py'}: the linter failed on this file and did not check it (RuntimeError: " \
           "injected rule failure)" in err


def _unprivileged_python() -> list[str] | None:
    """A command running Python as the user nobody (root reads any directory, whatever its mode)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None or os.geteuid() != 0:
        return None
    for python in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        if not python:
            continue
        command = [setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups", python]
        probe = subprocess.run([*command, "-c", "import json"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return command
    return None


def test_checker_unreadable_directory_is_reported_and_the_rest_is_linted() -> None:
    command = _unprivileged_python()
    if command is None:
        pytest.skip("needs root, setpriv and a Python the user nobody can run, to make a directory "
                    "the linter cannot list")
    root = Path(tempfile.mkdtemp(prefix="ampkit-lint-"))  # not under pytest's 0700 tmp dir: nobody reads it
    try:
        root.chmod(0o755)
        (root / "ok.py").write_text("import torch\nstate = torch.load('p')\n")
        (root / "ok.py").chmod(0o644)
        locked = root / "locked"
        locked.mkdir()
        (locked / "hidden.py").write_text("import torch\nstate = torch.load('p')\n")
        locked.chmod(0o000)
        code = "import sys; from ampkit.cli.main import main; sys.exit(main(sys.argv[1:]))"
        env = {**os.environ, "PYTHONPATH": SRC}
        result = subprocess.run([*command, "-c", code, "lint", str(root)], env=env, capture_output=True,
                                text=True, timeout=60, cwd="/")
        assert result.returncode == 2, result.stderr
        assert result.stdout == f"{root / 'ok.py'}:2:9: AMP113 " + result.stdout.split(" AMP113 ", 1)[1]
        assert f"ampkit lint: error: {locked}: cannot read the directory (Permission denied); its files " \
               "were not checked" in result.stderr
    finally:
        os.chmod(root / "locked", 0o755)
        shutil.rmtree(root)
