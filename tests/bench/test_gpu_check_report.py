"""The GPU check's thresholds table, its judgement, and the report files it writes."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from gpucheck.checks import check, median_ratio
from gpucheck.report import base_report, overall_status, render_markdown, write_report
from gpucheck.table import SECTIONS, THRESHOLDS, judge, threshold

DOC = Path(__file__).resolve().parents[2] / "docs" / "gpu-check.md"


def test_thresholds_docs_table_equals_the_scripts() -> None:
    rows = re.findall(r"^\| `([a-z_0-9]+\.[a-z_0-9]+)` \| (.+?) \|$", DOC.read_text(), flags=re.M)
    assert rows == [(t.key, t.text) for t in THRESHOLDS]


def test_thresholds_every_section_has_one_and_every_key_names_a_section() -> None:
    sections = {s.name for s in SECTIONS}
    assert {t.key.split(".")[0] for t in THRESHOLDS} == sections


@pytest.mark.parametrize(("key", "measured", "status"), [
    ("ratios.engine_vs_recipe", 1.02, "pass"),
    ("ratios.engine_vs_recipe", 1.0201, "fail"),
    ("ratios.doctor_vs_bare", None, "fail"),
    ("bitexact.recipe", True, "pass"),
    ("bitexact.recipe", False, "fail"),
    ("verify.run", {"tokens_per_s": 1.0}, "reported"),
    ("fp8.mlp_speedup", 1.2, "pass"),
    ("fp8.mlp_speedup", 1.1999, "fail"),
    ("fp8.mlp_speedup", None, "fail"),
    ("fp8.gpt_speedup", 0.8, "reported"),
])
def test_judge_applies_the_tables_rule(key: str, measured: object, status: str) -> None:
    assert judge(key, measured) == status


def test_threshold_unknown_key_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="known: bitexact.recipe, nosync.steps"):
        threshold("ratios.nope")


def test_median_ratio_takes_the_median_of_each_arm() -> None:
    import torch

    ticks = {"a": 0, "b": 0}

    def arm(name: str, cost: int):
        def step() -> None:
            ticks[name] += 1
            sum(range(cost))
        return step

    m = median_ratio(torch.device("cpu"), {"a": arm("a", 10), "b": arm("b", 10)}, steps=50, warmup=5)
    assert ticks == {"a": 55, "b": 55} and m["steps"] == 50 and set(m["ratio"]) == {"b"}


def _report() -> dict:
    report = base_report(device="cuda:0", tiny=False, environment={"torch": "2.11.0", "gpus": [{"name": "NVIDIA H200"}]},
                         budget_s=240.0)
    report["sections"] = [
        {"name": "ratios", "what": "", "status": "fail", "cap_s": 45, "limit_s": 45, "wall_s": 12.0, "error": None,
         "checks": [check("ratios.engine_vs_recipe", "bare | recipe", 1.05, "a|b").to_json(),
                    check("ratios.replay_vs_step", "replay", math.nan, "n").to_json()]},
        {"name": "verify", "what": "", "status": "timed out", "cap_s": 70, "limit_s": 70, "wall_s": 73.0,
         "error": "killed after its cap of 70 s; 0 check(s) had finished", "checks": []},
    ]
    return report


def test_report_markdown_has_one_row_per_check_and_escapes_pipes() -> None:
    md = render_markdown(_report())
    assert "| ratios | bare \\| recipe | fail | 1.05 | <= 1.02 | a\\|b |" in md
    assert "| verify | | timed out | | | killed after its cap of 70 s; 0 check(s) had finished |" in md
    assert "NVIDIA H200" in md


def test_report_overall_status_fails_on_a_timed_out_section() -> None:
    assert overall_status(_report()["sections"]) == "fail"
    assert overall_status([{"status": "pass"}, {"status": "skipped"}, {"status": "reported"}]) == "pass"


def test_report_json_is_strict_and_leaves_no_temp_files(tmp_path: Path) -> None:
    json_path, md_path = write_report(_report(), tmp_path)
    text = json_path.read_text()
    data = json.loads(text, parse_constant=lambda token: pytest.fail(f"non-JSON token {token}"))
    assert data["schema"] == "ampkit.gpu-check/1" and data["sections"][0]["checks"][1]["measured"] == "nan"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-check.json", "gpu-check.md"]
    assert md_path.read_text().startswith("# ampkit GPU check")


def test_runner_result_file_keeps_finished_checks_and_drops_a_half_written_line(tmp_path: Path) -> None:
    from gpucheck.runner import _exit_text, _read_checks, section_status

    path = tmp_path / "result.jsonl"
    first = check("bitexact.recipe", "fp16-plain", True, "bitwise equal").to_json()
    path.write_text(json.dumps(first) + "\n" + json.dumps({"done": True}) + "\n" + '{"key": "bitexact.rec')
    checks, error, done = _read_checks(path)
    assert checks == [first] and error is None and done
    assert section_status(checks) == "pass" and section_status([]) == "error"
    assert _exit_text(-6) == "signal 6 (SIGABRT)" and _exit_text(3) == "status 3"
