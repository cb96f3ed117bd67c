"""ampkit.verify.task: the deprecated alias of ampkit.tasks, kept for one version."""

from __future__ import annotations

import pytest

import ampkit.tasks


def test_task_alias_warns_and_returns_the_moved_names() -> None:
    import ampkit.verify.task as alias

    for name in alias.__all__:
        with pytest.warns(DeprecationWarning, match=f"ampkit.verify.task.{name} moved to ampkit.tasks.{name}"):
            assert getattr(alias, name) is getattr(ampkit.tasks, name)


def test_task_alias_unknown_name_is_an_attribute_error() -> None:
    import ampkit.verify.task as alias

    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        alias.nope  # noqa: B018 - the attribute access is the test
