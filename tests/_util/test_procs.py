"""ampkit._util.procs: children die with their parent (SIGKILL included), SIGTERM unwinds first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ampkit._util.procs import sigterm_unwinds
from tests.helpers.processes import running, survivors


def _parent_of_a_child(child_code: str) -> tuple[subprocess.Popen[str], int]:
    """A Python process whose code starts a child and prints its pid; return it and that pid."""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(child_code)], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    return parent, int(parent.stdout.readline())


def _sigkill_parent_and_check(child_code: str, timeout: float) -> None:
    parent, child = _parent_of_a_child(child_code)
    try:
        assert running(child)
        parent.kill()
        parent.wait()
        assert survivors([child], timeout) == [], f"child {child} outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.wait()
        if running(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's prctl")
def test_procs_die_with_caller_child_dies_when_the_parent_is_sigkilled() -> None:
    _sigkill_parent_and_check("""
        import subprocess, time
        from ampkit._util.procs import die_with_caller
        child = subprocess.Popen(["sleep", "600"], preexec_fn=die_with_caller())
        print(child.pid, flush=True)
        time.sleep(600)
    """, timeout=5.0)


def test_procs_die_with_parent_watchdog_kills_the_orphan_without_the_death_signal() -> None:
    # death_signal=False: only the watchdog thread, as on a system without prctl.
    _sigkill_parent_and_check("""
        import subprocess, sys, time
        code = ("import time; from ampkit._util.procs import die_with_parent; "
                "die_with_parent(death_signal=False, interval=0.1); print('bound', flush=True); time.sleep(600)")
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline() == "bound\\n"
        print(child.pid, flush=True)
        time.sleep(600)
    """, timeout=5.0)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the parent's parent is read from /proc")
def test_procs_die_with_parent_ends_at_once_when_the_parent_is_not_the_launchers_child() -> None:
    # As for a rank whose torchrun died before the rank started: its parent is then some reaper,
    # not the launcher's child.  Here the named launcher (this test) is the parent, not its parent.
    code = f"from ampkit._util.procs import die_with_parent; die_with_parent({os.getpid()}); print('survived')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL and "survived" not in proc.stdout


def test_procs_sigterm_unwinds_runs_the_cleanup_then_dies_by_sigterm() -> None:
    code = textwrap.dedent("""
        import time
        from ampkit._util.procs import sigterm_unwinds
        with sigterm_unwinds():
            try:
                print("ready", flush=True)
                time.sleep(60)
            finally:
                print("cleanup ran", flush=True)
        print("after the block")
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGTERM
        assert out == "cleanup ran\n"
    finally:
        proc.kill()
        proc.wait()


def test_procs_sigterm_unwinds_leaves_a_programs_own_handler_in_place() -> None:
    def own(signum, frame):  # pragma: no cover - never delivered
        pass

    previous = signal.signal(signal.SIGTERM, own)
    try:
        with sigterm_unwinds():
            assert signal.getsignal(signal.SIGTERM) is own
        assert signal.getsignal(signal.SIGTERM) is own
    finally:
        signal.signal(signal.SIGTERM, previous)
