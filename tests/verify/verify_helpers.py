"""Helpers for the verify tests: real `ampkit verify` jobs on the small tasks of synthetic_tasks.py."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ampkit.cli.main import main

SYNTHETIC = Path(__file__).with_name("synthetic_tasks.py")


def task_ref(attr: str) -> str:
    return f"{SYNTHETIC}:{attr}"


@dataclass
class Job:
    code: int
    out: Path

    @property
    def report(self) -> dict[str, Any]:
        return json.loads((self.out / "report.json").read_text())

    def run(self, precision: str) -> dict[str, Any]:
        return next(r for r in self.report["runs"] if r["precision"] == precision)

    def comparison(self, precision: str) -> dict[str, Any]:
        return next(c for c in self.report["comparison"] if c["precision"] == precision)


def verify(out: Path, *args: str) -> Job:
    """Run `ampkit verify ARGS --out OUT` through the real CLI entry point (workers are real processes)."""
    code = main(["verify", *args, "--out", str(out), "--no-progress", "--no-measure-env"])
    return Job(code, out)


@dataclass
class LibraryJob(Job):
    events: list[tuple[str, dict[str, Any]]]


def cli_command(*args: str) -> list[str]:
    """The `ampkit` command as a fresh interpreter runs it (same as the console script)."""
    return [sys.executable, "-c", "import sys; from ampkit.cli.main import main; sys.exit(main(sys.argv[1:]))", *args]

