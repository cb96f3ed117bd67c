"""A rank that imports ampkit's engine after ``init_process_group`` (``python -m dist_teardown``).

It prints the native threads of the gloo backend still alive after ``destroy_process_group()``
and exits 1 when there are any: a process group kept alive past its destruction is torn down
during interpreter shutdown instead, where a gloo worker that drops its last tensor needs the
GIL, is ended by ``pthread_exit`` inside a C++ destructor, and aborts the rank (SIGABRT,
``terminate called without an active exception``) after it reported exit code 0.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def gloo_threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(n for n in names if n.startswith(GLOO_THREADS))


def main() -> int:
    dist.init_process_group("gloo")
    # The first use of ampkit.MixedPrecision imports ampkit.engine, hence torch._dynamo, hence
    # torch.distributed.nn, whose default arguments evaluate group.WORLD at import time.
    import ampkit

    ampkit.MixedPrecision("bf16", device="cpu")
    t = torch.ones(4)
    for _ in range(5):
        dist.all_reduce(t)
    dist.destroy_process_group()
    left = gloo_threads()
    print(f"gloo threads after destroy_process_group: {left}", flush=True)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
