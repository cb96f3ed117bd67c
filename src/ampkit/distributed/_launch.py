"""Launch a module on N local processes with the real ``torchrun``, and measure scaling.

``launch_torchrun(2, "my_pkg.train", ["--steps", "20"], timeout=300)`` runs

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 0 \\
        -m ampkit.distributed._rank_main my_pkg.train --steps 20

(``torch.distributed.run`` is what the ``torchrun`` command runs).  Workers read their backend
from ``AMPKIT_DIST_BACKEND``: nccl when every rank can have its own GPU, else gloo.  Each rank's
stdout, stderr and exit code come back separately; on timeout the whole launch -- torchrun and
every worker's process group -- is terminated, then killed.

No process of a launch outlives its caller, however the caller dies: torchrun gets SIGKILL from
the kernel when the thread that called ``launch_torchrun`` ends (Linux), and each rank dies when
torchrun or the caller is gone (``ampkit._util.procs``).  SIGTERM to a caller that runs this in
its main thread, with SIGTERM's default action, first stops the launch in order (SIGTERM to
torchrun and the ranks, SIGKILL after 10 s), then ends the caller by SIGTERM as before.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from ampkit._util.procs import die_with_caller, live_pids, signal_groups, sigterm_unwinds
from ampkit.distributed._rank_main import LAUNCHER_PID_ENV, RANK_DIR_ENV

__all__ = ["BACKEND_ENV", "RankResult", "TorchrunResult", "default_backend", "launch_torchrun", "scaling_efficiency"]

BACKEND_ENV = "AMPKIT_DIST_BACKEND"
_GRACE_S = 10.0
# torchrun's failure summary: "rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 123)".
_SUMMARY = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def default_backend(nproc: int | None = None) -> str:
    """``"nccl"`` when CUDA is available (and has at least ``nproc`` devices), else ``"gloo"``.

    >>> default_backend(1) in ("gloo", "nccl")
    True
    """
    if torch.cuda.is_available() and (nproc is None or torch.cuda.device_count() >= nproc):
        return "nccl"
    return "gloo"


@dataclass(frozen=True)
class RankResult:
    """What one rank did."""

    rank: int
    exitcode: int | None
    """The exit code; negative ``-N`` when killed by signal N (torchrun's convention); None if unknown."""
    stdout: str
    stderr: str

    @property
    def signal(self) -> str | None:
        """``"SIGKILL"`` etc. when the rank was killed by a signal."""
        if self.exitcode is None or self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"


@dataclass(frozen=True)
class TorchrunResult:
    """The outcome of ``launch_torchrun``."""

    returncode: int | None
    """torchrun's own exit code (None when it had to be killed)."""
    ranks: list[RankResult]
    timed_out: bool
    launcher_output: str
    """torchrun's stdout and stderr (rendezvous, the failure summary)."""
    wall_s: float
    log_dir: Path
    """Where the per-rank files are kept (``rank<R>.stdout``, ``.stderr``, ``.exit``)."""

    @property
    def exit_codes(self) -> list[int | None]:
        return [r.exitcode for r in self.ranks]

    @property
    def ok(self) -> bool:
        """True when torchrun and every rank exited 0 within the timeout."""
        return not self.timed_out and self.returncode == 0 and all(c == 0 for c in self.exit_codes)

    def describe(self) -> str:
        """One line per rank, with the tail of a failed rank's stderr."""
        head = "timed out" if self.timed_out else f"torchrun exit {self.returncode}"
        lines = [f"{head} after {self.wall_s:.1f}s (logs: {self.log_dir})"]
        for r in self.ranks:
            state = r.signal or ("unknown" if r.exitcode is None else f"exit {r.exitcode}")
            lines.append(f"  rank {r.rank}: {state}")
            if r.exitcode not in (0, None):
                lines.extend("    " + line for line in r.stderr.strip().splitlines()[-15:])
        return "\n".join(lines)


def _validate(nproc: int, module: str, timeout: float) -> None:
    if not (isinstance(nproc, int) and not isinstance(nproc, bool) and nproc >= 1):
        raise ValueError(f"launch_torchrun(nproc={nproc!r}): the number of processes must be an int >= 1")
    valid = isinstance(module, str) and all(part.isidentifier() for part in module.split("."))
    if not valid or module.endswith(".py"):
        raise ValueError(
            f"launch_torchrun(module={module!r}): give an importable module name such as 'my_pkg.train' "
            "(what `python -m` takes), not a file path"
        )
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"launch_torchrun(timeout={timeout!r}): must be a number of seconds > 0")


def _live_workers(log_dir: Path, nproc: int) -> list[int]:
    return live_pids((log_dir / f"rank{r}.pid" for r in range(nproc)), b"ampkit.distributed._rank_main")


def _kill_launch(proc: subprocess.Popen[bytes], log_dir: Path, nproc: int) -> None:
    # torchrun leads its own session and so does each worker: SIGTERM lets torchrun's agent
    # stop its workers; whatever is left after the grace period is killed.
    for sig in (signal.SIGTERM, signal.SIGKILL):
        signal_groups([proc.pid, *_live_workers(log_dir, nproc)], sig)
        deadline = time.monotonic() + _GRACE_S
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _live_workers(log_dir, nproc):
                return
            time.sleep(0.1)
    proc.wait()


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def launch_torchrun(
    nproc: int,
    module: str,
    args: Sequence[str] = (),
    timeout: float = 600.0,
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    backend: str | None = None,
) -> TorchrunResult:
    """Run ``python -m module *args`` on ``nproc`` local ranks under torchrun; never raises on failure.

    Args:
        nproc: processes (ranks) on this node.
        module: an importable module run as ``__main__`` on every rank.
        args: its command-line arguments.
        timeout: seconds for the whole launch; then every process of it is terminated (SIGTERM,
            then SIGKILL after 10 s) and ``timed_out`` is True.  The launch is stopped the same
            way when the wait is interrupted (Ctrl-C, SIGTERM), and the exception propagates.
        env: extra environment variables for the workers (``OMP_NUM_THREADS`` is 1 unless set).
        cwd: working directory of the workers.
        log_dir: where per-rank output files go (default: a new temporary directory).
        backend: value of ``AMPKIT_DIST_BACKEND`` for the workers (default ``default_backend(nproc)``).
    """
    _validate(nproc, module, timeout)
    out = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="ampkit-torchrun-"))
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("rank*.*"):
        stale.unlink()
    child_env = dict(os.environ)
    child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env.update(env or {})
    child_env[RANK_DIR_ENV] = str(out.resolve())
    child_env[LAUNCHER_PID_ENV] = str(os.getpid())
    child_env[BACKEND_ENV] = backend or default_backend(nproc)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
        "--max-restarts", "0", "-m", "ampkit.distributed._rank_main", module, *map(str, args),
    ]
    start = time.perf_counter()
    returncode, timed_out = _run(cmd, child_env, cwd, out, nproc, timeout)
    wall = time.perf_counter() - start
    launcher = _read(out / "launcher.log")
    return TorchrunResult(
        returncode=returncode, ranks=_rank_results(out, nproc, launcher),
        timed_out=timed_out, launcher_output=launcher, wall_s=wall, log_dir=out,
    )


def _run(cmd: list[str], env: dict[str, str], cwd: str | os.PathLike[str] | None, out: Path, nproc: int,
         timeout: float) -> tuple[int | None, bool]:
    """Run torchrun until it ends or ``timeout``; (its exit code, None when killed; whether it timed out)."""
    with open(out / "launcher.log", "wb") as launcher_log, sigterm_unwinds():
        # die_with_caller binds torchrun's life to this thread, which stays here until it ends.  A
        # preexec_fn can deadlock in a threaded parent if it takes a lock another thread held at
        # the fork; this one only makes a foreign call looked up before the fork and two syscalls.
        proc = subprocess.Popen(
            cmd, env=env, cwd=cwd, stdout=launcher_log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=die_with_caller(),
        )
        try:
            return proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            _kill_launch(proc, out, nproc)
            return None, True
        except BaseException:  # Ctrl-C, SIGTERM, SystemExit from a handler: stop the launch first
            _kill_launch(proc, out, nproc)
            raise


def _rank_results(out: Path, nproc: int, launcher: str) -> list[RankResult]:
    """Each rank's exit code (its ``.exit`` file, else torchrun's failure summary) and output."""
    reported = {int(r): int(c) for r, c in _SUMMARY.findall(launcher)}
    ranks = []
    for rank in range(nproc):
        exit_file = _read(out / f"rank{rank}.exit").strip()
        if exit_file:
            code: int | None = int(exit_file)
        elif rank in reported:
            code = reported[rank]
        else:
            code = None
        ranks.append(RankResult(rank, code, _read(out / f"rank{rank}.stdout"), _read(out / f"rank{rank}.stderr")))
    return ranks


def scaling_efficiency(t1: float, tN: float, n: int, *, scaling: Literal["strong", "weak"] = "strong") -> float:
    """Throughput on ``n`` processes over ``n`` times the throughput on one (1.0 = linear).

    ``t1`` and ``tN`` are the times of the same measured unit (a step after warm-up, or a
    whole run) on 1 and on ``n`` processes.  ``"strong"``: the global batch is the same, split
    over the ranks (ideal ``tN = t1 / n``); ``"weak"``: each rank keeps the single process's
    batch (ideal ``tN = t1``).

    >>> scaling_efficiency(1.0, 0.5, 2)
    1.0
    >>> scaling_efficiency(1.0, 0.625, 2)
    0.8
    >>> scaling_efficiency(1.0, 1.25, 4, scaling="weak")
    0.8
    """
    for name, value in (("t1", t1), ("tN", tN)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"scaling_efficiency({name}={value!r}): times must be finite numbers > 0 (seconds)")
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
        raise ValueError(f"scaling_efficiency(n={n!r}): the number of processes must be an int >= 1")
    if scaling == "strong":
        return t1 / (n * tN)
    if scaling == "weak":
        return t1 / tN
    raise ValueError(f"scaling_efficiency(scaling={scaling!r}): use 'strong' (same global batch) or 'weak'")
