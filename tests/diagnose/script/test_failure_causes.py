"""The script doctor's failure kinds and causes are closed sets, each cause explained by SCALE_COLLAPSE."""

from __future__ import annotations

from typing import get_args

from ampkit.diagnose.script.state import FailureCause, SkipCause
from ampkit.findings import SCALE_COLLAPSE_CAUSES


def _names(literal: object) -> set[str]:
    """The strings of a Literal, or of a union of Literals."""
    args = get_args(literal)
    return {a for a in args if isinstance(a, str)} | {n for a in args if not isinstance(a, str) for n in _names(a)}


def test_failure_causes_are_skip_causes_and_each_has_a_scale_collapse_text() -> None:
    causes = _names(SkipCause)
    assert _names(FailureCause) < causes
    assert causes - _names(FailureCause) == {"nonfinite_forward", "gradient_singularity"}
    # rules._scale_collapse looks every skip's cause up in this table: a cause without an entry would raise.
    assert causes <= set(SCALE_COLLAPSE_CAUSES)
