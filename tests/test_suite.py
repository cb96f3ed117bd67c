"""The suite's own table: tests/conftest.py NUMERICS names tests that exist, so a renamed test keeps
its second run on the emulated AVX2 CPU instead of losing it silently."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_suite_numerics_table_names_only_existing_tests(pytestconfig: pytest.Config) -> None:
    conftest = pytestconfig.pluginmanager.get_plugin(str(Path(__file__).with_name("conftest.py")))
    assert conftest is not None
    assert conftest.numerics_table_stale() == [], (
        "tests/conftest.py NUMERICS names tests that do not exist; update the table where a test module "
        "or test was renamed or removed")
