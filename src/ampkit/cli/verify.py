"""ampkit verify: run a task under fp32 and low precision, compare, and write the report.

Each precision trains in its own fresh process from the same initial weights on the same data;
the report (DIR/report.json, report.md, report.html) holds loss curves, eval metrics, skipped
steps, throughput and peak memory after warm-up, the environment, and a verdict per precision.
With --nproc N every precision runs on N ranks under torchrun (DDP, the task's batch split over
the ranks) and the report adds the world size and the scaling efficiency against one rank.

The step time of every precision is measured during its warm-up, and the whole run's estimate
is shown (and, when stderr is not a terminal, plain progress lines every 10 s or 10 % of the
run).  --time-budget 5m probes every precision for a few steps first and then shrinks the
number of steps, equally for every precision, so that the job fits.

A second fp32 run with another data order measures fp32's own run-to-run spread (the noise
band); a precision passes when its distance to fp32 is within the tolerance and the run can
resolve that tolerance (k x band within it, enough steps), fails when the distance exceeds
both the tolerance and k x band, and is inconclusive otherwise.  --no-noise-band skips the
second run and judges each distance against its tolerance alone.

Exit status: 0 every precision passes, 1 at least one fails, 2 bad input, 3 inconclusive (no
failure, but at least one verdict the run cannot settle).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ampkit.cli.errors import UsageError

if TYPE_CHECKING:
    from ampkit.precision import PrecisionName

__all__ = ["register", "run"]

DEFAULT_OUT = "runs/verify"
EXIT_CODES = {"pass": 0, "fail": 1, "inconclusive": 3}
"""3 is verify's own: no other command uses it (2 is bad input everywhere)."""


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (write a fraction such as 0.02 for 2%)") from exc
    if not 0.0 <= value < 10.0 or value != value:
        raise argparse.ArgumentTypeError(f"{text!r}: a tolerance is a fraction >= 0, such as 0.02 for 2%")
    return value


def _duration(text: str) -> float:
    from ampkit.verify.budget import DurationError, parse_duration

    try:
        return parse_duration(text)
    except DurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def register(subparsers: Any) -> None:
    from ampkit.verify.compare import Tolerances
    from ampkit.verify.noise import NOISE_K

    d = Tolerances()
    p = subparsers.add_parser(
        "verify", help="verify a task's low-precision runs against an fp32 baseline",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("task", nargs="?", default="tinygpt", metavar="TASK",
                   help="built-in name (tinygpt, digits), path/to/file.py[:attr] or package.module:attr "
                        "(default: tinygpt)")
    p.add_argument("--precisions", metavar="LIST",
                   help="comma-separated precisions (default: fp32,bf16,fp16 on GPUs, fp32,bf16 on CPU); "
                        "fp32 is always run as the baseline")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, mps, xpu or auto (default)")
    p.add_argument("--steps", type=int, metavar="N", help="optimizer steps per run (default: the task's)")
    p.add_argument("--warmup", type=int, metavar="W", help="steps left out of throughput and loss distance")
    p.add_argument("--eval-every", type=int, metavar="N", help="evaluate every N steps and at the end")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and data order (default 0)")
    p.add_argument("--nproc", type=int, metavar="N",
                   help="run each precision on N ranks under torchrun with DDP (gloo on CPU, nccl on CUDA), the "
                        "task's batch split over the ranks; adds world size and scaling efficiency to the report")
    p.add_argument("--no-scaling-baseline", action="store_true",
                   help="with --nproc N > 1, skip the 1-rank run of each precision (no scaling efficiency)")
    p.add_argument("--time-budget", type=_duration, metavar="DURATION",
                   help="fit the training into DURATION (seconds, or 90s, 5m, 1h): every precision is probed for a "
                        "few steps, then all run the same, smaller number of steps; the report says so")
    p.add_argument("--size", metavar="NAME",
                   help="run the task at this rung of its size ladder (tinygpt: full, small, tiny); "
                        "default: the task as loaded, or the largest that fits --time-budget")
    p.add_argument("--no-noise-band", action="store_true",
                   help="skip the second fp32 run that measures fp32's run-to-run spread; verdicts are then pass "
                        "or fail against the tolerances alone")
    p.add_argument("--noise-k", type=float, default=NOISE_K, metavar="K",
                   help=f"a difference counts beyond K noise bands, and a pass needs K bands within the tolerance "
                        f"(default {NOISE_K:g})")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"report directory (default {DEFAULT_OUT})")
    tol = p.add_argument_group("tolerances (fractions; see docs/verify.md)")
    tol.add_argument("--tol-metric", action="append", default=[], metavar="[NAME=]X",
                     help=f"largest relative worsening of an eval metric (default {d.metric}); NAME=X sets one "
                          "metric, repeatable")
    tol.add_argument("--tol-loss", type=_fraction, default=d.loss, metavar="X",
                     help=f"largest loss-curve distance (default {d.loss})")
    tol.add_argument("--tol-skipped", type=_fraction, default=d.skipped, metavar="X",
                     help=f"largest fraction of skipped steps (default {d.skipped})")
    tol.add_argument("--tol-nonfinite", type=_fraction, default=d.nonfinite, metavar="X",
                     help=f"largest fraction of non-finite losses (default {d.nonfinite})")
    tol.add_argument("--min-speedup", type=float, metavar="X", help="fail runs slower than X times fp32 (off by default)")
    tol.add_argument("--smooth", type=int, metavar="W", help="loss smoothing window in steps (default steps/20)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-measure-env", action="store_true", help="skip the matmul throughput measurement")
    p.set_defaults(run=run)


def _tolerances(args: argparse.Namespace) -> Any:
    from ampkit.verify.compare import Tolerances

    metric, overrides = Tolerances().metric, {}
    for item in args.tol_metric:
        name, sep, value = item.rpartition("=")
        try:
            number = _fraction(value)
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"--tol-metric {item!r}: {exc}") from exc
        if sep:
            if not name:
                raise UsageError(f"--tol-metric {item!r}: write NAME=X, for example accuracy=0.01")
            overrides[name] = number
        else:
            metric = number
    if args.smooth is not None and args.smooth < 1:
        raise UsageError(f"--smooth {args.smooth}: the smoothing window must be >= 1 step")
    if args.min_speedup is not None and not args.min_speedup > 0:
        raise UsageError(f"--min-speedup {args.min_speedup}: must be > 0 (1.0 = as fast as fp32)")
    return Tolerances(metric=metric, metric_overrides=overrides, loss=args.tol_loss, skipped=args.tol_skipped,
                      nonfinite=args.tol_nonfinite, min_speedup=args.min_speedup, smooth=args.smooth)


def _require_report_extras() -> None:
    missing = [m for m in ("matplotlib", "rich", "jinja2") if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"ampkit verify draws its report with {' and '.join(missing)}, which "
                         f"{'is' if len(missing) == 1 else 'are'} not installed; run `pip install 'ampkit[report]'`")


def _check_out(given: str) -> Path:
    """--out made absolute now and proven writable with a real file, before anything trains."""
    from ampkit._util.outputs import absolute_path, unwritable_reason

    out = absolute_path(given)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {given!r} is a file; give a directory for report.json, report.md, report.html")
    reason = unwritable_reason(out)
    if reason is not None:
        raise UsageError(f"--out {given!r} cannot be written: {reason}; choose a writable directory")
    return out


def _write_or_keep(report: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write the report to ``out``; when that fails after all (disk full, folder gone), write it to the
    temp directory instead: the runs took long and their results are in memory."""
    from ampkit._util.outputs import fallback_directory
    from ampkit.verify.report import write_report

    try:
        return write_report(report, out)
    except OSError as exc:
        fallback = fallback_directory("ampkit-verify-")
        # Plain print, not the console: a wrapped path cannot be copied.
        print(f"error: could not write the report to {out} ({exc.strerror or exc}); writing it to {fallback} "
              "instead", file=sys.stderr)
        return write_report(report, fallback)


def run(args: argparse.Namespace) -> int:
    _require_report_extras()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ampkit.tasks import TaskLoadError
    from ampkit.verify.harness import VerifyConfig, VerifyError, plan, run_verify
    from ampkit.verify.report import callouts, summary_table

    precisions = None
    if args.precisions is not None:
        precisions = tuple(x.strip() for x in args.precisions.split(",") if x.strip())
        if not precisions:
            raise UsageError("--precisions is empty; write a list such as fp32,bf16")
    out = _check_out(args.out)
    config = VerifyConfig(task=args.task, precisions=precisions, device=args.device, steps=args.steps,
                          warmup=args.warmup, eval_every=args.eval_every, seed=args.seed,
                          tolerances=_tolerances(args), measure_env=not args.no_measure_env, nproc=args.nproc,
                          scaling_baseline=not args.no_scaling_baseline, time_budget=args.time_budget,
                          noise_band=not args.no_noise_band, noise_k=args.noise_k, size=args.size)
    try:
        resolved = plan(config)
    except (VerifyError, TaskLoadError) as exc:
        raise UsageError(str(exc)) from exc
    console = Console(stderr=True)
    for note in resolved.notes:
        console.print(f"note: {note}", markup=False, highlight=False)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    plain = not console.is_terminal  # logs and pipes: no bar (it would print once, at the end), lines instead
    with Progress(*columns, console=console, disable=args.no_progress or plain) as progress:
        tracker = _Tracker(resolved, progress, plain=plain and not args.no_progress)
        report = run_verify(config, on_progress=tracker, resolved=resolved)
        progress.update(tracker.job, description="writing the report")
        paths = _write_or_keep(report, out)
        progress.update(tracker.job, description=f"done: {report['verdict']}")
    stdout = Console()
    if not stdout.is_terminal:  # logs and pipes: wide enough that the table does not wrap every cell
        stdout = Console(width=160)
    stdout.print(summary_table(report))
    for line in callouts(report):
        print(f"note: {line}")
    print(f"Report: {paths['html']}  (also {paths['json'].name}, {paths['md'].name})")
    sys.stdout.flush()
    return EXIT_CODES[report["verdict"]]


class _Tracker:
    """The job's progress: the bar (terminal) or plain lines (logs), with the estimated time left.

    Receives the harness's progress events; step times come from their arrival times
    (``ampkit.verify.budget``), so the estimate is shown as soon as a precision's warm-up is measured.
    """

    def __init__(self, resolved: Any, progress: Any, *, plain: bool) -> None:
        from ampkit.verify.budget import ProgressLog, RunEstimate
        from ampkit.verify.runner import NOISE_PART

        self.names, self.parts, self.nproc = resolved.precisions, resolved.parts, resolved.nproc
        self.steps, self.warmup, self.eval_every = resolved.steps, resolved.warmup, resolved.eval_every
        self.progress, self.plain, self.started = progress, plain, time.perf_counter()
        self.runs = [f"{name}/{part}" for name in self.names for part in range(self.parts)]
        if resolved.noise_band:
            self.runs.insert(self.parts, f"fp32/{NOISE_PART}")  # right after the fp32 baseline, as it runs
        self.estimate = RunEstimate(self.runs, self.steps, self.eval_every)
        self.log = ProgressLog(len(self.runs) * self.steps, self.started)
        self.job = progress.add_task("measuring the environment", total=len(self.runs) * self.steps)
        self.announced: set[str] = set()

    def say(self, text: str) -> None:
        if self.plain:
            print(text, file=sys.stderr, flush=True)
        else:
            self.progress.console.print(text, markup=False, highlight=False)

    def __call__(self, precision: PrecisionName, event: dict[str, Any]) -> None:
        from ampkit.verify.budget import format_duration
        from ampkit.verify.runner import NOISE_PART

        phase, part, now = event["phase"], event.get("part", 0), time.perf_counter()
        i, n = self.names.index(precision), len(self.names)
        if event.get("probe"):
            if phase == "launch":
                self.say(f"verify: probing {precision} ({i + 1}/{n}) for the time budget")
            self.progress.update(self.job, description=f"probing {precision}: {phase} {event.get('step', '')}")
            return
        if phase == "plan":
            return self._plan(event)
        run = f"{precision}/{part}"
        self.estimate.feed(run, event, now)
        label = f"{precision} ({i + 1}/{n})" if part != NOISE_PART else "fp32 noise band"
        if self.nproc is not None:
            ranks = 1 if part == 1 else self.nproc
            label += f", {ranks} rank{'' if ranks == 1 else 's'}"
        base = self.runs.index(run) * self.steps
        left = self.estimate.left_s()
        if phase == "launch" and self.plain:
            self.say(f"verify: {label} starting; about {format_duration(left)} left")
        elif phase == "setup":
            self.progress.update(self.job, completed=base, description=f"{label}: building the model")
        elif phase == "train":
            step = int(event["step"])
            self._announce(run, label, step, left)
            self.progress.update(self.job, completed=base + step,
                                 description=f"{label}: step {step}/{self.steps}, ~{format_duration(left)} left")
            if self.plain and self.log.due(base + step, now):
                cost = self.estimate.cost(run)
                self.say(self.log.line(label, step, self.steps, base + step, now, left, cost.step_s if cost else None))
        elif phase == "done":
            self.progress.update(self.job, completed=base + self.steps, description=f"{label}: {event['status']}")
            if self.plain:
                self.say(f"verify: {label} {event['status']} after {format_duration(now - self.started)}; "
                         f"about {format_duration(left)} left")

    def _announce(self, run: str, label: str, step: int, left: float | None) -> None:
        """Once per run, when its warm-up has given a step time: that time and the whole job's estimate."""
        from ampkit.verify.budget import format_duration

        cost = self.estimate.cost(run)
        if run in self.announced or step < max(3, min(self.warmup, self.steps)) or cost is None:
            return
        self.announced.add(run)
        whole = time.perf_counter() - self.started + (left or 0.0)
        self.say(f"verify: {label}: {cost.step_s:.3g} s/step measured during warm-up; whole job about "
                 f"{format_duration(whole)} ({format_duration(left)} left)")

    def _plan(self, event: dict[str, Any]) -> None:
        from ampkit.verify.budget import Cost, RunEstimate
        from ampkit.verify.probe import NOISE_RUN
        from ampkit.verify.runner import NOISE_PART

        self.steps, self.warmup, self.eval_every = event["steps"], event["warmup"], event["eval_every"]
        costs = {f"fp32/{NOISE_PART}" if name == NOISE_RUN else f"{name}/0": Cost(**c)
                 for name, c in event["costs"].items()}
        self.estimate = RunEstimate(self.runs, self.steps, self.eval_every, costs)
        self.log.total_steps = len(self.runs) * self.steps
        self.progress.update(self.job, total=len(self.runs) * self.steps, completed=0)
        self.say(f"verify: {event['note']}")
