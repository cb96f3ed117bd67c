"""Which files of ``src/ampkit`` a finding passes through on its way to the ``ampkit.doctor/1`` document.

Two doctors are traced, each in this one process, with ``sys.setprofile`` (and ``threading.setprofile``):

* script: ``ampkit doctor --json`` on one corpus case (default ``tests/cases/loss_fp16_overflow.py``);
* live: ``MixedPrecision("fp16", doctor=True)`` on a tiny model whose forward overflows fp16, its
  findings written with ``ampkit.diagnose.write_json``.

A finding exists from the first ``Finding.__post_init__`` or ``Ledger.add`` call (the script doctor's
ledger holds findings as entries before it builds ``Finding`` objects); the span ends when
``write_json`` returns.  Two counts of distinct ``src/ampkit`` files are printed per doctor:

* ``path``: files with a function that received a finding (or a ledger entry) as an argument, or
  returned one; a list, tuple, dict or set holding one counts, one level deep, and so does an object
  whose ``findings`` attribute is a list holding one (a diagnosis result, a script report, a doctor).  This is the
  finding's own way from its creation to the document.
* ``span``: files with any code run between the first finding and the written document (the
  training, the replays and the reporting that happen in between, finding or not).
* ``tail``: files with any code run between the last finding's creation and the written document:
  the assembly of the report, once every finding exists.

Run against a tree: ``PYTHONPATH=/path/to/tree/src .venv/bin/python benchmarks/trace_finding_path.py``
(``--case FILE`` picks another corpus script, ``--files`` lists the files of each count).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn

import ampkit
import ampkit.findings
from ampkit.diagnose.report import json as report_json

ROOT = Path(ampkit.__file__).parent
CASES = Path(__file__).resolve().parents[1] / "tests" / "cases"


def _is_finding(value: Any) -> bool:
    kind = type(value)
    return kind is ampkit.findings.Finding or (kind.__name__ == "_Entry" and kind.__module__.endswith("ledger"))


def _items(value: Any) -> Iterator[Any]:
    yield value
    if isinstance(value, (list, tuple, set, frozenset)):
        yield from value
    elif isinstance(value, dict):
        yield from value.values()
    elif isinstance(getattr(value, "__dict__", None), dict) and isinstance(vars(value).get("findings"), list):
        yield from vars(value)["findings"]  # a result or report that holds findings


def _carries(value: Any) -> bool:
    try:
        return any(_is_finding(v) for v in _items(value))
    except Exception:  # a container that cannot be iterated while the tracer looks at it
        return False


class Tracer:
    """A profile function recording the files of the span and of the finding's path."""

    def __init__(self) -> None:
        self.started = False
        self.done = False
        self.span: set[str] = set()
        self.tail: set[str] = set()
        self.path: set[str] = set()
        starts = [ampkit.findings.Finding.__post_init__.__code__]
        try:
            from ampkit.diagnose.script.ledger import Ledger
            starts.append(Ledger.add.__code__)
        except ImportError:  # a tree without the script doctor's ledger
            pass
        self._starts = tuple(starts)
        self._end = report_json.write_json.__code__

    def _file(self, frame: FrameType) -> str | None:
        name = frame.f_code.co_filename
        try:
            return str(Path(name).relative_to(ROOT))
        except ValueError:
            return None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.done or event not in ("call", "return"):
            return
        code = frame.f_code
        creation = event == "call" and code in self._starts
        if not self.started:
            if not creation:
                return
            self.started = True
        if creation:
            self.tail = set()
        rel = self._file(frame)
        if rel is None:
            return
        self.span.add(rel)
        self.tail.add(rel)
        if event == "call":
            if any(_carries(v) for v in frame.f_locals.values()):
                self.path.add(rel)
        elif _carries(arg):
            self.path.add(rel)
        if event == "return" and code is self._end:
            self.done = True


def traced(run: Callable[[], None]) -> Tracer:
    tracer = Tracer()
    threading.setprofile(tracer)
    sys.setprofile(tracer)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    if not (tracer.started and tracer.done):
        raise SystemExit(f"the trace saw no finding reach the document (started={tracer.started}, done={tracer.done})")
    return tracer


def run_script(case: Path, out: Path) -> None:
    from ampkit.cli.main import main

    main(["doctor", "--json", str(out), str(case)])


class _Overflow(nn.Module):
    """A forward that overflows fp16: x * 1e4 squared exceeds 65504."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) * 1e4
        return h * h


def run_live(out: Path) -> None:
    torch.manual_seed(0)
    model = _Overflow()
    mp = ampkit.MixedPrecision("fp16", device="cpu", doctor=True)
    mp.prepare(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        with mp.autocast():
            loss = model(torch.randn(4, 8)).float().mean()
        mp.backward(loss)
        mp.step(opt)
    report_json.write_json(out, mp.doctor.findings, environment={"device": "cpu"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", type=Path, default=CASES / "loss_fp16_overflow.py")
    parser.add_argument("--files", action="store_true", help="list the files of each count")
    args = parser.parse_args()
    print(f"tree: {ROOT}")
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"script " + args.case.name: lambda: run_script(args.case, Path(tmp) / "script.json"),
                "live": lambda: run_live(Path(tmp) / "live.json")}
        for label, run in runs.items():
            tracer = traced(run)
            print(f"{label}: path {len(tracer.path)} files, span {len(tracer.span)} files, "
                  f"tail {len(tracer.tail)} files")
            if args.files:
                for name in ("path", "span", "tail"):
                    print(f"  {name}:", " ".join(sorted(getattr(tracer, name))))


if __name__ == "__main__":
    main()
