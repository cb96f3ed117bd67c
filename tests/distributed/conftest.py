"""Launches shared by the distributed tests: each runs many scenarios on 2 gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from ampkit.distributed import TorchrunResult

from ._dist_testlib import Loader, launch, loader


@pytest.fixture(scope="session")
def main_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[TorchrunResult, Loader]:
    """Every scenario of the main phase, in one torchrun launch."""
    root = tmp_path_factory.mktemp("dist-main")
    result = launch("dist_scenarios", ["--out", str(root / "out"), "--phase", "main"], root / "logs")
    if not result.ok:
        pytest.fail("the main distributed launch failed:\n" + result.describe())
    return result, loader(root / "out")


@pytest.fixture(scope="session")
def kill_and_resume(tmp_path_factory: pytest.TempPathFactory) -> tuple[TorchrunResult, TorchrunResult, Loader, Path]:
    """Launch 1 trains, checkpoints at step 10 and loses rank 1 to SIGKILL; launch 2 resumes."""
    root = tmp_path_factory.mktemp("dist-kill")
    out = root / "out"
    killed = launch("dist_scenarios", ["--out", str(out), "--phase", "kill"], root / "logs-kill")
    resumed = launch("dist_scenarios", ["--out", str(out), "--phase", "resume"], root / "logs-resume")
    if not resumed.ok:
        pytest.fail("the resume launch failed:\n" + resumed.describe() + "\n\nthe killed launch:\n" + killed.describe())
    return killed, resumed, loader(out), out
