"""`ampkit verify` end to end: real worker processes, real reports, the exit codes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import jsonschema
import pytest

from ampkit.cli.main import main
from ampkit.verify.report import load_schema
from ampkit.verify.worker import RECORD_KEYS
from tests.helpers.processes import descendants, survivors, with_command_line
from tests.verify.verify_helpers import SYNTHETIC, Job, LibraryJob, cli_command, task_ref, verify


def test_verify_passing_task_exits_0_and_writes_three_files(regression_job: Job) -> None:
    assert regression_job.code == 0
    assert sorted(p.name for p in regression_job.out.iterdir()) == ["report.html", "report.json", "report.md"]
    report = regression_job.report
    assert report["verdict"] == "pass" and [r["precision"] for r in report["runs"]] == ["fp32", "bf16"]
    bf16 = regression_job.run("bf16")
    assert bf16["status"] == "ok" and len(bf16["loss"]) == 40 and len(bf16["steps"]) == 40
    assert all(tuple(r) == RECORD_KEYS for r in bf16["steps"])
    assert [r["step"] for r in bf16["steps"]] == list(range(1, 41))  # counted from 1, like telemetry
    assert [h["step"] for h in bf16["eval_history"]] == [20, 40]
    assert bf16["throughput"]["timed_steps"] == 35 and bf16["throughput"]["samples_per_s"] > 0
    memory = bf16["memory"]
    assert memory["kind"] == "peak_rss" and bf16["peak_memory_bytes"] == memory["peak_bytes"]
    assert memory["peak_bytes"] - memory["baseline_bytes"] == memory["training_bytes"] >= 0
    assert regression_job.run("fp32")["init_sha256"] == bf16["init_sha256"]


def test_verify_report_matches_the_json_schema(regression_job: Job) -> None:
    jsonschema.Draft202012Validator.check_schema(load_schema())
    jsonschema.validate(regression_job.report, load_schema(), cls=jsonschema.Draft202012Validator)
    assert regression_job.report["environment"]["matmul_tflops"]["cpu"]["bf16"] > 0


def test_verify_schema_rejects_a_record_with_a_missing_key(regression_job: Job) -> None:
    broken = regression_job.report
    del broken["runs"][0]["steps"][0]["skipped"]
    with pytest.raises(jsonschema.ValidationError, match="'skipped' is a required property"):
        jsonschema.validate(broken, load_schema(), cls=jsonschema.Draft202012Validator)


def test_verify_same_seed_gives_identical_loss_arrays(regression_job: Job, regression_job_again: LibraryJob) -> None:
    for precision in ("fp32", "bf16"):
        first, second = regression_job.run(precision), regression_job_again.run(precision)
        assert first["loss"] == second["loss"], precision
        assert first["init_sha256"] == second["init_sha256"] and first["data_sha256"] == second["data_sha256"]
    # fp32 and bf16 differ (the comparison is not trivially zero) while starting from the same weights
    assert regression_job.run("fp32")["loss"] != regression_job.run("bf16")["loss"]


def test_verify_fp16_overflow_fails_and_exits_1(tmp_path: Path) -> None:
    job = verify(tmp_path, task_ref("Fp16Overflow"), "--precisions", "fp32,bf16,fp16")
    assert job.code == 1 and job.report["verdict"] == "fail"
    assert job.comparison("fp32")["verdict"] == "pass"
    # bf16 has fp32's range, so the same loss stays finite: no failure.  The task's unlearnable noise
    # makes fp32's own metric spread wide, so bf16 is inconclusive; fp16's failure outranks it (exit 1).
    assert job.comparison("bf16")["verdict"] == "inconclusive"
    fp16 = job.comparison("fp16")
    assert fp16["verdict"] == "fail"
    assert job.run("fp16")["status"] == "diverged"
    assert any("losses non-finite (100.0% > 0.0% allowed)" in r for r in fp16["reasons"])
    assert job.run("fp16")["nonfinite_steps"] == len(job.run("fp16")["loss"]) == 20
    jsonschema.validate(job.report, load_schema(), cls=jsonschema.Draft202012Validator)


def test_verify_crashed_and_killed_runs_are_recorded_and_the_others_run(tmp_path: Path) -> None:
    # No noise band: its extra fp32 run would add a worker start and nothing this test reads.
    job = verify(tmp_path, task_ref("Faulty"), "--precisions", "fp32,bf16,fp16", "--steps", "6", "--warmup", "1",
                 "--no-noise-band")
    assert job.code == 1
    assert job.run("fp32")["status"] == "ok" and job.comparison("fp32")["verdict"] == "pass"
    bf16 = job.run("bf16")
    assert bf16["status"] == "failed" and bf16["error"] == "RuntimeError: synthetic failure in the bf16 run"
    assert len(bf16["loss"]) == 2  # the two steps before the crash are kept
    assert "synthetic failure in the bf16 run" in bf16["log_tail"]
    # fp16 still ran after bf16 crashed; its process was then killed without writing a result
    fp16 = job.run("fp16")
    assert fp16["error"] == "the worker process died from SIGKILL (killed by the OS: out of memory?)"
    assert job.comparison("fp16")["verdict"] == "fail"
    assert "synthetic failure in the bf16 run" in (tmp_path / "report.html").read_text()
    jsonschema.validate(job.report, load_schema(), cls=jsonschema.Draft202012Validator)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["no-such-task"], "is not a built-in task"),
        ([str(SYNTHETIC) + ":Nope"], "has no attribute 'Nope'"),
        (["tinygpt", "--precisions", "fp64"], "precision 'fp64' is not known"),
        (["tinygpt", "--steps", "5", "--warmup", "5"], "--warmup 5 must be smaller than --steps 5"),
        (["tinygpt", "--steps", "0"], "--steps 0: must be an integer >= 1"),
        (["tinygpt", "--device", "cuda:7"], "is not available"),
        (["tinygpt", "--tol-metric", "acc=x"], "is not a number"),
        (["tinygpt", "--tol-metric", "accuracy=0.01"], "--tol-metric names 'accuracy', which task 'tinygpt' does not"),
        (["tinygpt", "--precisions", ","], "--precisions is empty"),
    ],
)
def test_verify_bad_input_exits_2_with_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["verify", *args, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_verify_cli_process_exit_status_is_2_for_a_missing_file(tmp_path: Path) -> None:
    proc = subprocess.run(cli_command("verify", str(tmp_path / "nope.py")), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def _verify_in_training(tmp_path: Path) -> tuple[subprocess.Popen[str], Path, Path, list[int]]:
    """`ampkit verify` of the Slow task with its scratch under tmp_path/tmp, once its fp32 worker trains:
    (the process, its --out, the scratch folder, the worker pids)."""
    out, scratch = tmp_path / "out", tmp_path / "tmp"
    scratch.mkdir()
    env = dict(os.environ, TMPDIR=str(scratch))
    proc = subprocess.Popen(
        cli_command("verify", task_ref("Slow"), "--out", str(out), "--no-measure-env"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(scratch.glob("ampkit-verify-*/fp32.stderr")):
        time.sleep(0.2)
    time.sleep(2.0)  # the fp32 worker is now training
    workers = [p for p in descendants(proc.pid) if p in with_command_line("ampkit.verify.worker")]
    return proc, out, scratch, workers


def test_verify_interrupt_leaves_no_report_and_exits_130(tmp_path: Path) -> None:
    proc, out, scratch, _ = _verify_in_training(tmp_path)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert not out.exists() or not any(out.iterdir())
    assert not any(scratch.iterdir())  # the workers' scratch directory is gone too


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_verify_sigterm_or_sighup_removes_the_scratch_directory_and_dies_by_the_signal(
    tmp_path: Path, sig: signal.Signals
) -> None:
    # A scheduler's SIGTERM (gpu_check stopping a section) or a closed terminal's SIGHUP, sent to
    # verify alone: its own cleanup must stop the worker and remove the scratch directory.
    proc, out, scratch, workers = _verify_in_training(tmp_path)
    try:
        assert workers, "no worker process was found under verify"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -sig, err
    assert not any(scratch.iterdir())
    assert not out.exists() or not any(out.iterdir())
    # Gone already: verify stops and reaps its worker before it dies.  Left alone, a worker only
    # died at its next progress line (the broken pipe), which a long step puts off for minutes.
    assert survivors(workers, timeout=0.0) == []


def test_verify_sigkill_takes_its_worker_down_with_it(tmp_path: Path) -> None:
    # No cleanup runs on SIGKILL.  A worker in a long step writes nothing, so it would not meet the
    # closed pipe for minutes: it must die with verify all the same.
    task, in_step = tmp_path / "stuck.py", tmp_path / "in-step"
    task.write_text(
        f"import sys, time\nsys.path.insert(0, {str(SYNTHETIC.parent)!r})\nfrom synthetic_tasks import Regression\n\n"
        "class Stuck(Regression):\n"
        "    def loss(self, model, batch):\n"
        f"        open({str(in_step)!r}, 'w').close()\n"
        "        time.sleep(120)\n"
        "        return super().loss(model, batch)\n")
    proc = subprocess.Popen(cli_command("verify", f"{task}:Stuck", "--out", str(tmp_path / "out"), "--no-measure-env"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=dict(os.environ, TMPDIR=str(tmp_path)))
    try:
        deadline = time.monotonic() + 60
        # The step writes in_step, then sleeps: once it exists, the worker is past its start-up and
        # first progress line, inside its first, 120 s, step.
        while time.monotonic() < deadline and not in_step.exists():
            time.sleep(0.1)
        workers = [p for p in descendants(proc.pid) if p in with_command_line("ampkit.verify.worker")]
        assert workers, "no worker process was found under verify"
        proc.kill()
        proc.wait(timeout=60)
        assert survivors(workers, timeout=5.0) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_verify_out_under_a_regular_file_exits_2_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "plain").write_text("x")
    started = time.monotonic()
    code = main(["verify", task_ref("Slow"), "--out", str(tmp_path / "plain" / "out"), "--no-measure-env",
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{tmp_path / 'plain'} is a file, not a directory" in err and "Traceback" not in err
    assert time.monotonic() - started < 60  # the Slow task trains for minutes; the check comes first


def test_verify_report_that_cannot_be_written_at_the_end_goes_to_the_temp_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out, scratch = tmp_path / "out", tmp_path / "tmp"
    scratch.mkdir()
    # Writable when verify starts; the task's model builder then puts a file where the folder goes.
    task = tmp_path / "sabotage.py"
    task.write_text(
        f"import sys\nsys.path.insert(0, {str(SYNTHETIC.parent)!r})\nfrom synthetic_tasks import Regression\n\n"
        "class Sabotage(Regression):\n"
        "    def build_model(self, seed):\n"
        f"        open({str(out)!r}, 'w').write('not a folder')\n"
        "        return super().build_model(seed)\n"
    )
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    job = verify(out, f"{task}:Sabotage", "--precisions", "fp32", "--steps", "3", "--warmup", "1", "--no-noise-band")
    assert job.code == 0
    captured = capsys.readouterr()
    [kept] = list(scratch.glob("ampkit-verify-*/report.json"))
    assert f"could not write the report to {out}" in captured.err and str(kept.with_suffix(".html")) in captured.out
    assert "ampkit verify" in captured.out  # the summary table is printed too
    assert json.loads(kept.read_text())["verdict"] == "pass"
@pytest.mark.parametrize("value", ["abc", "0", "5d", "-1m"])
def test_verify_time_budget_bad_value_exits_2_with_the_accepted_forms(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    try:
        code = main(["verify", "tinygpt", f"--time-budget={value}", "--out", str(tmp_path / "out")])
    except SystemExit as exited:  # argparse's own exit for a bad option value
        code = exited.code
    assert code == 2
    err = capsys.readouterr().err
    assert "--time-budget" in err and ("90s, 5m, 1h" in err or "more than 0 seconds" in err)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def budget_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, str]:
    """Steady (50 ms a step, 40 planned) under a 1 s budget, as in a CI log: stderr is a pipe, not a terminal."""
    out = tmp_path_factory.mktemp("budget")
    proc = subprocess.run(
        cli_command("verify", task_ref("Steady"), "--precisions", "fp32,bf16", "--time-budget", "1s",
                    "--no-measure-env", "--out", str(out)),
        capture_output=True, text=True, timeout=240,
    )
    return Job(proc.returncode, out), proc.stderr


def test_verify_time_budget_gives_every_precision_the_same_shrunk_steps(budget_job: tuple[Job, str]) -> None:
    job, _ = budget_job
    # 10 steps leave 5 after warm-up: too few for a pass, whatever the distances (exit 3)
    assert job.code == 3 and job.report["verdict"] == "inconclusive"
    assert any("only 5 steps after warm-up" in r for r in job.comparison("bf16")["reasons"])
    report = job.report
    budget = report["protocol"]["time_budget"]
    assert budget["requested_s"] == 1.0 and budget["planned_steps"] == 40
    assert budget["steps"] == report["protocol"]["steps"] == 10 and budget["shrunk"]
    assert sorted(budget["step_s"]) == ["bf16", "fp32"] and all(s >= 0.05 for s in budget["step_s"].values())
    for precision in ("fp32", "bf16"):
        run = job.run(precision)
        assert len(run["loss"]) == len(run["steps"]) == 10 and run["eval_history"][-1]["step"] == 10
    assert "instead of" in budget["note"] or "minimum of 10 steps" in budget["note"]
    assert "Time budget 1s" in (job.out / "report.md").read_text()
    jsonschema.validate(report, load_schema(), cls=jsonschema.Draft202012Validator)


def test_verify_time_budget_below_the_probe_runs_the_minimum_and_says_so(budget_job: tuple[Job, str]) -> None:
    job, err = budget_job
    assert job.report["protocol"]["time_budget"]["at_minimum"] is True
    assert "even the minimum of 10 steps per precision does not fit" in err
    assert "running that minimum, so the job overruns" in err


def test_verify_progress_lines_appear_when_stderr_is_not_a_terminal(budget_job: tuple[Job, str]) -> None:
    _, err = budget_job
    lines = [line for line in err.splitlines() if line.startswith("verify: bf16 (2/2) step ")]
    assert len(lines) >= 2 and all(" s/step · " in line and " left" in line for line in lines)
    assert "verify: fp32 (1/2): " in err and "s/step measured during warm-up; whole job about" in err


def test_verify_low_precision_slower_than_fp32_passes_with_the_no_speedup_note(tmp_path: Path) -> None:
    # The single-run protocol: this test is about the speed note, and 8 steps are too few for a
    # pass under the noise band (tests/verify/test_noise.py covers that protocol).  Each bf16 step
    # sleeps 200 ms: the 5 timed after a 3-step warm-up show it as well as more would.
    job = verify(tmp_path, task_ref("SlowLowPrecision"), "--precisions", "fp32,bf16", "--no-noise-band",
                 "--steps", "8", "--warmup", "3")
    assert job.code == 0
    bf16 = job.comparison("bf16")
    assert bf16["verdict"] == "pass" and bf16["numerics"] == "pass" and bf16["speedup"] < 1.0
    assert bf16["summary"].startswith("numerics within tolerance; no speed-up on this hardware")
    assert bf16["hardware"]["slower"] is True
    assert "> **bf16: numerics within tolerance; no speed-up on this hardware" in (tmp_path / "report.md").read_text()
