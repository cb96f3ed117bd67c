"""benchmarks/gpu_check.py as a program: the no-CUDA skip, argument errors, a CPU run, time caps and signals."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gpucheck.runner import run_section
from gpucheck.table import SECTIONS, section
from tests.helpers.processes import descendants, survivors, with_command_line

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          check=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")
def test_gpu_check_without_cuda_writes_the_skipped_json_and_exits_0(tmp_path: Path) -> None:
    done = _run("--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["schema"] == "ampkit.gpu-check/1"
    assert report["skipped"] == "no CUDA device" and report["status"] == "skipped" and report["sections"] == []
    assert "Skipped: no CUDA device." in (tmp_path / "gpu-check.md").read_text()


@pytest.mark.parametrize(("args", "needle"), [
    (["--only", "bitexact,warp"], "unknown section(s) warp; choose from bitexact,nosync,ratios"),
    (["--only", ","], "no section named"),
])
def test_gpu_check_bad_only_exits_2_naming_the_sections(tmp_path: Path, args: list[str], needle: str) -> None:
    done = _run(*args, "--out", str(tmp_path))
    assert done.returncode == 2 and needle in done.stderr
    assert not (tmp_path / "gpu-check.json").exists()


def test_gpu_check_out_that_is_a_file_exits_2(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("keep me")
    done = _run("--out", str(target))
    assert done.returncode == 2 and "is a file" in done.stderr
    assert target.read_text() == "keep me"


def test_gpu_check_cpu_tiny_run_writes_both_reports_in_run_order(tmp_path: Path) -> None:
    done = _run("--device", "cpu", "--tiny", "--only", "replay,bitexact,nosync", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["complete"] and report["status"] == "pass" and report["tiny"]
    assert [s["name"] for s in report["sections"]] == ["bitexact", "nosync", "replay"]
    statuses = {s["name"]: s["status"] for s in report["sections"]}
    assert statuses == {"bitexact": "pass", "nosync": "skipped", "replay": "pass"}
    assert len(report["sections"][0]["checks"]) == 9
    md = (tmp_path / "gpu-check.md").read_text()
    assert "| bitexact | fp16-forced-skips | pass |" in md and "| nosync | | skipped |" in md
    assert "===== replay" in (tmp_path / "gpu-check.log").read_text()
    assert not list(tmp_path.glob(".*.result.jsonl"))


def test_gpu_check_section_past_its_cap_is_timed_out_and_its_processes_are_gone(tmp_path: Path) -> None:
    entry = run_section(section("verify"), script=SCRIPT, device="cpu", tiny=True, out=tmp_path, limit_s=4.0,
                        log=tmp_path / "log")
    assert entry["status"] == "timed out" and "killed after its cap of 4 s" in entry["error"]
    assert survivors(with_command_line(str(tmp_path)), timeout=5.0) == []


def test_gpu_check_section_that_raises_is_an_error_with_the_message(tmp_path: Path) -> None:
    entry = run_section(section("replay"), script=SCRIPT, device="meta", tiny=True, out=tmp_path, limit_s=60,
                        log=tmp_path / "log")
    assert entry["status"] == "error" and entry["checks"] == []
    assert entry["error"].split(":")[0].endswith("Error"), entry["error"]


def test_gpu_check_sigterm_stops_the_running_section_and_leaves_no_process(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--only", "verify",
                             "--out", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    log = tmp_path / "gpu-check.log"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (log.exists() and b"===== verify" in log.read_bytes()):
        time.sleep(0.1)
    deadline = time.monotonic() + 60
    workers: list[int] = []
    while time.monotonic() < deadline and not workers:  # wait for verify's first worker process
        time.sleep(0.2)
        workers = [pid for pid in descendants(proc.pid) if pid in with_command_line("ampkit.verify.worker")]
    assert workers, "the verify section should be running a worker"
    tree = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM
    assert survivors(tree, timeout=5.0) == []


def test_gpu_check_sections_table_caps_fit_the_budget() -> None:
    from gpucheck.table import TOTAL_BUDGET_S

    assert [s.name for s in SECTIONS] == ["bitexact", "nosync", "ratios", "replay", "verify", "nccl", "frameworks",
                                          "fp8"]
    assert [s.name for s in SECTIONS if not s.default] == ["fp8"]  # its own call: --only fp8
    assert max(s.cap_s for s in SECTIONS) < TOTAL_BUDGET_S


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")
def test_gpu_check_make_target_on_a_cpu_machine_writes_the_skipped_json(tmp_path: Path) -> None:
    import shutil

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    root = SCRIPT.parents[1]
    done = subprocess.run(["make", "-s", "gpu-check", f"PYTHON={sys.executable}", f"GPU_CHECK_ARGS=--out {tmp_path}"],
                          cwd=root, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((tmp_path / "gpu-check.json").read_text())["skipped"] == "no CUDA device"
