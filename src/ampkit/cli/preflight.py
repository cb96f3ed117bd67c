"""``ampkit preflight``: which low-precision format each layer can take, known before training starts.

    ampkit preflight [--formats LIST] [--precision F] [--json FILE] [--html FILE] [--time-budget T] SCRIPT [ARGS...]
    ampkit preflight [...] -m MODULE [ARGS...]
    ampkit preflight [...] TASK
    ampkit preflight [...] MODEL_DIR (--text FILE | --batches FILE)

TARGET is what ``ampkit doctor`` takes, or a local Hugging Face model directory (``config.json`` and
its weights):

* a SCRIPT (or ``-m MODULE``) runs as ``__main__``, exactly as written, until its first optimizer
  steps (``--steps``, default 2), and stops; those steps' model calls are what each format replays;
* a TASK (built-in name, ``path/to/file.py:attr`` or ``module:attr``) gives its model (seed ``--seed``),
  its first ``--num-batches`` batches and its loss;
* a MODEL_DIR is loaded with transformers; ``--text FILE`` is tokenised with the directory's tokenizer
  into ``--num-batches`` batches of ``--batch-size`` × ``--seq-len`` tokens with a causal-LM loss, and
  ``--batches FILE`` (safetensors: the model's keyword inputs, ``labels`` included) is split along its
  first dimension into ``--num-batches`` batches.

Formats (``--formats``, comma-separated): fp16, bf16, fp8 (tensorwise), fp8-rowwise, fp8-rowwise-gw-hp
(the default: the formats the engine trains), and the what-if formats mxfp8 and nvfp4 (``all``), which are
emulated through torchao's casts.

Each format gets a verdict: safe, safe with a verified policy (``keep_fp32=[...]``, ``fp8_filter=[...]``,
fp16's ``init_scale``), or UNSAFE.  Exit status: 0 when every judged format is safe or safe with its policy;
1 when any is unsafe; 2 for bad input; 130 after Ctrl-C.  Options come before TARGET.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from ampkit.cli.errors import UsageError

__all__ = ["parse_duration", "register", "run"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "preflight",
        help="before training: which format (fp16, bf16, fp8, MXFP8, NVFP4) each layer can take, with verified policies",
        description=(__doc__ or "").replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--formats", metavar="LIST", default=None,
                   help="formats to judge, comma-separated, or 'all' (default: fp16,bf16,fp8,fp8-rowwise,"
                        "fp8-rowwise-gw-hp)")
    p.add_argument("--precision", metavar="F", default=None,
                   help="also print the per-layer table of format F (range, headroom, SQNR, operand flush)")
    p.add_argument("--json", metavar="FILE", help="write the result as ampkit.preflight/1 JSON to FILE")
    p.add_argument("--html", metavar="FILE",
                   help="write a self-contained HTML page to FILE: the verdicts and layers × formats heatmaps")
    p.add_argument("--time-budget", metavar="T", default=None,
                   help="stop starting formats after T (600, 90s, 10m); batches are dropped before formats")
    p.add_argument("--steps", type=int, default=2, metavar="N", help="SCRIPT: optimizer steps to capture (default 2)")
    p.add_argument("--num-batches", type=int, default=2, metavar="N",
                   help="TASK, MODEL_DIR: sample batches to replay (default 2)")
    p.add_argument("--seed", type=int, default=0, help="TASK: the seed of its model and batches (default 0)")
    p.add_argument("--text", metavar="FILE", help="MODEL_DIR: a text file to tokenise into batches")
    p.add_argument("--batches", metavar="FILE", help="MODEL_DIR: a safetensors file of the model's keyword inputs")
    p.add_argument("--batch-size", type=int, default=4, metavar="B", help="MODEL_DIR with --text (default 4)")
    p.add_argument("--seq-len", type=int, default=128, metavar="L", help="MODEL_DIR with --text (default 128)")
    p.add_argument("-m", dest="as_module", action="store_true", help="TARGET is a module, run like python -m")
    p.add_argument("target", metavar="TARGET", nargs="?", help="training script, module (-m), task or model directory")
    p.add_argument("args", metavar="ARGS", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(run=run)


def parse_duration(text: str) -> float:
    """Seconds from ``600``, ``90s``, ``10m`` or ``1h``.

    >>> parse_duration("10m"), parse_duration("90s"), parse_duration("2.5")
    (600.0, 90.0, 2.5)
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([smh]?)\s*", text)
    if not match or float(match.group(1)) <= 0:
        raise UsageError(f"--time-budget {text!r} is not a duration; give seconds (600), or 90s, 10m, 1h")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


def run(args: argparse.Namespace) -> int:
    from ampkit.cli.doctor import check_outputs, is_script
    from ampkit.diagnose.preflight.formats import parse_formats

    if not args.target:
        raise UsageError("give a training script, -m MODULE, a task name or a Hugging Face model directory")
    try:
        formats = parse_formats(args.formats)
    except ValueError as exc:
        raise UsageError(f"--formats: {exc}") from exc
    if args.precision is not None and args.precision not in formats:
        raise UsageError(f"--precision {args.precision!r} is not among the judged formats ({', '.join(formats)}); "
                         "add it to --formats")
    for flag in ("steps", "num_batches", "batch_size", "seq_len"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be at least 1")
    budget = parse_duration(args.time_budget) if args.time_budget is not None else None
    check_outputs(args, ("json", "html"))
    directory = Path(args.target)
    if not args.as_module and directory.is_dir() and (directory / "config.json").is_file():
        model, steps = _from_model_dir(args, directory)
    elif is_script(args.target, args.as_module):
        model, steps = _from_script(args)
    else:
        model, steps = _from_task(args)
    return _judge(args, model, steps, formats, budget)


def _judge(args: argparse.Namespace, model: Any, steps: list[Any], formats: tuple[str, ...], budget: float | None) -> int:
    from ampkit._util.signals import signals_deferred
    from ampkit.diagnose.preflight.api import preflight_steps
    from ampkit.diagnose.preflight.document import write_preflight_json
    from ampkit.diagnose.preflight.html import write_preflight_html
    from ampkit.diagnose.preflight.table import render_layers, render_summary

    result = preflight_steps(model, steps, formats=formats, time_budget=budget, environment=True)
    render_summary(result, file=sys.stdout)
    if args.precision is not None and any(f.format == args.precision for f in result.formats):
        render_layers(result.report(args.precision), file=sys.stdout)
    outputs = [(path, write) for path, write in ((args.json, write_preflight_json), (args.html, write_preflight_html))
               if path]
    with signals_deferred():
        for path, write in outputs:
            write(result, path)
            print(f"ampkit preflight: wrote {path}", file=sys.stderr)
    return 0 if result.ok else 1


def _from_task(args: argparse.Namespace) -> tuple[Any, list[Any]]:
    from ampkit.diagnose.preflight.steps import BatchStep
    from ampkit.precision import resolve_device
    from ampkit.tasks import load_task

    if args.args:
        raise UsageError(f"task {args.target!r} takes no arguments (got {' '.join(args.args)!r}); "
                         "to run a script, pass its path")
    try:
        task = load_task(args.target)
    except (ValueError, LookupError, ImportError, OSError) as exc:
        raise UsageError(f"cannot load task {args.target!r}: {exc}") from exc
    device = resolve_device("auto")
    model = task.build_model(args.seed).to(device)
    batches = []
    for batch in task.batches(args.seed, device):
        batches.append(batch)
        if len(batches) == args.num_batches:
            break
    if not batches:
        raise UsageError(f"task {args.target!r} yielded no batch")
    return model, [BatchStep(b, task.loss) for b in batches]


def _from_script(args: argparse.Namespace) -> tuple[Any, list[Any]]:
    from ampkit.diagnose.preflight.steps import CapturedStep
    from ampkit.diagnose.script.first_steps import capture_first_steps

    try:
        first = capture_first_steps(args.target, args.args, module=args.as_module, steps=args.steps)
    except ModuleNotFoundError as exc:
        raise UsageError(f"-m {args.target}: {exc}") from exc
    if first.missing is not None:
        ended = f"; it ended by {first.ended}" + (f" ({first.error})" if first.error else "")
        raise UsageError(f"{args.target} never made {first.missing}, so preflight has no step to replay{ended}. "
                         "For a task defined in the file, pass FILE:ATTR")
    return first.captures[0].root, [CapturedStep(c) for c in first.captures]


def _from_model_dir(args: argparse.Namespace, directory: Path) -> tuple[Any, list[Any]]:
    from ampkit.diagnose.preflight.hfdir import load_model_dir
    from ampkit.diagnose.preflight.steps import BatchStep

    if args.args:
        raise UsageError(f"{args.target} is a model directory and takes no arguments (got {' '.join(args.args)!r}); "
                         "options come before TARGET: ampkit preflight --text FILE MODEL_DIR")
    if (args.text is None) == (args.batches is None):
        raise UsageError(f"{args.target} is a model directory: give exactly one of --text FILE or --batches FILE")
    for flag in ("text", "batches"):
        given = getattr(args, flag)
        if given is not None and not Path(given).is_file():
            raise UsageError(f"--{flag} {given!r}: no such file")
    try:
        model, batches, loss = load_model_dir(directory, text=args.text, batches=args.batches,
                                              num_batches=args.num_batches, batch_size=args.batch_size,
                                              seq_len=args.seq_len)
    except (ValueError, OSError) as exc:
        raise UsageError(f"{args.target}: {exc}") from exc
    return model, [BatchStep(b, loss) for b in batches]
