"""`ampkit doctor` as a user runs it: outputs checked before the script runs, findings kept when
the script is interrupted or ends early, and the usage errors of its targets (real processes)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from ampkit.cli.main import main
from tests.helpers.mounts import read_only, run_after_mounting

SCHEMA = json.loads((Path(__file__).parents[2] / "src/ampkit/schemas/doctor.schema.json").read_text())

# Two fp16 steps whose forward overflows (a FORWARD_OVERFLOW error, found by the replay of the
# skipped step; SLOW_LOW_PRECISION may join it on a slow machine), then a marker file, then the ending chosen by argv[2].
OVERFLOW = """
    import os, sys, time, pathlib
    import torch
    from torch import nn
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight.fill_(300.0)
        model[2].weight.fill_(300.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(2):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.ones(2, 4)).float().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    pathlib.Path(sys.argv[1]).write_text("found")
    if sys.argv[2] == "sleep":
        time.sleep(120)
    elif sys.argv[2] == "raise":
        raise RuntimeError("after the finding")
    elif sys.argv[2] == "os_exit":
        os._exit(0)
"""


def _write(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source))
    return path


def _doctor_process(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-c", "import sys; from ampkit.cli.main import main; sys.exit(main(sys.argv[1:]))",
           "doctor", *args]
    return subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the script never wrote {path.name} (exit {proc.returncode}):\n{out}\n{err}")
        time.sleep(0.05)


def _report(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    jsonschema.validate(doc, SCHEMA)
    return doc


@pytest.mark.parametrize(("sig", "ended", "status"), [(signal.SIGINT, "sigint", 130), (signal.SIGTERM, "sigterm", 143),
                                                    (signal.SIGHUP, "sighup", 129)])
def test_doctor_signal_after_a_finding_writes_it_as_partial(tmp_path: Path, sig: int, ended: str, status: int) -> None:
    script = _write(tmp_path / "train.py", OVERFLOW)
    proc = _doctor_process(tmp_path, "--json", "r.json", str(script), "marker", "sleep")
    _wait_for(tmp_path / "marker", proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == status, err
    doc = _report(tmp_path / "r.json")
    assert doc["partial"] is True and doc["ended"] == ended
    assert "FORWARD_OVERFLOW" in [f["code"] for f in doc["findings"]]
    assert "FORWARD_OVERFLOW" in out and "findings so far" in out


# The OVERFLOW script, then a thread that sends SIGTERM the moment the doctor's JSON temp file
# appears: the run is over and the report is being written.
TERMINATED_DURING_THE_WRITE = OVERFLOW + """
    import signal, threading
    def terminate_during_the_json_write():
        while not any(name.startswith(".r.json.") for name in os.listdir(".")):
            pass
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=terminate_during_the_json_write, daemon=True).start()
"""


def test_doctor_sigterm_during_the_json_write_completes_both_files_then_ends_by_it(tmp_path: Path) -> None:
    script = _write(tmp_path / "train.py", TERMINATED_DURING_THE_WRITE)
    big = ["x" * 100_000] * 10  # the script's argv is in the JSON: 1 MB to write and sync
    proc = _doctor_process(tmp_path, "--json", "r.json", "--html", "r.html", str(script), "marker", "end", *big)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGTERM, err  # SIGTERM's default action, once both files are written
    assert f"wrote {tmp_path / 'r.html'}" in err
    doc = _report(tmp_path / "r.json")
    assert doc["partial"] is False and doc["environment"]["argv"][2:] == big
    assert "FORWARD_OVERFLOW" in [f["code"] for f in doc["findings"]]
    assert "FORWARD_OVERFLOW" in (tmp_path / "r.html").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["marker", "r.html", "r.json", "train.py"], "no temp file"


def test_doctor_script_that_raises_after_a_finding_writes_it_as_partial(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # In this process: the doctor runs the script in its own process either way, and main's status
    # is the one `ampkit doctor` exits with.
    script = _write(tmp_path / "train.py", OVERFLOW)
    code = main(["doctor", "--json", str(tmp_path / "r.json"), str(script), str(tmp_path / "marker"), "raise"])
    err = capsys.readouterr().err
    assert code == 1, err  # the script's own status: Python exits 1 on an uncaught exception
    assert "RuntimeError: after the finding" in err
    doc = _report(tmp_path / "r.json")
    assert doc["partial"] is True and doc["ended"] == "exception"
    assert "FORWARD_OVERFLOW" in [f["code"] for f in doc["findings"]]


def test_doctor_script_that_calls_os_exit_still_gets_its_report(tmp_path: Path) -> None:
    script = _write(tmp_path / "train.py", OVERFLOW)
    proc = _doctor_process(tmp_path, "--json", "r.json", "--html", "r.html", str(script), "marker", "os_exit")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err  # os._exit(0), and an error finding
    doc = _report(tmp_path / "r.json")
    assert doc["partial"] is True and doc["ended"] == "os_exit"
    assert "FORWARD_OVERFLOW" in [f["code"] for f in doc["findings"]]
    assert "Partial report" in (tmp_path / "r.html").read_text()
    assert "FORWARD_OVERFLOW" in out


def test_doctor_sys_exit_is_a_normal_end_with_the_scripts_status(tmp_path: Path) -> None:
    script = _write(tmp_path / "exits.py", "import sys\nsys.exit(3)\n")
    assert main(["doctor", "--json", str(tmp_path / "r.json"), str(script)]) == 3
    doc = _report(tmp_path / "r.json")
    assert doc["partial"] is False and "ended" not in doc


def test_doctor_json_in_a_read_only_folder_exits_2_before_the_script_runs(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    script = _write(tmp_path / "train.py", f"open({str(tmp_path / 'ran')!r}, 'w').write('ran')\n")
    proc = run_after_mounting(read_only(ro), [sys.executable, "-m", "ampkit.cli.main", "doctor", "--json",
                                              f"{ro}/r.json", str(script)])
    assert proc.returncode == 2, proc.stderr
    assert f"--json '{ro}/r.json' cannot be written" in proc.stderr and "Read-only file system" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "ran").exists()


def test_doctor_json_under_a_regular_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "plain").write_text("x")
    script = _write(tmp_path / "train.py", f"open({str(tmp_path / 'ran')!r}, 'w').write('ran')\n")
    assert main(["doctor", "--html", str(tmp_path / "plain" / "r.html"), str(script)]) == 2
    assert f"--html {str(tmp_path / 'plain' / 'r.html')!r} cannot be written: {tmp_path / 'plain'} is a file, not a " \
           "directory" in capsys.readouterr().err
    assert not (tmp_path / "ran").exists()


def test_doctor_relative_json_stays_where_the_user_meant_when_the_script_chdirs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "elsewhere").mkdir()
    script = _write(tmp_path / "train.py", "import os\nos.chdir('elsewhere')\n")
    monkeypatch.chdir(tmp_path)
    assert main(["doctor", "--json", "r.json", str(script)]) == 0
    assert (tmp_path / "r.json").is_file() and not (tmp_path / "elsewhere" / "r.json").exists()
    assert f"wrote {tmp_path / 'r.json'}" in capsys.readouterr().err


def test_doctor_json_that_fails_at_the_end_goes_to_the_temp_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    # The folder is writable when the doctor starts; the script then replaces it with a file.
    script = _write(tmp_path / "train.py", f"import shutil\nshutil.rmtree({str(out)!r})\n"
                                           f"open({str(out)!r}, 'w').write('not a folder')\n")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    assert main(["doctor", "--json", str(out / "r.json"), str(script)]) == 0
    err = capsys.readouterr().err
    [kept] = list(scratch.glob("ampkit-doctor-*/r.json"))
    assert f"could not write --json {out / 'r.json'}" in err and str(kept) in err
    assert _report(kept)["partial"] is False


def test_doctor_task_file_run_as_a_script_suggests_the_task_reference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    task_file = _write(tmp_path / "task.py", """
        import torch
        from ampkit.tasks import TaskBase

        class Regression(TaskBase):
            name = "regression"
            metrics = {"mse": "lower"}

        task = Regression()
    """)
    assert main(["doctor", str(task_file)]) == 0
    err = capsys.readouterr().err
    assert "trained nothing" in err and f"ampkit doctor {task_file}:task" in err


def test_doctor_missing_module_exits_2_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "-m", "no_such_module_for_doctor.train"]) == 2
    err = capsys.readouterr().err
    assert "no module named 'no_such_module_for_doctor'" in err and "Traceback" not in err
    assert main(["doctor", "-m", "no_such_module_for_doctor"]) == 2
    assert "no module named 'no_such_module_for_doctor' (searched" in capsys.readouterr().err


# fp16 `(stream + x) - stream`: eager rounds the sum to fp16 and loses most of x; inductor fuses the
# three ops and keeps the sum in fp32.  The Linear before it computes the same either way.
CANCELLING = """
    import torch
    from torch import nn

    class Residual(nn.Module):
        def forward(self, x):
            stream = x * 1024.0
            return (stream + x) - stream

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Residual())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = torch.compile(model)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = compiled(torch.randn(4, 8)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
"""


@pytest.mark.slow
def test_doctor_compare_compiled_reports_only_the_module_that_differs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _write(tmp_path / "cancelling.py", CANCELLING)
    report = tmp_path / "doctor.json"
    assert main(["doctor", "--compare-compiled", "--json", str(report), str(script)]) == 0
    doc = json.loads(report.read_text())
    jsonschema.validate(doc, SCHEMA)
    diverged = [f for f in doc["findings"] if f["code"] == "COMPILED_DIVERGENCE"]
    assert [(f["module"], f["severity"], f["location"]) for f in diverged] == [("1", "warning", f"{script}:17")]
    assert diverged[0]["evidence"]["sqnr_db"] < diverged[0]["evidence"]["tolerance_db"] == 46.99
    comparison = doc["compiled_comparison"]
    assert comparison["culprits"] == ["1"]
    assert [(m["module"], m["diverges"]) for m in comparison["modules"]] == [("", True), ("0", False), ("1", True)]
    assert [(c["kind"], c["location"]) for c in doc["compiled"]] == [("module", f"{script}:13")]
    out = capsys.readouterr().out
    assert "the doctor ran it eagerly" in out and "DIFFERS (output)" in out


def test_doctor_compare_compiled_with_a_task_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--compare-compiled", "tinygpt"]) == 2
    assert "--compare-compiled compares a script's own step" in capsys.readouterr().err
