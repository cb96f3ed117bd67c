"""Per-rank entry point of ``launch_torchrun``: run a module as ``__main__``, record what it did.

``torchrun ... -m ampkit.distributed._rank_main MODULE ARGS...`` runs ``MODULE`` exactly as
``python -m MODULE ARGS...`` would, with this rank's stdout and stderr (file descriptors 1 and
2, so C++ and NCCL/gloo logs too) written to ``$AMPKIT_RANK_DIR/rank<R>.stdout|.stderr``, its
pid to ``rank<R>.pid`` (so a timed-out launch can be killed), and its exit code to
``rank<R>.exit`` when it ends by itself.  A rank killed by a signal leaves no ``.exit`` file.

Before anything else a rank ties its life to torchrun's and to the launcher's (the process that
called ``launch_torchrun``, pid in ``$AMPKIT_LAUNCHER_PID``): SIGKILL when either is gone
(``ampkit._util.procs.die_with_parent``), so a killed launch leaves no rank behind.

Process-group teardown happens here, before the ``.exit`` file is written, never during
interpreter shutdown:

* ``torch.distributed.nn`` is imported *before* the module runs.  Its functions take
  ``group=group.WORLD`` as a default argument, evaluated at import: imported after
  ``init_process_group`` (``torch._dynamo`` imports it, and so does the first use of
  ``ampkit.MixedPrecision``, ``torch.compile``, FSDP2 ...), those defaults hold the default
  process group, so ``destroy_process_group()`` cannot free it.  Its gloo (or NCCL) threads and
  sockets then live on until ``Py_Finalize`` clears that module and runs the C++ destructor in
  the middle of interpreter teardown, racing with the other ranks' exits: a rank that had
  written exit code 0 could still die with SIGABRT (``terminate called without an active
  exception``) and fail the launch.  Imported first, the defaults are ``None``.
* A process group the module left initialized is destroyed after it returns.
* After the ``.exit`` file is written, the rank runs its ``atexit`` handlers, flushes, and ends
  with ``os._exit``: objects that still hold the group (FSDP2's device meshes, kept in torch's
  module-level registry) would otherwise tear gloo down inside ``Py_Finalize``, where it can
  abort a rank that finished (seen with FSDP2 and torchao's fp8 layers).  What is skipped is only
  the interpreter's own teardown of modules and C++ globals.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import traceback
from pathlib import Path

from ampkit._util.procs import die_with_parent

__all__ = ["LAUNCHER_PID_ENV", "RANK_DIR_ENV", "main"]

RANK_DIR_ENV = "AMPKIT_RANK_DIR"
LAUNCHER_PID_ENV = "AMPKIT_LAUNCHER_PID"


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message") prints and exits 1
    return 1


def _redirect(fd: int, path: Path) -> None:
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _import_torch_distributed_nn() -> None:
    """Import ``torch.distributed.nn`` while no process group exists (see the module docstring)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and not dist.is_initialized():
            import torch.distributed.nn  # noqa: F401
    except ImportError:  # no torch, or a build without distributed: nothing to protect
        pass


def _destroy_process_group() -> int:
    """Destroy a process group the module left initialized; 1 if that fails, else 0."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return 0
    try:
        dist.destroy_process_group()
    except Exception:
        print("_rank_main: destroy_process_group() failed after the module returned:", file=sys.stderr)
        traceback.print_exc()
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    die_with_parent(int(launcher) if launcher else None)  # before the pid file: a listed rank is bound
    if not argv:
        print("usage: python -m ampkit.distributed._rank_main MODULE [ARGS...]", file=sys.stderr)
        return 2
    out = Path(os.environ[RANK_DIR_ENV])
    rank = int(os.environ.get("RANK", "0"))
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    sys.stdout.flush()
    sys.stderr.flush()
    _redirect(1, out / f"rank{rank}.stdout")
    _redirect(2, out / f"rank{rank}.stderr")
    # Line-buffered, so the output of a rank that is killed is there up to its last line.
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    module, sys.argv = argv[0], [argv[0], *argv[1:]]
    _import_torch_distributed_nn()
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        traceback.print_exc()
        code = 1
    code = code or _destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    tmp = out / f".rank{rank}.exit.tmp"
    tmp.write_text(str(code))
    os.replace(tmp, out / f"rank{rank}.exit")
    return code


def _exit_now(code: int) -> None:
    atexit._run_exitfuncs()  # the module's own exit work (sinks, temp files) still runs
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())
