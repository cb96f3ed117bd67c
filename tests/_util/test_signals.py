"""signals_deferred: SIGINT/SIGTERM/SIGHUP wait for the end of the block, whichever thread the
kernel hands them to (real signals in real processes that run torch's threads)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from ampkit._util.signals import DEFERRED_SIGNALS, signals_deferred

SRC = str(Path(__file__).resolve().parents[2] / "src")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))}

# The signal is sent by another thread while the main thread is inside the block; torch's
# intra-op threads exist too (a matmul started them), so the kernel may hand it to any of them.
CHILD = textwrap.dedent("""
    import os, signal, sys, threading, time
    import torch
    torch.ones(256, 256) @ torch.ones(256, 256)
    from ampkit._util.signals import signals_deferred
    sig = getattr(signal, sys.argv[1])
    steps = []
    try:
        with signals_deferred():
            sender = threading.Thread(target=os.kill, args=(os.getpid(), sig))
            sender.start()
            sender.join()
            time.sleep(0.2)  # the signal has long been handled: by the recorder, not by the default
            steps.append("block finished")
            print("block finished", flush=True)
        steps.append("after the block")
    except KeyboardInterrupt:
        steps.append("KeyboardInterrupt")
    print(" | ".join(steps), flush=True)
""")


def _child(sig: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CHILD, sig], env=ENV, capture_output=True, text=True, timeout=120)


def test_signals_deferred_sigint_from_another_thread_raises_after_the_block() -> None:
    result = _child("SIGINT")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "block finished | KeyboardInterrupt", result.stdout


def test_signals_deferred_sigterm_with_its_default_action_ends_the_process_after_the_block() -> None:
    result = _child("SIGTERM")
    assert result.returncode == -signal.SIGTERM, (result.stdout, result.stderr)
    assert result.stdout == "block finished\n", "the block finished, then the process died by SIGTERM"


def test_signals_deferred_sighup_with_its_default_action_ends_the_process_after_the_block() -> None:
    result = _child("SIGHUP")
    assert result.returncode == -signal.SIGHUP, (result.stdout, result.stderr)
    assert result.stdout == "block finished\n"


def test_signals_deferred_restores_the_handlers_and_calls_a_programs_own_handler_once() -> None:
    before = {sig: signal.getsignal(sig) for sig in DEFERRED_SIGNALS}
    calls: list[int] = []
    previous = signal.signal(signal.SIGHUP, lambda signum, frame: calls.append(signum))
    try:
        with signals_deferred():
            signal.raise_signal(signal.SIGHUP)
            signal.raise_signal(signal.SIGHUP)
            assert calls == [], "the program's handler ran inside the block"
        assert calls == [signal.SIGHUP]
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert {sig: signal.getsignal(sig) for sig in DEFERRED_SIGNALS} == before
