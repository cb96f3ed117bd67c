"""The HTML reports' charts as inline SVG strings: matplotlib on the Agg backend, no files, no network.

Text stays text (``svg.fonttype: none``), which matplotlib writes XML-escaped (comments too), and
``svg_markup`` drops the comments that repeat each string; ``literal`` escapes ``$`` in names from
user code so it is printed, not parsed as mathtext.  Each figure gets its own ``svg.hashsalt`` so
element ids never collide when several SVGs share one HTML page.  A report passes the markup to its
template through ``ampkit._util.templates.trusted`` at one place, with this reasoning in a comment.

matplotlib ships with the ``report`` extra (``pip install 'ampkit[report]'``) and is imported on the
first chart only, so ``import ampkit`` stays cheap.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["figure", "literal", "pyplot", "svg_markup"]


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display, whatever backend the user's session set)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(
            "ampkit's HTML reports draw their charts with matplotlib; install it with `pip install 'ampkit[report]'`"
        ) from exc
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


@contextmanager
def figure(name: str, *, ncols: int = 1, width: float = 6.4, height: float = 3.1,
           style: dict[str, Any] | None = None) -> Iterator[tuple[Any, Any]]:
    """A figure with ``ncols`` axes side by side, drawn under ``style`` (matplotlib rc settings) and closed after.

    ``name`` salts the SVG's element ids, so give each chart of a page its own."""
    plt = pyplot()
    import matplotlib

    rc: dict[str, Any] = {"svg.fonttype": "none", "svg.hashsalt": f"ampkit-{name}", "font.size": 9, **(style or {})}
    with matplotlib.rc_context(rc):  # type: ignore[arg-type]
        fig, axes = plt.subplots(1, ncols, figsize=(width, height), squeeze=False)
        try:
            yield fig, axes[0]
        finally:
            plt.close(fig)


def svg_markup(fig: Any) -> str:
    """The figure as an ``<svg>`` element to inline in HTML: no XML declaration, doctype or comments."""
    buf = io.StringIO()
    fig.tight_layout()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": "ampkit"})
    text = buf.getvalue()
    text = re.sub(r"<\?xml[^>]*\?>\s*", "", text)
    text = re.sub(r"<!DOCTYPE[^>]*>\s*", "", text)
    # matplotlib annotates each text element with its source string in a comment; drop them (smaller
    # page, and no user string outside an element whose content is escaped).
    text = re.sub(r"<!--.*?-->\s*", "", text, flags=re.DOTALL)
    return text.strip()


def literal(text: str) -> str:
    """A user-derived string as literal chart text (no mathtext).

    >>> literal("loss in $")
    'loss in \\\\$'
    """
    return text.replace("$", r"\$")
