"""A script that trains in two threads under ``ampkit doctor``: every thread's optimizer steps are
counted, and the thread that got a non-finite batch is reported (autocast, the step and the forward
in progress are per thread).  A forward run in a worker thread (an executor's, a plain thread's) is
judged with the step of the thread that backpropagates its loss."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from ampkit.diagnose.script.runner import run_script

# Two threads, each with its own model and optimizer, 30 steps each; the second one's 13th step gets
# a batch holding inf.  The loops are written out twice so that each thread's forward has its own line.
SCRIPT = """
    import threading
    import torch
    from torch import nn


    def clean() -> None:
        torch.manual_seed(0)
        model_a = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        opt = torch.optim.SGD(model_a.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(0)
        for step in range(30):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model_a(x).float(), y)  # CLEAN FORWARD
            loss.backward()
            opt.step()
            opt.zero_grad()


    def broken() -> None:
        torch.manual_seed(1)
        model_b = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        opt = torch.optim.SGD(model_b.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(1)
        for step in range(30):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
            if step == 12:
                x[0, 0] = float("inf")
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model_b(x).float(), y)  # BROKEN FORWARD
            loss.backward()
            opt.step()
            opt.zero_grad()


    threads = [threading.Thread(target=clean), threading.Thread(target=broken)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
"""


def _line(source: str, marker: str) -> int:
    return next(i for i, text in enumerate(source.splitlines(), 1) if marker in text)


def test_doctor_threads_count_every_threads_steps_and_report_the_broken_threads_input(tmp_path: Path) -> None:
    source = textwrap.dedent(SCRIPT)
    script = tmp_path / "train.py"
    script.write_text(source)
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "ampkit.cli.main", "doctor", "--json", str(out), str(script)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["environment"]["steps"] == 60
    assert "ran 60 optimizer step(s)" in proc.stdout
    [nonfinite] = [f for f in doc["findings"] if f["code"] == "NONFINITE_INPUT" and f["evidence"].get("input") == 0]
    # a line of the broken thread's loop (where its step was seen to fail), never one of the clean thread's
    path, line = nonfinite["location"].rsplit(":", 1)
    assert path == str(script) and _line(source, "BROKEN FORWARD") <= int(line) <= _line(source, "BROKEN FORWARD") + 3
    assert nonfinite["evidence"]["samples"] == [0]
    data_replays = [r for r in doc["environment"]["replays"] if r["why"] == "nonfinite_loss:nonfinite_data"]
    assert [r["step"] for r in data_replays] == [13]  # the broken thread's 13th optimizer step
    clean = range(_line(source, "def clean"), _line(source, "def broken"))
    assert all(int(f["location"].rsplit(":", 1)[1]) not in clean for f in doc["findings"] if f["location"])


# The main thread enters autocast and hands the forward to a worker thread, which does not inherit it.
POOL = """
    from concurrent.futures import ThreadPoolExecutor
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    {decorator}
    def forward(x):
        return model(x)  # WORKER FORWARD

    with ThreadPoolExecutor(max_workers=1) as pool:
        for step in range(6):
            x, y = torch.randn(4, 8), torch.randn(4, 1)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = pool.submit(forward, x).result()
                loss = nn.functional.mse_loss(out.float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
"""


def _doctor(tmp_path: Path, source: str) -> tuple[dict, subprocess.CompletedProcess[str]]:
    script = tmp_path / "train.py"
    script.write_text(source)
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "ampkit.cli.main", "doctor", "--json", str(out), str(script)],
                          capture_output=True, text=True, timeout=600)
    return json.loads(out.read_text()), proc


def test_doctor_threads_forward_in_a_worker_is_outside_the_main_threads_autocast(tmp_path: Path) -> None:
    source = textwrap.dedent(POOL.format(decorator=""))
    doc, proc = _doctor(tmp_path, source)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # a warning
    [inactive] = [f for f in doc["findings"] if f["code"] == "AUTOCAST_INACTIVE"]
    assert "thread-local" in inactive["message"] and "MainThread" in inactive["message"]
    assert "@torch.autocast" in inactive["fix"] and inactive["evidence"]["forwards"] == 6
    assert inactive["location"] == f"{tmp_path / 'train.py'}:{_line(source, 'WORKER FORWARD')}"


def test_doctor_threads_worker_that_enters_autocast_itself_is_not_reported(tmp_path: Path) -> None:
    source = textwrap.dedent(POOL.format(decorator='@torch.autocast("cpu", dtype=torch.bfloat16)'))
    doc, proc = _doctor(tmp_path, source)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not [f for f in doc["findings"] if f["code"] == "AUTOCAST_INACTIVE"]


# The model's forward runs in a worker thread (autocast entered there), the loss, backward and the
# GradScaler's step in the main thread; step 21's batch holds an inf.  ``{pool}`` makes the executor.
WORKER_FORWARD = """
    import torch
    from torch import nn
    {imports}

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")


    def forward(x):
        with torch.autocast("cpu", dtype=torch.float16):
            return model(x)  # WORKER FORWARD


    g = torch.Generator().manual_seed(0)
    pool = {pool}
    for step in range(30):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        if step == 20:
            x[0, 0] = float("inf")
        out = pool.submit(forward, x).result()
        loss = nn.functional.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
"""


def _worker_input_finding(report: Any, source: str, script: Path) -> None:
    """The NONFINITE_INPUT of step 21's batch, at the worker's forward, and the step counted by the main thread."""
    [nonfinite] = [f for f in report.findings if f.code == "NONFINITE_INPUT" and f.evidence.get("input") == 0]
    assert nonfinite.step == 21 and nonfinite.evidence["samples"] == [0]
    assert nonfinite.location == f"{script}:{_line(source, 'WORKER FORWARD')}"
    assert report.steps == 30


def test_doctor_threads_forward_in_an_executor_worker_reports_the_workers_nonfinite_input(tmp_path: Path) -> None:
    source = textwrap.dedent(WORKER_FORWARD.format(
        imports="from concurrent.futures import ThreadPoolExecutor", pool="ThreadPoolExecutor(max_workers=2)"))
    script = tmp_path / "train.py"
    script.write_text(source)
    report = run_script(script, checkup=False, measure_speed=False)
    _worker_input_finding(report, source, script)


def test_doctor_threads_forward_in_a_thread_joined_before_the_backward_reports_its_nonfinite_input(
        tmp_path: Path) -> None:
    # A new plain thread per step, ended before the main thread backpropagates its output.
    thread_per_call = "\n    ".join([
        "import threading", "", "", "class ThreadPerCall:",
        "    def submit(self, fn, *args):",
        "        t = threading.Thread(target=lambda: setattr(self, 'out', fn(*args)))",
        "        t.start(); t.join()",
        "        return self", "",
        "    def result(self):", "        return self.out"])
    source = textwrap.dedent(WORKER_FORWARD.format(imports=thread_per_call, pool="ThreadPerCall()"))
    script = tmp_path / "train.py"
    script.write_text(source)
    report = run_script(script, checkup=False, measure_speed=False)
    _worker_input_finding(report, source, script)


def test_doctor_threads_executor_started_before_the_doctor_installs_is_observed(tmp_path: Path) -> None:
    # The executor and its worker thread exist before the run (a library made them at import): the
    # script reuses the same worker for every step.
    (tmp_path / "early_pool.py").write_text(
        "from concurrent.futures import ThreadPoolExecutor\nPOOL = ThreadPoolExecutor(max_workers=1)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import early_pool  # type: ignore[import-not-found]

        early_pool.POOL.submit(lambda: None).result()  # its worker thread starts now
        source = textwrap.dedent(WORKER_FORWARD.format(imports="import early_pool", pool="early_pool.POOL"))
        script = tmp_path / "train.py"
        script.write_text(source)
        report = run_script(script, checkup=False, measure_speed=False)
        _worker_input_finding(report, source, script)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("early_pool", None)
        early_pool.POOL.shutdown()
