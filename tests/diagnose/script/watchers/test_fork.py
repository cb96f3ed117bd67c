"""The fork watcher: a script that forks a child process (FORKED_CHILD_UNOBSERVED)."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ampkit.diagnose.script.watchers import fork
from ampkit.diagnose.script.watchers.fork import ForkEvent, ForkWatch
from diagnose.script.watchers.alone import watching

HERE = Path(__file__).relative_to(Path.cwd())
ROOT = Path(__file__).parents[4]

FORK_LINE = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                 if text.endswith("# FORK_LINE"))

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")


def _fork_and_report_child_flag(watch: ForkWatch) -> int:
    """Fork; the child exits at once with 0 when it knows it is the child, else 3.  The child's exit status."""
    pid = os.fork()  # FORK_LINE
    if pid == 0:  # pragma: no cover - the child
        os._exit(0 if watch.child else 3)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_fork_watch_alone_reports_a_fork_of_the_script_and_marks_the_child() -> None:
    with watching(ForkWatch) as w:
        assert _fork_and_report_child_flag(w.watcher) == 0
        worker = multiprocessing.get_context("fork").Process(target=os.getpid)  # a library's fork: not counted
        worker.start()
        worker.join()
    assert worker.exitcode == 0 and not w.watcher.child
    assert w.watcher.forks == [ForkEvent(location=f"{HERE}:{FORK_LINE}", step=1)]
    assert w.codes() == []
    w.watcher.finish()
    [f] = w.state.ledger.findings()
    assert (f.code, f.severity, f.location, f.step) == ("FORKED_CHILD_UNOBSERVED", "info", f"{HERE}:{FORK_LINE}", 1)
    assert f.evidence["forks"] == 1
    _fork_and_report_child_flag(w.watcher)  # after restore: nothing is watched any more
    assert len(w.watcher.forks) == 1



def test_fork_watch_registers_its_at_fork_callbacks_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """``os.register_at_fork`` cannot be undone: runs of the doctor in one process must not add callbacks."""
    registered: list[object] = []
    real = os.register_at_fork

    def counting(**callbacks: object) -> None:
        registered.append(callbacks)
        real(**callbacks)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "register_at_fork", counting)
    before = len(fork._INSTALLED)
    for _ in range(3):
        with watching(ForkWatch) as w:
            assert len(fork._INSTALLED) == before + 1
            assert _fork_and_report_child_flag(w.watcher) == 0
        assert len(w.watcher.forks) == 1  # each run saw its own fork
        assert len(fork._INSTALLED) == before
    assert len(registered) <= 1  # none when an earlier test of this process already registered them

SCRIPT = """
    import os, sys, time
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(steps):
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(8, 4)).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()

    train(2)
    if os.fork() == 0:
        torch.set_num_threads(1)
        train(3)
        report = sys.argv[1]
        deadline = time.monotonic() + 120
        while not os.path.exists(report) and time.monotonic() < deadline:  # end after the parent wrote it
            time.sleep(0.05)
        sys.exit(0)
    train(1)
"""


def test_fork_watch_keeps_the_parent_report_of_a_script_whose_child_ends_last(tmp_path: Path) -> None:
    script, report = tmp_path / "forks.py", tmp_path / "doctor.json"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    # Both processes hold the pipes: run returns once the child, which ends last, has ended too.
    done = subprocess.run([sys.executable, "-m", "ampkit.cli.main", "doctor", "--json", str(report), str(script), str(report)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    doc = json.loads(report.read_text())
    assert doc["environment"]["steps"] == 3  # the parent's 2 + 1, not the child's 2 + 3
    [fork] = [f for f in doc["findings"] if f["code"] == "FORKED_CHILD_UNOBSERVED"]
    assert fork["severity"] == "info" and fork["location"].endswith("forks.py:19") and fork["step"] == 3
    assert done.stdout.count("optimizer step(s)") == 1  # the parent's summary only
    assert "is a child the script forked" in done.stderr
