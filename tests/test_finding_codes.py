"""Finding codes are a typed set: the ``Code`` literal and the severity table name the same codes,
and a misspelled code fails the type check instead of a user's run at its end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

from ampkit.findings import CODES, Code, Finding

ROOT = Path(__file__).resolve().parents[1]


def test_finding_codes_literal_and_severity_table_name_the_same_codes() -> None:
    assert list(get_args(Code)) == list(CODES)


def _mypy(tmp_path: Path, code: str) -> subprocess.CompletedProcess[str]:
    # One file per code: mypy's cache keys a file by its path, size and mtime, which two spellings of
    # the same length written within a second share.
    script = tmp_path / f"emitter_{code.lower()}.py"
    script.write_text("from ampkit.findings import Finding\n\n"
                      f'Finding(code="{code}", severity="error", message="m", fix="f")\n')
    return subprocess.run([sys.executable, "-m", "mypy", str(script)], cwd=ROOT, capture_output=True, text=True,
                          check=False, timeout=600)


def test_finding_codes_misspelled_code_fails_the_type_check(tmp_path: Path) -> None:
    good, bad = _mypy(tmp_path, "FORWARD_OVERFLOW"), _mypy(tmp_path, "FORWARD_OVERFLWO")
    assert good.returncode == 0, good.stdout + good.stderr
    assert bad.returncode == 1 and "FORWARD_OVERFLWO" in bad.stdout and "[arg-type]" in bad.stdout


def test_finding_codes_unknown_code_still_refused_at_run_time() -> None:
    with pytest.raises(ValueError, match="unknown finding code 'FORWARD_OVERFLWO'"):
        Finding(code="FORWARD_OVERFLWO", severity="error", message="m", fix="f")  # type: ignore[arg-type]
