"""Shared fixtures: real `ampkit verify` jobs, run once per session."""

from __future__ import annotations

from typing import Any

import pytest
from verify_helpers import Job, LibraryJob, task_ref

from ampkit.cli.main import main
from ampkit.verify.harness import VerifyConfig, run_verify
from ampkit.verify.report import write_report


@pytest.fixture(scope="session")
def verify_seed() -> int:
    """The seed of the shared regression jobs (the suite's `seed` fixture is per test)."""
    return 7


@pytest.fixture(scope="session")
def regression_job(tmp_path_factory: pytest.TempPathFactory, verify_seed: int) -> Job:
    """fp32 + bf16 on the regression task (environment measured, as in a user's run)."""
    out = tmp_path_factory.mktemp("regression")
    code = main(["verify", task_ref("Regression"), "--precisions", "fp32,bf16", "--seed", str(verify_seed),
                 "--out", str(out), "--no-progress"])
    return Job(code, out)


@pytest.fixture(scope="session")
def regression_job_again(tmp_path_factory: pytest.TempPathFactory, verify_seed: int) -> LibraryJob:
    """The same job through the library API (run_verify + write_report), recording progress events."""
    out = tmp_path_factory.mktemp("regression-again")
    config = VerifyConfig(task=task_ref("Regression"), precisions=("fp32", "bf16"), seed=verify_seed, measure_env=False)
    events: list[tuple[str, dict[str, Any]]] = []
    report = run_verify(config, on_progress=lambda p, e: events.append((p, e)))
    write_report(report, out)
    return LibraryJob(0 if report["verdict"] == "pass" else 1, out, events)
