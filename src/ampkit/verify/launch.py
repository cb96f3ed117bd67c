"""``ampkit verify --nproc N``: one precision's run under the real ``torchrun``, N ranks, DDP.

``run_torchrun`` writes the worker spec with ``distributed: true`` and starts
``ampkit.distributed.launch_torchrun(N, "ampkit.verify.worker", [spec])``: gloo on CPU, nccl on
CUDA (one GPU per rank), ``OMP_NUM_THREADS=1`` per rank.  Every rank trains its slice of the
task's batch (the global batch) under DDP; rank 0 writes the result.  Rank 0's progress lines
are read from its stdout file while the launch runs, so the progress bar moves as it does for
a single process.

``scaling`` compares an N-rank run with a 1-rank run of the same precision (same launcher, same
threads per rank, same global batch: strong scaling) through
``ampkit.distributed.scaling_efficiency``.

No rank outlives verify: the launch runs ``launch_torchrun`` (torchrun and every rank die with
the verify process, SIGKILL included), Ctrl-C kills the ranks, and SIGTERM kills them before
verify itself ends by SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ampkit._util.procs import live_pids, signal_groups, sigterm_unwinds

if TYPE_CHECKING:
    from ampkit.distributed import TorchrunResult
    from ampkit.verify.record import RunRecord

__all__ = ["LAUNCH_TIMEOUT_S", "run_torchrun", "scaling"]

LAUNCH_TIMEOUT_S = 6 * 3600.0
"""A whole launch may take this long; a rank that fails makes torchrun stop the others at once,
and a stuck collective fails after ``ampkit.verify.ranks.PG_TIMEOUT``, so this only bounds a hang."""
_POLL_S = 0.2


def _kill_ranks(log_dir: Path) -> None:
    """SIGKILL this launch's ranks (each leads its own process group); torchrun then exits."""
    signal_groups(live_pids(log_dir.glob("rank*.pid"), b"ampkit.verify.worker"), signal.SIGKILL)


def run_torchrun(spec: dict[str, Any], nproc: int, workdir: Path, tag: str, env: dict[str, str],
                 on_event: Callable[[dict[str, Any]], None] | None, progress_prefix: str) -> dict[str, Any]:
    """Run the worker on ``nproc`` ranks; return rank 0's result, or a ``failed`` record."""
    from ampkit.distributed import launch_torchrun

    backend = "nccl" if spec["device"].split(":")[0] == "cuda" else "gloo"
    spec = {**spec, "distributed": True}
    spec_path = workdir / f"{tag}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log_dir = workdir / f"{tag}.ranks"
    env = {**env, "OMP_NUM_THREADS": "1"}
    outcome: dict[str, Any] = {}

    def launch() -> None:
        try:
            outcome["launch"] = launch_torchrun(nproc, "ampkit.verify.worker", [str(spec_path)],
                                                timeout=LAUNCH_TIMEOUT_S, env=env, log_dir=log_dir, backend=backend)
        except BaseException as exc:  # reported below, in the calling thread
            outcome["error"] = exc

    thread = threading.Thread(target=launch, name=f"torchrun-{tag}", daemon=True)
    thread.start()
    with sigterm_unwinds():  # launch_torchrun runs in a thread, where no signal handler can run
        _follow(thread, log_dir, on_event, progress_prefix)
    if "error" in outcome:
        raise outcome["error"]
    result = _rank0_result(spec, nproc, outcome["launch"])
    result["world_size"] = nproc
    result["launch"] = {"launcher": "torchrun", "nproc": nproc, "backend": backend, "omp_num_threads": 1,
                        "torchrun_exit": outcome["launch"].returncode}
    return result


def _follow(thread: threading.Thread, log_dir: Path, on_event: Callable[[dict[str, Any]], None] | None,
            progress_prefix: str) -> None:
    """Forward rank 0's progress until the launch thread ends; on Ctrl-C or SIGTERM no rank may outlive the job."""
    offset = 0
    try:
        while True:
            alive = thread.is_alive()
            offset = _forward_progress(log_dir / "rank0.stdout", offset, on_event, progress_prefix)
            if not alive:
                break
            thread.join(_POLL_S)
    except BaseException:
        _kill_ranks(log_dir)
        thread.join(30)
        raise


def _rank0_result(spec: dict[str, Any], nproc: int, launch_result: TorchrunResult) -> dict[str, Any]:
    """Rank 0's result file, failed when rank 0 wrote none or another rank did not finish cleanly."""
    result_file = Path(spec["result"])
    result: dict[str, Any]
    if result_file.exists():
        result = json.loads(result_file.read_text())
    else:
        first = launch_result.describe().splitlines()[0]
        result = {"precision": spec["precision"], "device": spec["device"], "status": "failed",
                  "error": f"the torchrun launch of {nproc} rank(s) wrote no result: {first}"}
    bad_ranks = [r.rank for r in launch_result.ranks if r.exitcode != 0]
    if launch_result.timed_out or bad_ranks:
        if result.get("status") == "ok":
            result["status"] = "failed"
            result["error"] = (f"rank(s) {bad_ranks} did not finish cleanly after rank 0 wrote its result: "
                               + launch_result.describe().splitlines()[0])
        result["log_tail"] = launch_result.describe()[-8000:]
    elif launch_result.returncode != 0:
        # Every rank exited 0, so the run and its measurements are complete; torchrun's own
        # exit status (its agent's shutdown) is kept as evidence, not turned into a failure.
        result["log_tail"] = launch_result.launcher_output[-4000:] or None
    return result


def _forward_progress(path: Path, offset: int, on_event: Callable[[dict[str, Any]], None] | None,
                      prefix: str) -> int:
    """Pass on the complete progress lines rank 0 wrote after ``offset``; return the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except OSError:
        return offset
    end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next poll
    for line in chunk[:end].decode(errors="replace").splitlines():
        if on_event is not None and line.startswith(prefix):
            with contextlib.suppress(ValueError):
                on_event(json.loads(line[len(prefix):]))
    return offset + end


def scaling(run: RunRecord, baseline: RunRecord, nproc: int) -> dict[str, Any]:
    """The scaling record of an N-rank run against the 1-rank run of the same precision.

    >>> s = scaling({"throughput": {"steps_per_s": 3.0}}, {"status": "ok", "throughput": {"steps_per_s": 2.0}}, 2)
    >>> s["efficiency"], s["speedup"]
    (0.75, 1.5)
    """
    from ampkit.distributed import scaling_efficiency

    rate_n = (run.get("throughput") or {}).get("steps_per_s")
    rate_1 = (baseline.get("throughput") or {}).get("steps_per_s")
    record: dict[str, Any] = {
        "mode": "strong", "baseline_world_size": 1, "baseline_status": baseline.get("status"),
        "baseline_steps_per_s": rate_1, "steps_per_s": rate_n, "speedup": None, "efficiency": None,
        "baseline_error": baseline.get("error"),
    }
    if rate_n and rate_1:
        record["speedup"] = rate_n / rate_1
        record["efficiency"] = scaling_efficiency(1.0 / rate_1, 1.0 / rate_n, nproc)
    return record
