"""The script doctor's per-step overhead, this checkout against another ampkit source tree,
measured over whole processes that alternate A B B A.

One process of ``bench_doctor_script.py`` cannot tell two versions apart by 0.01: its mlp ratio
moves more from one process to the next (1.135x to 1.159x over 16 processes of one version on a
quiet 2-core machine) than between versions whose difference matters.  Here each process runs one
loop of that benchmark (``--loop``, mlp by default: the loop where the observers' Python cost
weighs the most) for ``--rounds`` alternating plain/observed runs and reports its median CPU-time
ratio and the time added per step; the processes alternate between this checkout (A) and
``--against`` (B) in A B B A order, ``--processes`` of each.  Reported per side: the median and
quartiles over processes, and the difference of the medians.  Without ``--against``, only this
checkout runs: the spread over processes is this machine's resolution.

Run: ``.venv/bin/python benchmarks/bench_doctor_ab.py --against /path/to/other/checkout/src``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
THIS_SRC = HERE.parent / "src"


def child(loop: str, rounds: int, steps: int, warmup: int) -> dict[str, float]:
    """One process's measurement (run inside the child; imports whichever ampkit PYTHONPATH gives)."""
    import torch

    sys.path.insert(0, str(HERE))
    import bench_doctor_script as bench

    torch.set_num_threads(1)  # as bench_doctor_script: the CPU clock then measures the work done
    make = {"mlp": bench.make_mlp, "tinygpt": bench.make_tinygpt}[loop]
    plain, watched = bench.measure(make(), rounds, steps, warmup)
    p, w = statistics.median(t[1] for t in plain), statistics.median(t[1] for t in watched)
    return {"ratio": w / p, "added_us": (w - p) * 1e6}


def _run(src: Path, args: argparse.Namespace) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", "--loop", args.loop, "--rounds", str(args.rounds),
         "--steps", str(args.steps), "--warmup", str(args.warmup)],
        env=env, capture_output=True, text=True,
    )
    if proc.returncode != 0:  # say which version failed and why, not only that a child did
        raise SystemExit(f"the measuring process against {src} failed (exit {proc.returncode}):\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _summary(name: str, results: list[dict[str, float]]) -> str:
    ratios, added = [r["ratio"] for r in results], [r["added_us"] for r in results]
    (r1, _, r3), (a1, _, a3) = statistics.quantiles(ratios, n=4), statistics.quantiles(added, n=4)
    return (f"{name:8s} {len(results):3d} processes: ratio median {statistics.median(ratios):.4f}x "
            f"(q1-q3 {r1:.4f}-{r3:.4f}, range {min(ratios):.3f}-{max(ratios):.3f}); added per step median "
            f"{statistics.median(added):.1f} us (q1-q3 {a1:.1f}-{a3:.1f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, help="the other version's source folder (the one holding ampkit/)")
    parser.add_argument("--processes", type=int, default=8, help="processes per version (at least 2)")
    parser.add_argument("--loop", choices=("mlp", "tinygpt"), default="mlp")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.loop, args.rounds, args.steps, args.warmup)))
        return 0
    if args.processes < 2:
        parser.error(f"--processes {args.processes}: quartiles need at least 2 processes per version")
    if args.against is not None and not (args.against / "ampkit" / "__init__.py").is_file():
        parser.error(f"--against {args.against}: no ampkit/__init__.py there; pass the folder that holds the "
                     "ampkit package (a checkout's src/)")
    sides = {"this": THIS_SRC} | ({"against": args.against.resolve()} if args.against is not None else {})
    results: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    order = ["this", "against", "against", "this"] if args.against is not None else ["this"]
    while any(len(r) < args.processes for r in results.values()):
        for name in order:
            if len(results[name]) < args.processes:
                results[name].append(_run(sides[name], args))
    print(f"{args.loop} loop, {args.rounds} rounds x {args.steps} steps per process, CPU clock, torch on 1 thread")
    for name, src in sides.items():
        print(f"{_summary(name, results[name])}   [{src}]")
    if args.against is not None:
        diff = (statistics.median(r["ratio"] for r in results["this"])
                - statistics.median(r["ratio"] for r in results["against"]))
        print(f"this - against: {diff:+.4f} in ratio")
    return 0


if __name__ == "__main__":
    sys.exit(main())
