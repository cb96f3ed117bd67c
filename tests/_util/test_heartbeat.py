"""Heartbeat: progress lines while a silent phase runs longer than its interval, none otherwise."""

from __future__ import annotations

import io
import time

from ampkit._util.heartbeat import Heartbeat


def test_heartbeat_prints_nothing_for_a_phase_shorter_than_its_interval() -> None:
    out = io.StringIO()
    hb = Heartbeat("ampkit doctor", stream=out, every_s=30.0)
    with hb.phase("analysing the run"):
        hb.beat("trial 1")
    time.sleep(0.05)
    assert out.getvalue() == ""


def test_heartbeat_prints_the_phase_and_latest_detail_while_a_long_phase_runs() -> None:
    out = io.StringIO()
    hb = Heartbeat("ampkit doctor", stream=out, every_s=0.02)
    with hb.phase("analysing the run"):
        hb.beat("keep-fp32 search, trial 1")
        time.sleep(0.15)
        hb.beat("keep-fp32 search, trial 2")
        time.sleep(0.15)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 2
    assert all(line.startswith("ampkit doctor: analysing the run, keep-fp32 search, trial ") for line in lines)
    assert lines[-1].startswith("ampkit doctor: analysing the run, keep-fp32 search, trial 2 (")
    after = len(lines)
    time.sleep(0.1)  # the phase ended: its timer is cancelled
    assert len(out.getvalue().splitlines()) == after
