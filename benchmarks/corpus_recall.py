"""How well the doctor and the linter find the failures of a corpus: recall, culprits, false errors.

Runs the real ``ampkit doctor --json`` and ``ampkit lint --format json`` as subprocesses on every
case of a manifest (tests/cases/manifest.json's format) and on its fixed variant, and scores them
against the case's expectations:

* required codes: the share of (case, code) pairs in ``expect`` that the doctor reported;
* culprits: the share of cases with a ``culprit`` whose finding of that code names that module;
* fixed twins: how many fixed variants earned an error-severity finding or one of ``expect``, and
  how many failed under the doctor (a non-zero exit status: each exits 0 when run plainly);
* lint: the share of (case, code) pairs in ``lint`` the linter reported on the script, and how
  many fixed variants it still flags with one of them;
* crashes: doctor runs that wrote no report.

``--names`` (or ``--names-file``, one name per line) restricts the run to some cases, e.g. the
held-out half of a new batch of families, so that the number measured on them is reported
alone.  Machine properties (``requires``) are not evaluated here: a case that needs one is scored
as if it held, which the corpus tests (tests/diagnose/test_doctor_cases.py) do properly.

Run: ``.venv/bin/python benchmarks/corpus_recall.py [--manifest tests/cases/manifest.json]
[--names a,b] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the corpus's judging rules, shared with its tests: tests/helpers/corpus_judge.py
from tests.helpers.corpus_judge import (  # noqa: E402
    culprit_modules,
    culprit_named,
    fixed_twin_faults,
    missing_codes,
    unexpected_errors,
)

DEFAULT_MANIFEST = REPO / "tests" / "cases" / "manifest.json"
DOCTOR_TIMEOUT_S = 300
AMPKIT = [sys.executable, "-c", "import sys; from ampkit.cli.main import main; sys.exit(main())"]
"""The ``ampkit`` command of this interpreter's environment."""


@dataclass
class CaseScore:
    name: str
    required: list[str]
    missed: list[str]
    culprit: str | None = None
    culprit_named: list[str] = field(default_factory=list)
    culprit_ok: bool | None = None
    unexpected_errors: list[str] = field(default_factory=list)
    fixed_errors: list[str] = field(default_factory=list)
    fixed_exit: int | None = None
    """The fixed variant's exit status under the doctor (it exits 0 when run plainly)."""
    lint_required: list[str] = field(default_factory=list)
    lint_missed: list[str] = field(default_factory=list)
    lint_on_fixed: list[str] = field(default_factory=list)
    crashed: str | None = None


def _doctor(script: Path, workdir: Path) -> dict[str, Any] | str:
    """The doctor's report on ``script``, or why there is none."""
    out = workdir / f"{script.stem}.doctor.json"
    proc = subprocess.run(
        [*AMPKIT, "doctor", "--json", str(out), script.name],
        cwd=script.parent, capture_output=True, text=True, timeout=DOCTOR_TIMEOUT_S,
    )
    if not out.exists():
        return f"exit {proc.returncode}, no report: {proc.stderr.strip()[-300:]}"
    return json.loads(out.read_text())


def _lint_codes(script: Path) -> set[str]:
    proc = subprocess.run([*AMPKIT, "lint", "--format", "json", str(script)],
                          capture_output=True, text=True, timeout=60)
    return {v["code"] for v in json.loads(proc.stdout)["violations"]}


def score_case(case: dict[str, Any], cases_dir: Path, workdir: Path) -> CaseScore:
    expect = list(case["expect"])
    score = CaseScore(case["name"], required=expect, missed=[])
    report = _doctor(cases_dir / case["script"], workdir)
    if isinstance(report, str):
        score.crashed, score.missed = report, expect
    else:
        findings = report["findings"]
        score.missed = missing_codes(case, findings)
        score.unexpected_errors = unexpected_errors(case, findings)
        if case.get("culprit"):
            code, module = case["culprit"]["code"], case["culprit"]["module"]
            score.culprit = f"{code}@{module or '<model forward>'}"
            score.culprit_named = [str(m) for m in culprit_modules(case, findings) or []]
            score.culprit_ok = culprit_named(case, findings)
    fixed = _doctor(cases_dir / case["fixed"], workdir)
    if isinstance(fixed, str):
        score.crashed = (score.crashed or "") + f" fixed: {fixed}"
    else:
        score.fixed_errors = fixed_twin_faults(case, fixed["findings"])
        score.fixed_exit = fixed["environment"]["exit_status"]
    score.lint_required = list(case.get("lint", []))
    if score.lint_required:
        score.lint_missed = sorted(set(score.lint_required) - _lint_codes(cases_dir / case["script"]))
        score.lint_on_fixed = sorted(set(score.lint_required) & _lint_codes(cases_dir / case["fixed"]))
    return score


def summarize(scores: list[CaseScore]) -> dict[str, Any]:
    required = sum(len(s.required) for s in scores)
    found = required - sum(len(s.missed) for s in scores)
    culprits = [s for s in scores if s.culprit is not None]
    lint_required = sum(len(s.lint_required) for s in scores)
    lint_found = lint_required - sum(len(s.lint_missed) for s in scores)
    return {
        "cases": len(scores),
        "required_codes": f"{found}/{required}",
        "required_recall": round(found / required, 3) if required else None,
        "cases_with_every_required_code": sum(not s.missed for s in scores),
        "culprits": f"{sum(bool(s.culprit_ok) for s in culprits)}/{len(culprits)}",
        "fixed_twins_with_errors": sum(bool(s.fixed_errors) for s in scores),
        "fixed_twins_failing_under_the_doctor": sum(s.fixed_exit not in (0, None) for s in scores),
        "scripts_with_unexpected_errors": sum(bool(s.unexpected_errors) for s in scores),
        "lint_codes": f"{lint_found}/{lint_required}",
        "lint_on_fixed_twins": sum(bool(s.lint_on_fixed) for s in scores),
        "crashes": sum(s.crashed is not None for s in scores),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", type=Path, default=DEFAULT_MANIFEST)
    parser.add_argument("--names", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--names-file", type=Path, help="a file of case names, one per line")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the per-case scores and the summary here")
    args = parser.parse_args(argv)
    cases = json.loads(args.manifest.read_text())["cases"]
    names = {n for n in args.names.split(",") if n}
    if args.names_file:
        names |= {n.strip() for n in args.names_file.read_text().splitlines() if n.strip()}
    if names:
        unknown = names - {c["name"] for c in cases}
        if unknown:
            parser.error(f"no such case in {args.manifest}: {', '.join(sorted(unknown))}")
        cases = [c for c in cases if c["name"] in names]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        scores = list(pool.map(lambda c: score_case(c, args.manifest.parent, Path(tmp)), cases))
    for s in scores:
        problems = [f"missed {s.missed}" if s.missed else "",
                    f"culprit {s.culprit} named {s.culprit_named}" if s.culprit_ok is False else "",
                    f"unexpected errors {s.unexpected_errors}" if s.unexpected_errors else "",
                    f"fixed twin errors {s.fixed_errors}" if s.fixed_errors else "",
                    f"fixed twin exits {s.fixed_exit} under the doctor" if s.fixed_exit not in (0, None) else "",
                    f"lint missed {s.lint_missed}" if s.lint_missed else "",
                    f"lint on fixed {s.lint_on_fixed}" if s.lint_on_fixed else "",
                    f"CRASH {s.crashed}" if s.crashed else ""]
        print(f"{s.name:40s} {'; '.join(p for p in problems if p) or 'ok'}")
    summary = summarize(scores)
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "cases": [asdict(s) for s in scores]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
