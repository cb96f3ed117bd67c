"""The HTML reports in a real browser: headless Chromium, skipped where it is not installed."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def chromium() -> str:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)")


def has_chromium() -> bool:
    return any(shutil.which(n) for n in CHROMIUM_NAMES)


def dump_dom(html_file: Path, *flags: str) -> tuple[str, str]:
    """Load the page in headless Chromium; return the DOM after rendering and the browser's log."""
    proc = subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--enable-logging=stderr",
         "--v=0", "--virtual-time-budget=2000", *flags, "--dump-dom", html_file.resolve().as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, proc.stderr


def page_errors(log: str) -> list[str]:
    """Console messages (script errors, CSP refusals such as a blocked network load) from Chromium's log."""
    return [line for line in log.splitlines() if "CONSOLE" in line or "Refused to" in line]


_PROBE = """<!DOCTYPE html><html><body>
<iframe id="page" src="{src}" style="width:1280px;height:6000px;border:0"></iframe><pre id="probe"></pre>
<script>
document.getElementById("page").addEventListener("load", () => {{
  const doc = document.getElementById("page").contentDocument;
  document.getElementById("probe").textContent = JSON.stringify(({expression}));
}});
</script></body></html>
"""


def probe_page(html_file: Path, expression: str) -> tuple[Any, str]:
    """Evaluate a JavaScript ``expression`` over ``doc``, the page as Chromium laid it out, and return its JSON value
    and the browser's log.

    The page is loaded unchanged (its own Content-Security-Policy forbids scripts) into an iframe of a probe
    page in a folder of its own, whose script reads the laid-out document (``innerText``, boxes) once it has loaded.
    """
    with tempfile.TemporaryDirectory() as folder:
        probe = Path(folder) / "probe.html"
        probe.write_text(_PROBE.format(src=html_file.resolve().as_uri(), expression=expression))
        dom, log = dump_dom(probe, "--allow-file-access-from-files")  # the iframe's file:// document is readable
    match = re.search(r'<pre id="probe">(.*?)</pre>', dom, flags=re.DOTALL)
    assert match and match.group(1), f"the probe found no loaded page: {dom[:500]}"
    return json.loads(html.unescape(match.group(1))), log
