"""``ampkit.lint.source``: one file's source: positions, encodings, unparsable input, ``# noqa``."""

from __future__ import annotations

import codecs
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ampkit.lint import lint_source
from ampkit.lint.source import ALL_CODES, check_source, unparsable


def test_source_columns_count_characters_not_bytes() -> None:
    source = "import torch\nlabel = 'µ-β'; state = torch.load('é.pt')\n"
    (violation,) = lint_source(source)
    assert (violation.line, violation.col, violation.code) == (2, 24, "AMP113")
    assert source.splitlines()[1][violation.col - 1:].startswith("torch.load")


def test_source_reads_a_utf8_bom_file() -> None:
    source = codecs.BOM_UTF8 + b"import torch\nstate = torch.load('x.pt')\n"
    assert [(v.line, v.col, v.code) for v in lint_source(source)] == [(2, 9, "AMP113")]


def test_source_reports_null_bytes_as_unparsable() -> None:
    (violation,) = lint_source(b"import torch\x00\n")
    assert violation.code == "AMP000"
    assert "null bytes" in violation.message


def test_source_syntax_error_points_at_the_error() -> None:
    (violation,) = lint_source("import torch\n\nx = (1,\n")
    assert (violation.code, violation.line) == ("AMP000", 3)
    assert violation.message.startswith("syntax error: ")


@pytest.mark.parametrize("source", [
    "return 1\n",  # no rule wants this file: checked by compile()
    "import torch\nstate = torch.load('x', weights_only=True)\nreturn state\n",  # parsed by ast.parse
])
def test_source_syntax_error_means_does_not_parse(source: str) -> None:
    # `return` outside a function is refused by compile() but parses: not AMP000, either way.
    assert lint_source(source) == []


def test_source_noqa_on_another_line_does_not_count() -> None:
    # The directive must be a comment on the reported line; other lines' comments do not count.
    source = "import torch\n# noqa: AMP113\nstate = torch.load('x.pt')\n"
    assert [v.code for v in lint_source(source)] == ["AMP113"]


FIXTURES = Path(__file__).parent / "fixtures"


def test_source_survives_every_one_line_deletion_of_the_fixtures() -> None:
    # Partial programs (a loop without its body, a call without its receiver) reach code paths
    # the well-formed fixtures do not; every one must give violations or AMP000, never an exception.
    checked = 0
    for fixture in sorted(FIXTURES.glob("*.py")):
        lines = fixture.read_text().splitlines(keepends=True)
        for drop in range(len(lines)):
            source = "".join(lines[:drop] + lines[drop + 1:])
            for v in lint_source(source, fixture.name):
                assert v.line >= 1 and v.col >= 1 and v.code.startswith("AMP")
            checked += 1
    assert checked > 500


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_source_never_raises_on_arbitrary_bytes(data: bytes) -> None:
    for v in lint_source(data):
        assert v.line >= 1 and v.col >= 1


def test_source_check_returns_the_parsed_context_only_when_a_rule_ran() -> None:
    violations, ctx = check_source(b"import torch\nscaler = torch.cuda.amp.GradScaler()\n", "t.py", ALL_CODES)
    assert [v.code for v in violations] == ["AMP101"]
    assert ctx is not None and ctx.path == "t.py"
    assert check_source(b"x = 1\n", "t.py", ALL_CODES) == ([], None)  # no rule wanted it: compile() only
    assert check_source(b"def f(:\n", "t.py", frozenset({"AMP101"}))[1] is None


def test_source_unparsable_is_silent_unless_amp000_is_selected() -> None:
    (violation,) = unparsable("t.py", "bad", 2, 0, ALL_CODES)
    assert (violation.line, violation.col, violation.code) == (2, 1, "AMP000")
    assert violation.message == "syntax error: bad; the file was not checked"
    assert unparsable("t.py", "bad", 2, 0, frozenset({"AMP101"})) == []
