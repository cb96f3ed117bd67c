"""``ampkit.lint.checker``: code selection, files on disk, ``--fix`` writes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from ampkit.lint import ALL_CODES, lint_file, lint_paths, lint_source, parse_codes


def test_checker_selection_keeps_amp000_unless_ignored() -> None:
    assert parse_codes("AMP113", None) == {"AMP000", "AMP113"}
    assert "AMP000" not in parse_codes(None, "AMP000")
    assert lint_source("def f(:\n", codes=parse_codes(None, "AMP000")) == []
    assert parse_codes("ALL", None) == ALL_CODES
    assert parse_codes("amp11", None) == {"AMP000", "AMP110", "AMP111", "AMP112", "AMP113", "AMP114",
                                          "AMP115", "AMP116", "AMP117", "AMP118", "AMP119"}




def test_checker_unreadable_file_is_reported_not_raised(tmp_path: Path) -> None:
    violations, fixed, lines = lint_file(str(tmp_path / "gone.py"))
    assert (fixed, lines) == (0, 0)
    assert [v.code for v in violations] == ["AMP000"]
    assert "cannot read the file" in violations[0].message


def test_checker_fix_writes_through_a_symlink_and_keeps_the_mode(tmp_path: Path) -> None:
    target = tmp_path / "real.py"
    target.write_text("import torch\nscaler = torch.cuda.amp.GradScaler()\n")
    target.chmod(0o751)
    link = tmp_path / "link.py"
    link.symlink_to(target)
    report = lint_paths([str(link)], fix=True)
    assert (report.files, report.fixed, report.violations) == (1, 1, [])
    assert link.is_symlink()
    assert target.read_text() == 'import torch\nscaler = torch.amp.GradScaler("cuda")\n'
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o751
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.py", "real.py"]


def test_checker_fix_leaves_a_file_without_amp101_untouched(tmp_path: Path) -> None:
    target = tmp_path / "t.py"
    target.write_text("import torch\nx = torch.load('p')\n")
    before = target.stat().st_mtime_ns
    violations, fixed, lines = lint_file(str(target), fix=True)
    assert ([v.code for v in violations], fixed, lines) == (["AMP113"], 0, 2)
    assert target.stat().st_mtime_ns == before


def test_checker_directory_walk_skips_a_fifo_named_py(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "a_pipe.py")  # opening it would block until a writer appears
    (tmp_path / "real.py").write_text("import torch\nx = torch.load('p')\n")
    src = str(Path(__file__).resolve().parents[2] / "src")
    code = ("import sys; from ampkit.lint import lint_paths; r = lint_paths([sys.argv[1]]); "
            "print(r.files, [v.code for v in r.violations])")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True,
                            text=True, timeout=30)
    assert result.stdout == "1 ['AMP113']\n", result.stderr
