"""``ampkit lint`` on public training repositories: its false-positive rate per rule, measured again.

benchmarks/lint_real_repos.json lists the repositories, each at a pinned commit, and every finding
the linter reported there, keyed by (repository, path, line, code), with a label read off the code
(``true`` or ``false`` positive) and a one-line reason.  This script lints local copies of those
repositories, matches what it finds to the labels and prints, per rule, the findings, the false
positives and the false-positive rate.  A finding no label covers is printed as UNLABELLED (read
the code, add its label to the JSON), and a label that matched nothing as STALE (the rule changed:
a false positive fixed, or a true one lost); either makes the exit status 1.

The copies live outside the project tree, one directory per repository under ROOT, named as in the
JSON's ``name``.  A full clone at the commit is what was measured; what lint reads is the ``*.py``
files and the manifests that name torch's version (``pyproject.toml``, ``setup.py``, ``setup.cfg``,
``requirements.txt``, for AMP113), so a sparse export of those is enough.  For each repository::

    git clone https://github.com/OWNER/NAME ROOT/NAME && git -C ROOT/NAME checkout COMMIT

Run: ``.venv/bin/python benchmarks/lint_real_repos.py ROOT [--data benchmarks/lint_real_repos.json]``
(a missing copy is reported with its clone command and skipped; ``--require-all`` makes it an error).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from ampkit.lint import lint_paths

DATA = Path(__file__).with_suffix(".json")

Key = tuple[str, str, int, str]


def clone_command(root: Path, repo: dict[str, str]) -> str:
    target = root / repo["name"]
    return f"git clone https://github.com/{repo['github']} {target} && git -C {target} checkout {repo['commit']}"


def lint_repository(root: Path, name: str) -> tuple[dict[Key, str], int]:
    """Findings of one checkout, keyed by (repository, path inside it, line, code) -> message."""
    base = root / name
    report = lint_paths([str(base)])
    found = {}
    for v in report.violations:
        path = Path(v.path).resolve().relative_to(base.resolve()).as_posix()
        found[(name, path, v.line, v.code)] = v.message
    return found, report.files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="directory holding one checkout per repository")
    parser.add_argument("--data", type=Path, default=DATA, help="labels (default: %(default)s)")
    parser.add_argument("--require-all", action="store_true", help="a missing checkout is an error")
    args = parser.parse_args(argv)
    data = json.loads(args.data.read_text())
    labels = {(e["repo"], e["path"], e["line"], e["code"]): e for e in data["labels"]}

    found: dict[Key, str] = {}
    linted = []
    missing = []
    print(f"{'repository':<24} {'commit':<12} {'files':>6} {'findings':>9}")
    for repo in data["repositories"]:
        if not (args.root / repo["name"]).is_dir():
            missing.append(repo)
            continue
        findings, files = lint_repository(args.root, repo["name"])
        found.update(findings)
        linted.append(repo["name"])
        print(f"{repo['name']:<24} {repo['commit'][:12]:<12} {files:>6} {len(findings):>9}")
    for repo in missing:
        print(f"MISSING {repo['name']}: {clone_command(args.root, repo)}", file=sys.stderr)

    unlabelled = sorted(set(found) - set(labels))
    stale = sorted(k for k in set(labels) - set(found) if k[0] in linted)
    for key in unlabelled:
        print(f"UNLABELLED {key[0]}/{key[1]}:{key[2]} {key[3]} {found[key]}")
    for key in stale:
        print(f"STALE {key[0]}/{key[1]}:{key[2]} {key[3]} (labelled {labels[key]['label']}: {labels[key]['reason']})")

    judged = [labels[k] for k in found if k in labels]
    findings = Counter(e["code"] for e in judged)
    false = Counter(e["code"] for e in judged if e["label"] == "false")
    print(f"\n{'rule':<8} {'findings':>9} {'FP':>4} {'FP rate':>8}")
    for code in sorted(findings):
        print(f"{code:<8} {findings[code]:>9} {false[code]:>4} {false[code] / findings[code]:>8.1%}")
    total = sum(findings.values())
    if total:
        print(f"{'all':<8} {total:>9} {sum(false.values()):>4} {sum(false.values()) / total:>8.1%}")
    for e in sorted((e for e in judged if e["label"] == "false"), key=lambda e: (e["code"], e["repo"], e["path"])):
        print(f"false positive: {e['code']} {e['repo']}/{e['path']}:{e['line']}: {e['reason']}")
    print(f"\n{len(linted)} of {len(data['repositories'])} repositories linted; "
          f"{len(unlabelled)} unlabelled finding(s), {len(stale)} stale label(s)")
    return 1 if unlabelled or stale or (missing and args.require_all) else 0


if __name__ == "__main__":
    sys.exit(main())
