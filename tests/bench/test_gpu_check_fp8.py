"""The GPU check's fp8 section on the CPU at tiny size (torch's CPU ``_scaled_mm``), and when it is skipped.

On a CPU the section's speed checks are measured and reported, never judged: these tests read
their statuses and that a number was measured, not the number.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gpu_check
import pytest
import torch

from gpucheck import fp8
from gpucheck.table import SECTIONS

SCRIPT = Path(gpu_check.__file__).resolve()
CPU = torch.device("cpu")


def _run(out: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--only", "fp8", "--out", str(out),
                           *args], capture_output=True, text=True, timeout=300, check=False, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "gpu-check.json").read_text())
    assert [s["name"] for s in report["sections"]] == ["fp8"]
    return report["sections"][0]


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The fp8 section of one ``--device cpu --tiny --only fp8`` run (its four compiled arms, 60 steps each, take most of its time)."""
    pytest.importorskip("torchao")  # the skip tests below run without it
    return _run(tmp_path_factory.mktemp("fp8"))


def test_fp8_section_cpu_tiny_passes_the_recipe_and_doctor_checks_and_reports_speed(tiny_fp8: dict[str, Any]) -> None:
    checks = [(c["key"], c["name"], c["status"]) for c in tiny_fp8["checks"]]
    assert checks == [
        ("fp8.recipe", "fp8-tensorwise-clip", "pass"),
        ("fp8.recipe", "fp8-rowwise-clip", "pass"),
        ("fp8.recipe", "fp8-rowwise-gw-hp-clip", "pass"),
        ("fp8.recipe", "fp8-accumulate-2", "pass"),
        ("fp8.doctor", "injected activation outlier", "pass"),
        ("fp8.mlp_speedup", "MLP block 32 x 128", "reported"),
        ("fp8.gpt_speedup", "GPT 1 x 16", "reported"),
    ], [c["detail"] for c in tiny_fp8["checks"]]
    assert tiny_fp8["status"] == "pass"


def test_fp8_section_recipe_check_converts_layers_and_compares_the_optimizer_state(tiny_fp8: dict[str, Any]) -> None:
    recipe = [c for c in tiny_fp8["checks"] if c["key"] == "fp8.recipe"]
    # The tiny MLP's input (8 -> 16) and head (16 -> 4) are not fp8-sized: the four block Linears are.
    assert all(c["evidence"]["fp8_layers"] == ["blocks.0.1", "blocks.0.3", "blocks.1.1", "blocks.1.3"] for c in recipe)
    assert [c["evidence"]["accumulation"] for c in recipe] == [1, 1, 1, 2]
    # gw-hp without autocast: on a CPU torchao's recipe raises under it
    assert [c["evidence"]["autocast"] for c in recipe] == [True, True, False, True]


def test_fp8_section_doctor_check_names_the_outlier_layer_and_its_verified_filter(tiny_fp8: dict[str, Any]) -> None:
    (doctor,) = [c for c in tiny_fp8["checks"] if c["key"] == "fp8.doctor"]
    assert doctor["evidence"]["fp8_filter"] == ["0"] and "FP8_FLUSH" in doctor["evidence"]["findings"]
    assert "fp8_filter=['0']" in doctor["evidence"]["fix"]


def test_fp8_section_speed_on_cpu_is_measured_but_not_judged(tiny_fp8: dict[str, Any]) -> None:
    for c in (c for c in tiny_fp8["checks"] if c["key"].endswith("_speedup")):
        assert c["measured"] > 0 and "not judged on tiny sizes on cpu" in c["detail"]
        assert set(c["evidence"]["tokens_per_s"]) == {"bf16", "fp8"} and c["evidence"]["steps"] >= 50
        assert c["evidence"]["backend"] == "aot_eager"  # compiled, without inductor's C++ kernels for the CPU
    (mlp,) = [c for c in tiny_fp8["checks"] if c["key"] == "fp8.mlp_speedup"]
    assert mlp["threshold"] == ">= 1.2 (judged on a GPU only)"


def test_fp8_section_without_an_importable_torchao_is_skipped_with_the_reason(tmp_path: Path) -> None:
    # A torchao that fails at import shadows the installed one, as a torchao built for another torch does.
    stand_in = tmp_path / "site" / "torchao"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text('raise ImportError("this torchao was built for another torch")\n')
    path = os.pathsep.join(p for p in (str(stand_in.parent), os.environ.get("PYTHONPATH")) if p)
    section = _run(tmp_path / "out", env={**os.environ, "PYTHONPATH": path})
    assert section["status"] == "skipped"
    assert [c["key"] for c in section["checks"]] == list(fp8.KEYS)
    assert {c["status"] for c in section["checks"]} == {"skipped"}
    assert {c["detail"] for c in section["checks"]} == {
        "torchao does not import: ImportError: this torchao was built for another torch"}


def test_fp8_section_without_torchao_installed_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8, "torchao_installed", lambda: False)
    why = fp8.unavailable(CPU, tiny=True)
    assert why is not None and "torchao is not installed (pip install 'ampkit[fp8]'" in why
    assert "docs/gpu-check.md" in why


@pytest.mark.parametrize(("device", "tiny", "needle"), [
    ("cpu", False, "only --device cpu --tiny runs it"),
    ("meta", True, "needs CUDA with compute capability 8.9 or above"),
])
def test_fp8_section_off_an_fp8_gpu_is_skipped_with_the_reason(device: str, tiny: bool, needle: str) -> None:
    checks = list(fp8.run(torch.device(device), tiny=tiny))
    assert [c.key for c in checks] == list(fp8.KEYS)
    assert {c.status for c in checks} == {"skipped"} and all(needle in c.detail for c in checks)


def test_gpu_check_default_run_leaves_out_fp8_and_only_names_it() -> None:
    assert "fp8" not in gpu_check._sections(None)
    assert gpu_check._sections(None) == [s.name for s in SECTIONS if s.name != "fp8"]
    assert gpu_check._sections("fp8") == ["fp8"]
    assert gpu_check._sections("fp8,bitexact") == ["bitexact", "fp8"]
