"""The README's quick-start loop runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_quickstart_runs() -> None:
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python block"
    quickstart = blocks[0]
    namespace: dict = {}
    exec(compile(quickstart, str(README), "exec"), namespace)  # the README is our own file
    mp = namespace["mp"]
    assert mp.optimizer_steps == 2
    assert namespace["state"]["scaler"]["scale"] > 0
