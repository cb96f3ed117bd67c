"""``ampkit lint`` on real code: the installed torch source plus every installed training library.

Nothing may crash, and every hit must be listed, with its judgement, in docs/lint.md (checked
for the library versions the document was written against).  The linter's speed on the same corpus
is measured by benchmarks/bench_lint.py, not here: tests do not assert timings.
"""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ampkit.lint import LintReport, lint_paths

# Training libraries linted when installed (none is installed just for this test);
# benchmarks/bench_lint.py times the linter on the same corpus.
LIBRARIES = ("torch", "accelerate", "lightning", "pytorch_lightning", "lightning_fabric", "transformers",
             "deepspeed", "timm", "torchtune", "torchtitan")
DOCS = Path(__file__).parents[2] / "docs" / "lint.md"


@dataclass(frozen=True)
class RealRun:
    roots: dict[str, str]
    report: LintReport


def package_root(name: str) -> str | None:
    spec = importlib.util.find_spec(name)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    # str(): an imported package with a lazy module (transformers) lists its folder as a Path
    return str(next(iter(spec.submodule_search_locations)))


def _version(name: str) -> str | None:
    # The distribution that ships the package (pytorch-lightning ships lightning_fabric); the
    # local build tag (+cpu, +cu128) does not change the Python source.
    for dist in importlib.metadata.packages_distributions().get(name, []):
        return importlib.metadata.version(dist).split("+")[0]
    return None


@pytest.fixture(scope="module")
def real_run() -> RealRun:
    roots = {name: root for name in LIBRARIES if (root := package_root(name)) is not None}
    # The test process holds torch and whatever else the suite imported.  Linting builds millions of
    # AST nodes, which set off about a hundred full collections of the cyclic GC, each walking every
    # one of those long-lived objects (a third of the lint's time here, none of it the linter's).
    # Frozen, they are left out of the collections; the lint's own objects are collected as usual.
    gc.freeze()
    try:
        report = lint_paths(list(roots.values()))
    finally:
        gc.unfreeze()
    return RealRun(roots, report)


def _relative(run: RealRun, path: str) -> tuple[str, str]:
    for name, root in run.roots.items():
        if path.startswith(root + os.sep):
            return name, os.path.relpath(path, os.path.dirname(root)).replace(os.sep, "/")
    raise AssertionError(f"{path} is under none of {run.roots}")


@pytest.mark.slow
def test_real_code_lints_installed_libraries_without_crashing(real_run: RealRun) -> None:
    assert "torch" in real_run.roots
    assert real_run.report.files > 2000
    assert real_run.report.lines > 1_000_000
    # Files that do not parse are reported as AMP000 and the rest are still checked.
    unreadable = [v for v in real_run.report.violations if v.code == "AMP000" and "syntax error" not in v.message]
    assert unreadable == []


def _documented() -> tuple[dict[str, str], set[tuple[str, int, int, str]]]:
    text = DOCS.read_text()
    versions = dict(re.findall(r"^\| `?([\w.-]+)`? \| `?(\d[\w.+-]*)`? \| measured \|$", text, re.MULTILINE))
    hits = {(path, int(line), int(col), code) for path, line, col, code in re.findall(
        r"^\| `([\w./-]+\.py):(\d+):(\d+)` \| (AMP\d{3}) \| (?:true|false) positive", text, re.MULTILINE)}
    return versions, hits


@pytest.mark.slow
def test_real_code_every_hit_is_documented_with_a_judgement(real_run: RealRun) -> None:
    versions, documented = _documented()
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    checked = {name for name in real_run.roots if versions.get(name) == _version(name)}
    if not checked:
        pytest.skip(f"docs/lint.md was measured on other versions: {versions}")
    found = set()
    for v in real_run.report.violations:
        library, path = _relative(real_run, v.path)
        if library in checked and (v.code != "AMP000" or versions.get("python") == python):
            found.add((path, v.line, v.col, v.code))
    expected = {hit for hit in documented
                if hit[0].split("/")[0] in checked and (hit[3] != "AMP000" or versions.get("python") == python)}
    assert sorted(found - expected) == [], "hits missing from docs/lint.md"
    assert sorted(expected - found) == [], "docs/lint.md lists hits the linter no longer reports"
