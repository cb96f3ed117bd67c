"""Run inline training code under the script doctor's watchers (a test helper)."""

from __future__ import annotations

from pathlib import Path

from ampkit._util.frames import UserFrames
from ampkit.diagnose.script.context import Context
from ampkit.diagnose.script.patches import PatchSet
from ampkit.diagnose.script.rules import finalize


def observe(fn: object) -> Context:
    """Run ``fn`` under the observers (this test file is the user code) and evaluate the end rules."""
    ctx = Context(UserFrames([Path(__file__).parent]))
    patches = PatchSet()
    ctx.install(patches)
    try:
        fn()  # type: ignore[operator]
    finally:
        patches.restore()
    finalize(ctx, measure_speed=False)
    return ctx
