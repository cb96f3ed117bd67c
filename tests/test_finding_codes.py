"""Finding codes are a typed set: the ``Code`` literal and the severity table name the same codes,
and a misspelled code fails the type check (`make test` runs mypy over src/, whose emitters pass
literal codes) instead of a user's run at its end."""

from __future__ import annotations

from typing import get_args

import pytest

from ampkit.findings import CODES, Code, Finding


def test_finding_codes_literal_and_severity_table_name_the_same_codes() -> None:
    assert list(get_args(Code)) == list(CODES)


def test_finding_codes_unknown_code_still_refused_at_run_time() -> None:
    with pytest.raises(ValueError, match="unknown finding code 'FORWARD_OVERFLWO'"):
        Finding(code="FORWARD_OVERFLWO", severity="error", message="m", fix="f")  # type: ignore[arg-type]
