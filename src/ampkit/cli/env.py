"""ampkit env: the environment record users paste into bug reports.

Prints torch/python/CUDA/driver versions, the CPU model and its bf16/fp16 ISA flags, GPUs,
thread counts, the dtypes autocast accepts per device and the measured matmul throughput per
dtype per device (--no-measure skips the measurement).  --json prints the same record
`ampkit verify` stores in report.json.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ampkit.cli.errors import UsageError

__all__ = ["register", "run"]

MIN_MATMUL_N = 16
MAX_MATMUL_N = 8192
"""8192: three fp32 matrices are 768 MB; a larger n spends seconds per dtype and can exhaust memory."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "env", help="print the environment record (versions, CPU/GPU, autocast dtypes, matmul TFLOP/s)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print the record as JSON")
    p.add_argument("--no-measure", action="store_true", help="skip the matmul throughput measurement")
    p.add_argument("--matmul-n", type=int, default=512, metavar="N",
                   help="matrix size of the throughput measurement (default 512)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ampkit.env import collect_environment, format_environment

    if not MIN_MATMUL_N <= args.matmul_n <= MAX_MATMUL_N:
        raise UsageError(f"--matmul-n {args.matmul_n}: use a matrix size from {MIN_MATMUL_N} to {MAX_MATMUL_N} "
                         "(default 512; the measurement holds three n x n matrices per dtype)")
    env = collect_environment(full=True, measure=not args.no_measure, matmul_n=args.matmul_n)
    print(json.dumps(env, indent=2) if args.json else format_environment(env))
    return 0
