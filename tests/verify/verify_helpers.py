"""Helpers for the verify tests: real `ampkit verify` jobs on the small tasks of synthetic_tasks.py.

The session fixtures (``verify_seed``, ``regression_job``, ``regression_job_again``) are defined
here and exposed by tests/verify/conftest.py and tests/cli/conftest.py; each job runs once per
session however many conftest files expose it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from ampkit.cli.main import main
from ampkit.verify.harness import VerifyConfig, run_verify
from ampkit.verify.report import write_report

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



J = TypeVar("J", bound=Job)
_SESSION_JOBS: dict[str, Any] = {}


def _once(name: str, make: Callable[[], J]) -> J:
    if name not in _SESSION_JOBS:
        _SESSION_JOBS[name] = make()
    job: J = _SESSION_JOBS[name]
    return job


@pytest.fixture(scope="session")
def verify_seed() -> int:
    """The seed of the shared regression jobs (the suite's `seed` fixture is per test)."""
    return 7


@pytest.fixture(scope="session")
def regression_job(tmp_path_factory: pytest.TempPathFactory, verify_seed: int) -> Job:
    """fp32 + bf16 on the regression task (environment measured, as in a user's run)."""

    def make() -> Job:
        out = tmp_path_factory.mktemp("regression")
        code = main(["verify", task_ref("Regression"), "--precisions", "fp32,bf16", "--seed", str(verify_seed),
                     "--out", str(out), "--no-progress"])
        return Job(code, out)

    return _once("regression", make)


@pytest.fixture(scope="session")
def regression_job_again(tmp_path_factory: pytest.TempPathFactory, verify_seed: int) -> LibraryJob:
    """The same job through the library API (run_verify + write_report), recording progress events."""

    def make() -> LibraryJob:
        out = tmp_path_factory.mktemp("regression-again")
        config = VerifyConfig(task=task_ref("Regression"), precisions=("fp32", "bf16"), seed=verify_seed,
                              measure_env=False)
        events: list[tuple[str, dict[str, Any]]] = []
        report = run_verify(config, on_progress=lambda p, e: events.append((p, e)))
        write_report(report, out)
        return LibraryJob(0 if report["verdict"] == "pass" else 1, out, events)

    return _once("regression-again", make)
