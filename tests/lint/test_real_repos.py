"""benchmarks/lint_real_repos.py and its labels: the false-positive rate per rule, measured again."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "lint_real_repos.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("lint_real_repos", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_real_repos_labels_name_listed_repositories_once_each(bench) -> None:
    data = json.loads(bench.DATA.read_text())
    names = {r["name"] for r in data["repositories"]}
    assert len(names) == len(data["repositories"]) >= 8
    assert all(len(r["commit"]) == 40 for r in data["repositories"])
    keys = [(e["repo"], e["path"], e["line"], e["code"]) for e in data["labels"]]
    assert len(keys) == len(set(keys))
    assert {e["repo"] for e in data["labels"]} <= names
    assert all(e["label"] in ("true", "false") and e["reason"].strip() for e in data["labels"])


def test_real_repos_reports_rates_unlabelled_and_stale(bench, tmp_path: Path, capsys) -> None:
    (tmp_path / "repo" / "src").mkdir(parents=True)
    (tmp_path / "repo" / "src" / "train.py").write_text(
        "import torch\n\nstate = torch.load('a.pt')\nother = torch.load('b.pt')\n")
    data = {"repositories": [{"name": "repo", "github": "o/repo", "commit": "0" * 40},
                             {"name": "absent", "github": "o/absent", "commit": "1" * 40}],
            "labels": [{"repo": "repo", "path": "src/train.py", "line": 3, "code": "AMP113",
                        "label": "false", "reason": "r"},
                       {"repo": "repo", "path": "src/train.py", "line": 9, "code": "AMP113",
                        "label": "true", "reason": "r"}]}
    labels = tmp_path / "labels.json"
    labels.write_text(json.dumps(data))
    status = bench.main([str(tmp_path), "--data", str(labels)])
    out = capsys.readouterr()
    assert status == 1
    assert "UNLABELLED repo/src/train.py:4 AMP113" in out.out
    assert "STALE repo/src/train.py:9 AMP113" in out.out
    rows = [line.split() for line in out.out.splitlines()]
    assert ["AMP113", "1", "1", "100.0%"] in rows  # the labelled finding; the unlabelled one is not judged
    assert f"git clone https://github.com/o/absent {tmp_path / 'absent'}" in out.err
