"""launch_torchrun and scaling_efficiency, and errors raised before any process group exists."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import ampkit
import ampkit.distributed as ad
from tests.helpers.processes import running

from ._dist_testlib import HERE, launch
from ._orphans import reaping, survivors, wait_for_ranks


def test_distributed_scaling_efficiency_strong_and_weak():
    assert ad.scaling_efficiency(10.0, 5.0, 2) == 1.0
    assert ad.scaling_efficiency(10.0, 6.25, 2) == 0.8
    assert ad.scaling_efficiency(10.0, 10.0, 8, scaling="weak") == 1.0
    assert ad.scaling_efficiency(10.0, 20.0, 8, scaling="weak") == 0.5
    assert ad.scaling_efficiency(3.0, 3.0, 1) == 1.0


@pytest.mark.parametrize(
    ("args", "kwargs", "needle"),
    [
        ((0.0, 1.0, 2), {}, "t1"),
        ((1.0, float("nan"), 2), {}, "tN"),
        ((1.0, 1.0, 0), {}, "n=0"),
        ((1.0, 1.0, 2), {"scaling": "linear"}, "strong"),
    ],
)
def test_distributed_scaling_efficiency_rejects_bad_input(args, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ad.scaling_efficiency(*args, **kwargs)


@pytest.mark.parametrize(
    ("nproc", "module", "timeout", "needle"),
    [
        (0, "pkg.train", 10.0, "nproc"),
        (2, "train.py", 10.0, "importable module"),
        (2, "pkg/train", 10.0, "importable module"),
        (2, "pkg.train", 0, "timeout"),
    ],
)
def test_distributed_launch_torchrun_rejects_bad_arguments(nproc, module, timeout, needle):
    with pytest.raises(ValueError, match=needle):
        ad.launch_torchrun(nproc, module, [], timeout)


def test_distributed_setup_without_process_group_says_how_to_start_one():
    mp = ampkit.MixedPrecision("bf16", device="cpu")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ad.setup(mp)


def test_distributed_public_names_resolve():
    assert sorted(ad.__all__) == sorted(ad._LAZY)
    for name in ad.__all__:
        assert getattr(ad, name) is not None


# Long enough for torchrun and both ranks to start (each imports torch: about 5 s on 2 busy cores),
# short because the test waits all of it.
SLEEPER_TIMEOUT_S = 12.0


@pytest.mark.slow
def test_distributed_launch_torchrun_timeout_kills_every_process(tmp_path):
    result = launch("dist_sleeper", [], tmp_path, timeout=SLEEPER_TIMEOUT_S)
    assert result.timed_out and not result.ok
    pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in range(2)]  # both workers had started
    for rank, pid in enumerate(pids):
        assert "started" in result.ranks[rank].stdout
        assert not running(pid), f"rank {rank} (pid {pid}) outlived the timeout"
    assert result.wall_s < SLEEPER_TIMEOUT_S + 2 * 10.0 + 5.0  # the timeout, then SIGTERM's and SIGKILL's grace
    assert "timed out" in result.describe()


@pytest.mark.slow
def test_distributed_launch_torchrun_reports_each_rank_exit_code(kill_and_resume):
    killed, resumed, _, _ = kill_and_resume
    assert resumed.exit_codes == [0, 0] and resumed.ok
    assert killed.exit_codes[1] == -9 and killed.ranks[1].signal == "SIGKILL"
    assert "SIGKILL while writing shards" in killed.ranks[1].stdout
    assert not killed.ok and "rank 1: SIGKILL" in killed.describe()


@pytest.mark.slow
def test_distributed_launch_torchrun_destroy_process_group_frees_gloo_before_exit(tmp_path):
    # The rank imports ampkit's engine after init_process_group (as every training script does);
    # destroy_process_group must still end the gloo threads, or they are torn down during
    # interpreter shutdown and can abort a rank that already reported exit code 0.
    result = launch("dist_teardown", [], tmp_path)
    assert result.ok, result.describe() + "\n" + "\n".join(r.stdout for r in result.ranks)
    for rank in result.ranks:
        assert "gloo threads after destroy_process_group: []" in rank.stdout


def _kill_launching_parent(tmp_path: Path, sig: signal.Signals) -> tuple[int | None, list[int], list[str]]:
    """Start a process that calls launch_torchrun on 2 sleeping ranks, send it ``sig`` once both
    ranks run; return its exit status, the launch processes still running 15 s later, and the
    ranks' stdout."""
    parent = subprocess.Popen([sys.executable, str(HERE / "dist_launch_parent.py"), str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids: list[int] = []
    with reaping(parent, pids):
        torchrun, ranks = wait_for_ranks(tmp_path, 2, parent, ready="started")
        pids += [torchrun, *ranks]
        os.kill(parent.pid, sig)
        code = parent.wait(timeout=60)
        left = survivors(pids)
        return code, left, [(tmp_path / f"rank{r}.stdout").read_text() for r in range(2)]


def test_distributed_launch_torchrun_sigkill_of_the_parent_kills_torchrun_and_every_rank(tmp_path):
    code, left, _ = _kill_launching_parent(tmp_path, signal.SIGKILL)
    assert code == -signal.SIGKILL
    assert left == [], f"still running after the parent was SIGKILLed: {left}"


def test_distributed_launch_torchrun_sigterm_of_the_parent_stops_every_rank_then_dies_by_sigterm(tmp_path):
    code, left, stdouts = _kill_launching_parent(tmp_path, signal.SIGTERM)
    assert left == [], f"still running after the parent got SIGTERM: {left}"
    assert code == -signal.SIGTERM  # the caller still sees a death by SIGTERM
    for rank, out in enumerate(stdouts):  # passed on in order, not killed
        assert "stopped by SIGTERM" in out, (rank, out)


def test_distributed_launch_torchrun_sigkill_of_torchrun_kills_every_rank(tmp_path):
    parent = subprocess.Popen([sys.executable, str(HERE / "dist_launch_parent.py"), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    pids: list[int] = []
    with reaping(parent, pids):
        torchrun, ranks = wait_for_ranks(tmp_path, 2, parent, ready="started")
        pids += [torchrun, *ranks]
        os.kill(torchrun, signal.SIGKILL)
        assert survivors(ranks) == [], "a rank outlived its SIGKILLed torchrun"
        out, _ = parent.communicate(timeout=60)  # and launch_torchrun returns, with the ranks' fate
        assert parent.returncode == 0 and "torchrun exit -9" in out, out
