"""The HTML reports' template helper: autoescaping, trusted markup, the missing-extra error."""

from __future__ import annotations

import re
import sys

import pytest

from ampkit._util import templates


def test_templates_escape_a_value_and_pass_trusted_markup_as_it_is() -> None:
    page = templates._environment().from_string("<p>{{ name }}</p>{{ chart }}")
    assert page.render(name='<script>"x"', chart=templates.trusted("<svg/>")) == "<p>&lt;script&gt;&#34;x&#34;</p><svg/>"


def test_templates_render_without_jinja2_names_the_report_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "jinja2", None)  # makes `import jinja2` fail as if not installed
    templates._environment.cache_clear()
    try:
        with pytest.raises(ImportError, match=re.escape("pip install 'ampkit[report]'")):
            templates.render("doctor_report.html")
    finally:
        templates._environment.cache_clear()  # the next render builds the environment with the real jinja2
