"""The HTML reports' one way to write markup: Jinja2 templates from ``ampkit/templates/``, autoescaped.

Every value a template prints is HTML-escaped by Jinja2's autoescaping (``markupsafe``), so a
report needs no escaping call of its own and a name from user code can never become markup.
HTML that ampkit generated itself and must go in as it is (a matplotlib SVG chart) is wrapped
with ``trusted`` at one place, whose comment says why it is safe.

Jinja2 ships with the ``report`` extra (``pip install 'ampkit[report]'``) and is imported on the
first render only, so ``import ampkit`` stays cheap.

>>> _environment().from_string("<b>{{ name }}</b>").render(name='<script>alert("x")</script>')
'<b>&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;</b>'
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jinja2
    from markupsafe import Markup

__all__ = ["render", "trusted"]


def render(name: str, /, **context: Any) -> str:
    """The template ``ampkit/templates/NAME`` rendered with ``context`` (every value escaped)."""
    return _environment().get_template(name).render(**context)


def trusted(html: str) -> Markup:
    """``html`` marked as markup that autoescaping passes through unchanged (``markupsafe.Markup``).

    Only for HTML that ampkit generated itself with every user string already escaped; the caller
    says why in a comment.
    """
    _environment()  # the ImportError that names the extra, before markupsafe's own
    from markupsafe import Markup

    return Markup(html)


# Cached: the environment keeps each template compiled after its first use; a new environment per
# render would parse and compile the template again (milliseconds, on every report written).
@functools.cache
def _environment() -> jinja2.Environment:
    try:
        import jinja2
    except ImportError as exc:
        raise ImportError(
            "ampkit's HTML reports are rendered with Jinja2; install it with `pip install 'ampkit[report]'`"
        ) from exc
    return jinja2.Environment(
        loader=jinja2.PackageLoader("ampkit", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,  # a misspelled name fails the render instead of printing nothing
        trim_blocks=True,  # a line holding only a {% block tag %} leaves no empty line in the page
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
