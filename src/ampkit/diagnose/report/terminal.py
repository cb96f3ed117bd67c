"""The doctor's findings in a terminal: worst first, with ``rich`` when it is installed (plain
text otherwise, or when the stream is not a terminal), then a one-line summary."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import IO, Any

from ampkit.diagnose.core.display import finding_where, sort_findings
from ampkit.findings import Finding

__all__ = ["render_compiled", "render_terminal"]

_TAGS = {"error": "ERROR", "warning": "WARN ", "info": "INFO "}
_RICH_STYLE = {"error": "bold white on red", "warning": "bold black on yellow", "info": "bold white on blue"}


def render_terminal(findings: Sequence[Finding], file: IO[str] | None = None, *, color: bool | None = None,
                    note: str | None = None) -> None:
    """Print ``findings`` worst first, then a one-line summary that ends with ``note`` when given
    (a run that trained entirely in fp32 says so, rather than a bare "no findings").

    >>> import io
    >>> buf = io.StringIO()
    >>> render_terminal([Finding(code="PRECISION_LOSS", severity="warning", message="m", fix="f")], file=buf)
    >>> "PRECISION_LOSS" in buf.getvalue() and "1 warning" in buf.getvalue()
    True
    >>> render_terminal([], file=buf, note="the run trained entirely in fp32")
    >>> buf.getvalue().splitlines()[-1]
    'ampkit doctor: no findings; the run trained entirely in fp32'
    """
    out = file if file is not None else sys.stdout
    ordered = sort_findings(list(findings))
    use_rich = color if color is not None else (hasattr(out, "isatty") and out.isatty())
    if use_rich:
        try:
            _render_rich(ordered, out, note)
            return
        except ImportError:
            pass
    for f in ordered:
        head = f"{_TAGS[f.severity]} {f.code}"
        where = finding_where(f)
        print(f"{head}  {where}" if where else head, file=out)
        print(f"        {f.message}", file=out)
        print(f"        fix: {f.fix}", file=out)
    print(_summary(ordered, note), file=out)


def _summary(findings: Sequence[Finding], note: str | None = None) -> str:
    tail = f"; {note}" if note else ""
    if not findings:
        return f"ampkit doctor: no findings{tail}"
    counts = {s: sum(1 for f in findings if f.severity == s) for s in ("error", "warning", "info")}
    text = ", ".join(f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items() if n)
    return f"ampkit doctor: {len(findings)} finding{'s' if len(findings) != 1 else ''} ({text}){tail}"


def _render_rich(findings: Sequence[Finding], out: IO[str], note: str | None = None) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = Console(file=out, highlight=False, soft_wrap=False)
    for f in findings:
        console.print(f"[{_RICH_STYLE[f.severity]}] {f.severity.upper()} [/] [bold]{escape(f.code)}[/]  "
                      f"[cyan]{escape(finding_where(f))}[/]")
        console.print(f"    {escape(f.message)}")
        console.print(f"    [green]fix:[/] {escape(f.fix)}")
    console.print(escape(_summary(findings, note)))


def render_compiled(compiled: Sequence[dict[str, Any]], comparison: dict[str, Any] | None,
                    file: IO[str] | None = None) -> None:
    """Say which ``torch.compile`` calls ran eagerly, then the ``--compare-compiled`` table.

    >>> import io
    >>> buf = io.StringIO()
    >>> render_compiled([{"location": "train.py:9", "kind": "module", "target": "Net", "options": {}}], None, buf)
    >>> print(buf.getvalue().strip())
    ampkit doctor: the script compiles with torch.compile (Net at train.py:9); the doctor ran it eagerly, with the same inputs and weights (compare the two: --compare-compiled)
    """
    out = file if file is not None else sys.stdout
    if compiled:
        calls = ", ".join(f"{c['target']}{'.compile()' if c['kind'] == 'method' else ''} at {c['location']}"
                          for c in compiled[:4]) + (" ..." if len(compiled) > 4 else "")
        print(f"ampkit doctor: the script compiles with torch.compile ({calls}); the doctor ran it eagerly, with the "
              "same inputs and weights (compare the two: --compare-compiled)", file=out)
    if comparison is None:
        return
    options = ", ".join(f"{k}={v}" for k, v in comparison["options"].items()) or "inductor"
    print(f"ampkit doctor: compiled ({options}) vs eager, module by module "
          f"({comparison['compiles']} compiled):", file=out)
    print(f"  {'module':<28} {'dtype':>5} {'SQNR dB':>8} {'tol dB':>7} {'max abs':>9} {'max rel':>9}  result", file=out)
    for m in comparison["modules"]:
        verdict = ("DIFFERS" if m["reported"] else "differs in a submodule") if m["diverges"] else "ok"
        if m["error"]:
            verdict = f"not compared: {m['error']}"
        print(f"  {(m['module'] or '(model)'):<28} {m['dtype']:>5} {_num(m['sqnr_db']):>8} {m['tolerance_db']:>7.1f} "
              f"{_num(m['max_abs_diff']):>9} {_num(m['max_rel_diff']):>9}  {verdict}"
              + (f" ({m['worst']})" if m["diverges"] else ""), file=out)
    if comparison["not_compared"]:
        print(f"  not compared (compile budget reached): {', '.join(comparison['not_compared'])}", file=out)

def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}" if abs(v) < 1e4 or v != v or abs(v) == float("inf") else f"{v:.2e}"
