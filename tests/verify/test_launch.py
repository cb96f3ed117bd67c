"""`ampkit verify --nproc 2`: every precision under the real torchrun, 2 gloo ranks with DDP."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from pathlib import Path

import jsonschema
import pytest

from ampkit.cli.main import main
from ampkit.verify.report import load_schema
from tests.distributed._orphans import START_TIMEOUT_S, reaping, survivors, wait_for_ranks
from tests.verify.verify_helpers import Job, cli_command, task_ref, verify


@pytest.fixture(scope="module")
def nproc_job(tmp_path_factory: pytest.TempPathFactory, verify_seed: int) -> Job:
    # 4 torchrun launches (fp32 and bf16, each on 2 ranks and on the 1-rank baseline): ~25 s on 2 cores.
    return verify(tmp_path_factory.mktemp("nproc"), task_ref("Regression"), "--precisions", "bf16", "--nproc", "2",
                  "--steps", "12", "--warmup", "2", "--eval-every", "6", "--seed", str(verify_seed))


def test_verify_nproc_runs_every_precision_on_2_ranks_and_validates(nproc_job: Job) -> None:
    # 12 steps leave 7 after warm-up, too few for a pass under the noise band: inconclusive, exit 3
    assert nproc_job.code == 3 and nproc_job.report["verdict"] == "inconclusive"
    report = nproc_job.report
    jsonschema.validate(report, load_schema(), cls=jsonschema.Draft202012Validator)
    assert report["protocol"]["nproc"] == 2
    for precision in ("fp32", "bf16"):
        run = nproc_job.run(precision)
        assert run["status"] == "ok", run.get("log_tail")
        assert run["world_size"] == 2
        launch = dict(run["launch"])
        assert isinstance(launch.pop("torchrun_exit"), int)
        assert launch == {"launcher": "torchrun", "nproc": 2, "backend": "gloo", "omp_num_threads": 1}
        assert len(run["loss"]) == 12 and all(x is not None for x in run["loss"])
        sc = run["scaling"]
        assert sc["baseline_status"] == "ok"
        rate_2, rate_1 = sc["steps_per_s"], sc["baseline_steps_per_s"]
        assert rate_2 == run["throughput"]["steps_per_s"]
        assert math.isclose(sc["efficiency"], rate_2 / (2 * rate_1), rel_tol=1e-9)
    noise = report["noise"]["run"]
    assert noise["status"] == "ok" and noise["world_size"] == 2 and len(noise["shadow_loss"]) == 12
    # before any update the noise run holds the baseline's weights: its shadow loss on the baseline's
    # first batch, averaged over the ranks, is the baseline's first loss
    assert math.isclose(noise["shadow_loss"][0], nproc_job.run("fp32")["loss"][0], rel_tol=1e-6)
    assert "## Scaling" in (nproc_job.out / "report.md").read_text()
    assert "scaling efficiency" in (nproc_job.out / "report.html").read_text()


def test_verify_nproc_first_loss_equals_one_process(nproc_job: Job, regression_job: Job) -> None:
    # Step 1 sees the initial weights and the first global batch: the mean of the two ranks'
    # half-batch losses is the one-process loss of the whole batch, up to fp32 summation order.
    for precision, tol in (("fp32", 1e-6), ("bf16", 1e-3)):
        one, two = regression_job.run(precision)["loss"][0], nproc_job.run(precision)["loss"][0]
        assert math.isclose(two, one, rel_tol=tol), (precision, one, two)


def test_verify_nproc_that_does_not_divide_the_batch_exits_2(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["verify", task_ref("Regression"), "--nproc", "3", "--out", str(tmp_path), "--no-progress"])
    assert code == 2
    assert "does not divide task 'regression''s batch of 256 samples" in capsys.readouterr().err


def test_verify_nproc_sigkill_of_verify_kills_torchrun_and_every_rank(tmp_path: Path) -> None:
    # Enough steps that the ranks are still training when the kill comes; TMPDIR puts verify's
    # work directory (and so the ranks' pid files) under tmp_path.
    cmd = cli_command("verify", task_ref("Regression"), "--precisions", "fp32", "--nproc", "2",
                      "--no-scaling-baseline", "--steps", "100000", "--warmup", "1", "--eval-every", "100000",
                      "--out", str(tmp_path / "out"), "--no-progress", "--no-measure-env")
    proc = subprocess.Popen(cmd, env={**os.environ, "TMPDIR": str(tmp_path)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids: list[int] = []
    with reaping(proc, pids):
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (rank_dirs := list(tmp_path.glob("ampkit-verify-*/*.ranks"))):
            assert proc.poll() is None and time.monotonic() < deadline, f"no torchrun launch (exit {proc.returncode})"
            time.sleep(0.1)
        torchrun, ranks = wait_for_ranks(rank_dirs[0], 2, proc)
        pids += [torchrun, *ranks]
        proc.kill()
        assert proc.wait(timeout=60) == -signal.SIGKILL
        assert survivors(pids) == [], "torchrun or a rank outlived `ampkit verify`"
