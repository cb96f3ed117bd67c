"""Golden fixtures: every ``AMPnnn_<name>_{pos,neg}.py`` under fixtures/ is linted with all rules
and must produce exactly the ``line:col CODE message`` lines of its ``.txt`` twin, so a changed
position, code or message fails here.

After a deliberate change of the linter, ``python tests/lint/test_fixtures.py`` rewrites every
``.txt`` from the current output; read the diff before committing it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ampkit.lint import RULES, lint_source

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN_LINE = re.compile(r"[0-9]+:[0-9]+ AMP[0-9]{3} \S.*")
CASES = sorted(FIXTURES.glob("AMP[0-9][0-9][0-9]_*_pos.py")) + sorted(FIXTURES.glob("AMP[0-9][0-9][0-9]_*_neg.py"))


def _code(path: Path) -> str:
    return path.name.split("_", 1)[0]


def _golden(fixture: Path) -> list[str]:
    """The linter's output on ``fixture`` in the golden format, one ``line:col CODE message`` a violation."""
    return [f"{v.line}:{v.col} {v.code} {v.message}" for v in lint_source(fixture.read_bytes(), fixture.name)]


@pytest.mark.parametrize("fixture", CASES, ids=[p.stem for p in CASES])
def test_fixtures_match_golden_output(fixture: Path) -> None:
    expected = fixture.with_suffix(".txt").read_text().splitlines()
    assert _golden(fixture) == expected


@pytest.mark.parametrize("fixture", CASES, ids=[p.stem for p in CASES])
def test_fixtures_golden_lines_carry_the_message(fixture: Path) -> None:
    text = fixture.with_suffix(".txt").read_text()
    assert text == "" or text.endswith("\n")
    for line in text.splitlines():
        assert GOLDEN_LINE.fullmatch(line), f"not `line:col CODE message`: {line!r}"


@pytest.mark.parametrize("fixture", [p for p in CASES if p.stem.endswith("_pos")],
                         ids=[p.stem for p in CASES if p.stem.endswith("_pos")])
def test_fixtures_positive_case_hits_its_own_rule(fixture: Path) -> None:
    codes = {line.split()[1] for line in fixture.with_suffix(".txt").read_text().splitlines()}
    assert _code(fixture) in codes


@pytest.mark.parametrize("fixture", [p for p in CASES if p.stem.endswith("_neg")],
                         ids=[p.stem for p in CASES if p.stem.endswith("_neg")])
def test_fixtures_negative_case_is_clean(fixture: Path) -> None:
    assert fixture.with_suffix(".txt").read_text() == ""


def test_fixtures_cover_every_rule_both_ways() -> None:
    positives = {_code(p) for p in CASES if p.stem.endswith("_pos")}
    negatives = {_code(p) for p in CASES if p.stem.endswith("_neg")}
    codes = {rule.code for rule in RULES}
    assert codes <= positives, f"rules without a positive fixture: {sorted(codes - positives)}"
    assert codes <= negatives, f"rules without a negative fixture: {sorted(codes - negatives)}"


def test_fixtures_golden_files_have_their_source() -> None:
    orphans = [t.name for t in FIXTURES.glob("AMP*.txt") if not t.with_suffix(".py").exists()]
    assert orphans == []


if __name__ == "__main__":
    for case in CASES:
        case.with_suffix(".txt").write_text("".join(f"{line}\n" for line in _golden(case)))
