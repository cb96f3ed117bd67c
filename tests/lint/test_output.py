"""``ampkit.lint.output``: the text, ``ampkit.lint/1`` JSON and GitHub renderings of a report."""

from __future__ import annotations

import json

import pytest

from ampkit.lint import LintReport, Violation
from ampkit.lint.output import FORMATS, SCHEMA, render, summary

V1 = Violation("a.py", 2, 5, "AMP113", "pass weights_only=True")
V2 = Violation("b,c:d.py", 1, 1, "AMP101", "100% deprecated\nuse torch.amp")


def test_output_json_document_carries_schema_counts_and_records() -> None:
    document = json.loads(render(LintReport([V1], files=3, fixed=2), "json"))
    assert document == {"schema": SCHEMA, "violations": [V1.to_json()], "files_checked": 3, "fixed": 2}
    assert SCHEMA == "ampkit.lint/1"


def test_output_text_is_one_line_per_violation_and_empty_when_clean() -> None:
    assert render(LintReport([V1]), "text") == "a.py:2:5: AMP113 pass weights_only=True\n"
    assert render(LintReport(), "text") == ""
    assert render(LintReport(), "github") == ""


def test_output_github_escapes_properties_and_data() -> None:
    assert render(LintReport([V2]), "github") == (
        "::error file=b%2Cc%3Ad.py,line=1,col=1,title=AMP101::100%25 deprecated%0Ause torch.amp\n")


def test_output_unknown_format_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="choose one of text, json, github"):
        render(LintReport(), "xml")
    assert FORMATS == ("text", "json", "github")


def test_output_summary_counts_files_violations_and_fixes() -> None:
    assert summary(LintReport(files=2)) == "ampkit lint: 2 file(s) checked, no violations"
    assert summary(LintReport(files=2, fixed=1)) == "ampkit lint: 2 file(s) checked, no violations; fixed 1"
    report = LintReport([V1, V1, V2], files=4)
    assert summary(report) == "ampkit lint: 3 violation(s) in 2 file(s), 4 file(s) checked"


def test_output_text_keeps_a_crafted_file_name_on_its_line() -> None:
    # a name with a newline followed by a workflow command, and one that is itself a command
    crafted = Violation("x\n::error file=ci.yml::pwned.py", 1, 1, "AMP101", "msg\n::warning::also")
    leading = Violation("::error::a.py", 2, 3, "AMP101", "msg")
    lines = render(LintReport([crafted, leading]), "text").splitlines()
    assert len(lines) == 2 and not any(line.startswith("::") for line in lines)
    assert lines[0] == "x\\n::error file=ci.yml::pwned.py:1:1: AMP101 msg\\n::warning::also"
    assert lines[1] == "./::error::a.py:2:3: AMP101 msg"
