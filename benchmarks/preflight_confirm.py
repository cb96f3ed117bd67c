"""Confirm the preflight corpus by training: every case under every trained format, with and without the
policy preflight proposes, against an fp32 run of the same seed and batches.

    python benchmarks/preflight_confirm.py [--cases NAME,NAME] [--out tests/preflight_cases/trained.json]

For each case of tests/preflight_cases (a Task, see its ``_case.py``):

1. ``preflight_model`` on the case's first ``preflight_batches`` batches, every format (the trained ones,
   fp8-rowwise-gw-hp where ``ampkit.precision.PRECISION_NAMES`` has it, and MXFP8/NVFP4 where
   ``ampkit.diagnose.core.blockcast`` exists);
2. 30 optimizer steps in fp32, then in each trained format with ``ampkit.MixedPrecision(fmt)`` and the
   task's optimizer, on the same 30 batches from the same initial weights; each run records its losses,
   the steps whose loss was non-finite, the steps the engine skipped (``StepResult.skipped``), an
   exception if one ended it, and its loss-curve distance to fp32 (``verify.compare.loss_distance``,
   judged against ``Tolerances().loss``);
3. where preflight proposes a policy, the same run with it applied (``keep_fp32=``, ``fp8_filter=``,
   ``scaler=DynamicLossScaler(init_scale=...)``); where expected.json expects a policy other than the one
   preflight proposed (or preflight proposed none), a run with the expected policy too, which says whether
   the expectation holds;
4. for MXFP8 and NVFP4, which ampkit does not train: the worst operand ``underflows%`` and the lowest module
   SQNR preflight measured through torchao's casts.

Writes ``trained.json`` atomically (the torch and torchao versions and the CPU, as ``ampkit env`` reports
it, included) and prints the agreement table: case × format, the expected and the preflight verdict, what
training showed, and whether preflight agrees with training (tests/helpers/preflight_judge.py has the rule).
On 2 cores the whole corpus takes a few minutes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the corpus's judging rules, shared with its tests: tests/helpers/preflight_judge.py
from ampkit import MixedPrecision  # noqa: E402
from ampkit._util.io import atomic_write_text  # noqa: E402
from ampkit.diagnose.preflight.api import preflight_model  # noqa: E402
from ampkit.diagnose.preflight.result import FormatReport, PreflightResult  # noqa: E402
from ampkit.env import collect_environment  # noqa: E402
from ampkit.precision import PRECISION_NAMES  # noqa: E402
from ampkit.scaler import DynamicLossScaler  # noqa: E402
from ampkit.tasks.base import Task  # noqa: E402
from ampkit.verify.compare import Tolerances, loss_distance  # noqa: E402
from tests.helpers.preflight_judge import (  # noqa: E402
    EXPECTED,
    STEPS,
    TRAINED,
    TRAINED_FORMATS,
    WHAT_IF_FORMATS,
    agrees,
    case_names,
    load_case,
    load_json,
    policy_matches,
    run_passed,
)

SCHEMA = "ampkit.preflight_corpus_training/1"
SEED = 0


def formats_here() -> tuple[list[str], list[str]]:
    """(trained formats, what-if formats) this checkout has: fp8-rowwise-gw-hp needs the engine's precision,
    MXFP8/NVFP4 the block-format emulation."""
    trained: list[str] = [f for f in TRAINED_FORMATS if f in PRECISION_NAMES]
    what_if = list(WHAT_IF_FORMATS) if importlib.util.find_spec("ampkit.diagnose.core.blockcast") else []
    return trained, what_if


def train(task: Task, fmt: str, batches: list[Any], policy: dict[str, Any] | None = None) -> dict[str, Any]:
    """``STEPS`` steps of ``task``'s model in ``fmt`` (``fp32`` too) under ``policy``; the run's record."""
    policy = policy or {}
    init_scale = policy.get("init_scale") or policy.get("init_scale_at_least")
    mp = MixedPrecision(fmt, device="cpu", keep_fp32=list(policy.get("keep_fp32") or []),
                        fp8_filter=list(policy.get("fp8_filter") or []) or None,
                        scaler=DynamicLossScaler(init_scale=init_scale) if init_scale else None)
    model = mp.prepare(task.build_model(SEED))
    optimizer = task.build_optimizer(model)
    losses: list[float | None] = []
    skipped = nonfinite = 0
    error = None
    try:
        for batch in batches:
            with mp.autocast():
                loss = task.loss(model, batch)
            value = float(loss.detach())  # a host read per step: the benchmark records every loss
            losses.append(value if math.isfinite(value) else None)
            nonfinite += not math.isfinite(value)
            mp.backward(loss)
            skipped += mp.step(optimizer).skipped
    except RuntimeError as exc:  # fp16's masked_fill with -1e9 raises: the run failed
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    finally:
        mp.close()
    return {"policy": policy or None, "loss": losses, "nonfinite_steps": nonfinite, "skipped_steps": skipped,
            "error": error}


def judged(run: dict[str, Any], base: list[float | None], tol: Tolerances) -> dict[str, Any]:
    """``run`` with its loss distance to fp32 and whether it passed."""
    complete = run["error"] is None and len(run["loss"]) == len(base)
    distance = loss_distance(run["loss"], base, warmup=0, window=tol.window(len(base))) if complete else None
    run["loss_distance"] = distance if distance is None or math.isfinite(distance) else None
    run["passed"] = run_passed(run, tol.loss)
    return run


def policy_of(report: FormatReport) -> dict[str, Any]:
    p = report.policy
    return {"keep_fp32": list(p.keep_fp32), "fp8_filter": list(p.fp8_filter), "init_scale": p.init_scale}


def what_if_evidence(report: FormatReport) -> dict[str, Any]:
    """The worst operand flush share and the lowest module SQNR preflight measured (torchao's casts)."""
    flush = [(ops.get("underflows%", 0.0), layer.module, name) for layer in report.layers
             for name, ops in layer.operands.items()]
    sqnr = [(v, layer.module) for layer in report.layers for v in (layer.forward_sqnr_db, layer.grad_sqnr_db)
            if v is not None and not math.isnan(v)]
    worst = max(flush, default=None)
    lowest = min(sqnr, default=None)
    return {"worst_underflows_pct": None if worst is None else {"value": worst[0], "layer": worst[1], "operand": worst[2]},
            "lowest_sqnr_db": None if lowest is None else {"value": lowest[0], "module": lowest[1]}}


def training_batches(task: Task) -> list[Any]:
    """The task's first ``STEPS`` batches of seed ``SEED``: what every run trains on (preflight reads the first)."""
    stream = task.batches(SEED, torch.device("cpu"))
    return [next(stream) for _ in range(STEPS)]


def confirm_case(name: str, expected: dict[str, Any], trained: list[str], what_if: list[str],
                 tol: Tolerances) -> dict[str, Any]:
    task = load_case(name)
    batches = training_batches(task)
    samples = batches[: getattr(task, "preflight_batches", 1)]
    result = preflight_model(task.build_model(SEED), samples, loss_fn=task.loss, formats=[*trained, *what_if])
    return confirm_by_training(task, batches, result, expected, what_if, tol)


def confirm_by_training(task: Task, batches: list[Any], result: PreflightResult, expected: dict[str, Any],
                        what_if: list[str], tol: Tolerances) -> dict[str, Any]:
    """The case's record: fp32 and every format of ``result`` trained on ``batches`` (the what-if formats: their
    evidence), with preflight's policy and, where ``expected`` names another, the expected one."""
    base = train(task, "fp32", batches)
    record: dict[str, Any] = {"fp32": base, "formats": {}}
    for report in result.formats:
        entry: dict[str, Any] = {"preflight": {"verdict": report.verdict, "policy": policy_of(report)}}
        want = expected["formats"].get(report.format, {})
        if report.format in what_if:
            entry.update(what_if_evidence(report))
        else:
            entry["plain"] = judged(train(task, report.format, batches), base["loss"], tol)
            entry["policy"] = (judged(train(task, report.format, batches, policy_of(report)), base["loss"], tol)
                               if report.verdict == "policy" else None)
            expected_policy = want.get("policy")
            proposed = entry["preflight"]["policy"] if report.verdict == "policy" else None
            entry["expected_policy"] = (judged(train(task, report.format, batches, expected_policy), base["loss"], tol)
                                        if expected_policy and not (proposed and policy_matches(proposed, expected_policy))
                                        else None)
        record["formats"][report.format] = entry
    return record


def outcome(entry: dict[str, Any]) -> str:
    """What training showed, in a few words."""
    if "plain" not in entry:
        flush, sqnr = entry["worst_underflows_pct"], entry["lowest_sqnr_db"]
        return (f"not trained: worst flush {flush['value']:.1f}% ({flush['layer']} {flush['operand']})" if flush else
                "not trained") + (f", lowest SQNR {sqnr['value']:.1f} dB ({sqnr['module']})" if sqnr else "")
    words = [_run_words(entry["plain"])]
    if entry["policy"] is not None:
        words.append(f"with policy: {_run_words(entry['policy'])}")
    if entry["expected_policy"] is not None:
        words.append(f"with expected policy: {_run_words(entry['expected_policy'])}")
    return "; ".join(words)


def _run_words(run: dict[str, Any]) -> str:
    if run["error"]:
        return f"FAIL ({run['error'][:60]})"
    parts = [f"distance {run['loss_distance']:.4f}" if run["loss_distance"] is not None else "distance inf"]
    if run["nonfinite_steps"]:
        parts.append(f"{run['nonfinite_steps']} non-finite")
    if run["skipped_steps"]:
        parts.append(f"{run['skipped_steps']} skipped")
    return ("pass" if run["passed"] else "FAIL") + f" ({', '.join(parts)})"


def agreement_rows(expected: dict[str, Any], trained: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    """(case, format, expected verdict, preflight verdict, training, agree) per pair, in corpus order."""
    rows = []
    for name, record in trained["cases"].items():
        for fmt, entry in record["formats"].items():
            verdict = entry["preflight"]["verdict"]
            want = expected["cases"].get(name, {}).get("formats", {}).get(fmt, {}).get("verdict", "?")
            if "plain" in entry:
                policy, wanted = entry["policy"], entry["expected_policy"]
                agree = "yes" if agrees(verdict, plain_passed=entry["plain"]["passed"],
                                        policy_passed=None if policy is None else policy["passed"],
                                        expected_policy_passed=None if wanted is None else wanted["passed"]) else "NO"
            else:
                agree = "-"
            rows.append((name, fmt, want, verdict, outcome(entry), agree))
    return rows


def print_table(rows: list[tuple[str, str, str, str, str, str]]) -> None:
    header = ("case", "format", "expected", "preflight", "training", "agree")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    judged_rows = [r for r in rows if r[5] != "-"]
    agreed = sum(r[5] == "yes" for r in judged_rows)
    if judged_rows:
        print(f"\npreflight agrees with training on {agreed} of {len(judged_rows)} trained pairs "
              f"({agreed / len(judged_rows):.0%})")


def environment() -> dict[str, Any]:
    env = collect_environment("cpu", full=True)
    return {"torch": torch.__version__, "torchao": _torchao_version(), "python": env["python"], "cpu": env["cpu"],
            "threads": env["threads"]}


def _torchao_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("torchao")
    except Exception:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cases", help="comma-separated case names (default: all); the others keep their record")
    parser.add_argument("--out", type=Path, default=TRAINED, help=f"where to write the record (default {TRAINED})")
    args = parser.parse_args(argv)
    names = case_names() if not args.cases else [c.strip() for c in args.cases.split(",")]
    unknown = sorted(set(names) - set(case_names()))
    if unknown:
        parser.error(f"--cases: no case {', '.join(unknown)}; the corpus has {', '.join(case_names())}")
    expected = load_json(EXPECTED)
    trained_formats, what_if = formats_here()
    missing = [f for f in (*TRAINED_FORMATS, *WHAT_IF_FORMATS) if f not in (*trained_formats, *what_if)]
    if missing:
        print(f"not judged here: {', '.join(missing)} (this checkout has no engine precision or emulation for them)")
    tol = Tolerances()
    previous = load_json(args.out) if args.cases and args.out.is_file() else {"cases": {}}
    record: dict[str, Any] = {"schema": SCHEMA, "steps": STEPS, "seed": SEED, "tolerance": {"loss": tol.loss, "window": tol.window(STEPS)},
              "environment": environment(), "cases": dict(previous["cases"])}
    warnings.filterwarnings("ignore", message=r"precision='fp8.*' on the CPU")
    for name in names:
        start = time.perf_counter()
        record["cases"][name] = confirm_case(name, expected["cases"][name], trained_formats, what_if, tol)
        print(f"{name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    record["cases"] = {n: record["cases"][n] for n in case_names() if n in record["cases"]}
    atomic_write_text(args.out, json.dumps(record, indent=1, allow_nan=False) + "\n")
    print_table(agreement_rows(expected, record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
