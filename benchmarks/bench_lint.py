"""Cost of ``ampkit lint`` relative to parsing the same files with ``ast.parse``, side by side.

Corpus: the installed torch source plus the training libraries that ``tests/lint/test_real_code.py``
lints (accelerate, Lightning, transformers, ... whichever are installed).  Every file is read into
memory first, so disk and page cache are out of the measure.  The files are cut into chunks; for
each chunk the two measures run back to back, in alternating order (lint first on even chunks,
``ast.parse`` first on odd ones), so a frequency change or a noisy neighbour hits both alike:

* parse: ``ast.parse(source)`` of every file of the chunk;
* lint:  ``ampkit.lint.lint_source(source, path)`` of every file (screen, parse or ``compile()``,
  all rules, ``# noqa``), the work ``ampkit lint`` does per file.

Times are CPU time of this thread (``time.thread_time``), so other processes on a shared machine
do not count.  Each repetition sums the chunks; the ratio printed is median(lint) / median(parse)
over the repetitions, with each repetition's own ratio so that its spread can be judged.
A ratio near 1 means the linter costs about one parse of the code it checks.

Run: ``.venv/bin/python benchmarks/bench_lint.py [--reps 3] [--chunk 50] [--every 1]``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ampkit.lint import iter_python_files, lint_source

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.lint.test_real_code import LIBRARIES, package_root  # the same corpus as the test


def load_corpus(every: int) -> tuple[list[str], list[tuple[str, bytes]]]:
    roots = [(name, root) for name in LIBRARIES if (root := package_root(name)) is not None]
    files = list(iter_python_files([root for _, root in roots]))[::every]
    return [name for name, _ in roots], [(path, Path(path).read_bytes()) for path in files]


def _parse_all(chunk: list[tuple[str, bytes]]) -> None:
    for path, source in chunk:
        # Newer-Python syntax fails here; lint reports it as AMP000 after the same failed parse.
        with contextlib.suppress(SyntaxError, ValueError):
            ast.parse(source, filename=path)


def _lint_all(chunk: list[tuple[str, bytes]]) -> None:
    for path, source in chunk:
        lint_source(source, path)


def _timed(work: Callable[[list[tuple[str, bytes]]], None], chunk: list[tuple[str, bytes]]) -> float:
    start = time.thread_time()
    work(chunk)
    return time.thread_time() - start


def bench(corpus: list[tuple[str, bytes]], reps: int, chunk_size: int) -> tuple[list[float], list[float]]:
    chunks = [corpus[i:i + chunk_size] for i in range(0, len(corpus), chunk_size)]
    _parse_all(chunks[0])  # warm-up: imports, rule tables, allocator
    _lint_all(chunks[0])
    parse_totals, lint_totals = [], []
    for rep in range(reps):
        parse_s = lint_s = 0.0
        for i, chunk in enumerate(chunks):
            if (i + rep) % 2 == 0:
                lint_s += _timed(_lint_all, chunk)
                parse_s += _timed(_parse_all, chunk)
            else:
                parse_s += _timed(_parse_all, chunk)
                lint_s += _timed(_lint_all, chunk)
        parse_totals.append(parse_s)
        lint_totals.append(lint_s)
        print(f"  repetition {rep + 1}: parse {parse_s:6.2f} s, lint {lint_s:6.2f} s, ratio {lint_s / parse_s:.3f}",
              flush=True)
    return parse_totals, lint_totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="repetitions over the whole corpus")
    ap.add_argument("--chunk", type=int, default=50, help="files per interleaved chunk")
    ap.add_argument("--every", type=int, default=1, help="take every N-th file (a quicker, smaller corpus)")
    args = ap.parse_args()
    names, corpus = load_corpus(args.every)
    lines = sum(source.count(b"\n") for _, source in corpus)
    print(f"python {sys.version.split()[0]}; corpus: {', '.join(names)}: {len(corpus)} files, {lines:,} lines")
    parse_totals, lint_totals = bench(corpus, args.reps, args.chunk)
    parse_med, lint_med = statistics.median(parse_totals), statistics.median(lint_totals)
    print(f"{'':<8}{'CPU s':>8}{'lines/s':>12}")
    print(f"{'parse':<8}{parse_med:>8.2f}{lines / parse_med:>12,.0f}")
    print(f"{'lint':<8}{lint_med:>8.2f}{lines / lint_med:>12,.0f}")
    print(f"lint / ast.parse = {lint_med / parse_med:.3f} (median of {args.reps} repetitions)")


if __name__ == "__main__":
    main()
