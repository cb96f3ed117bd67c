"""The live, step and script doctors write one ``ampkit.doctor/1`` document for one failure.

One training loop (``_LOOP``: a forward that overflows fp16 under fp16 autocast, and an fp16 loss) runs
under each doctor: as a script under ``ampkit doctor``, with ``MixedPrecision(doctor=True)``, and its first
step under ``diagnose_step``.  Their JSON findings must agree on the codes both report, the severity, the
evidence keys and the spelling of every dtype in the evidence.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ampkit
from ampkit._util.dtypes import dtype_name
from ampkit.cli.main import main
from ampkit.diagnose.report.json import write_json
from ampkit.diagnose.step.api import diagnose_step
from ampkit.scaler import DynamicLossScaler

_MODEL = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x) * 1e4  # squared, far above fp16's 65504
        return h * h


torch.manual_seed(0)
model = Net()
batches = [torch.randn(4, 8) for _ in range(2)]
SCALE = 1024.0  # below fp16's largest value: the fp16 loss is finite x scale, not inf at every value
'''
_LOOP = _MODEL + '''
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
for x in batches:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
'''

SHARED = ("FORWARD_OVERFLOW", "LOSS_IN_LOW_PRECISION")
"""The codes every doctor reports for this failure (the script doctor adds SLOW_LOW_PRECISION, a measurement
of this machine's fp16 speed that the other doctors do not make)."""

OWN_KEYS = {
    "script": {"occurrences", "steps"},
    "live": {"replay_reason", "params_from_step", "consequences", "consequence_steps"},
    "step": {"nan_birth"},
}
"""Evidence only one doctor can give, and why: the script doctor's ledger counts a finding seen again on
later steps (``occurrences``, ``steps``); the live doctor says why and on which weights it replayed a step
and folds later failing steps into the first (``consequence*``); ``diagnose_step`` traces the loss itself,
where the overflow's inf turns into NaN (``nan_birth``), while the replays of the live and script doctors
start at the model's outputs with the gradients they captured."""

DTYPE_KEYS = ("loss_dtype", "input_dtypes", "output_dtype", "dtype")


def _model() -> dict[str, Any]:
    scope: dict[str, Any] = {}
    exec(compile(_MODEL, "<doctor agreement model>", "exec"), scope)
    return scope


def _script_document(tmp_path: Path) -> dict[str, Any]:
    script, out = tmp_path / "train.py", tmp_path / "script.json"
    script.write_text(_LOOP)
    main(["doctor", "--json", str(out), str(script)])
    return json.loads(out.read_text())


def _live_document(tmp_path: Path) -> dict[str, Any]:
    scope = _model()
    model, batches = scope["model"], scope["batches"]
    mp = ampkit.MixedPrecision("fp16", device="cpu", scaler=DynamicLossScaler(init_scale=scope["SCALE"]),
                               doctor=True)
    mp.prepare(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in batches:
        with mp.autocast():
            loss = model(x).mean()
        mp.backward(loss)
        mp.step(opt)
    assert mp.doctor is not None
    return write_json(tmp_path / "live.json", mp.doctor.findings, environment={})


def _step_document(tmp_path: Path) -> dict[str, Any]:
    scope = _model()
    model, batches = scope["model"], scope["batches"]

    def run(m: nn.Module) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return m(batches[0]).mean()

    result = diagnose_step(model, run, precision="fp16", loss_scale=scope["SCALE"], step=1)
    return write_json(tmp_path / "step.json", result, environment={})


def _first_of_each_code(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for f in doc["findings"]:  # worst first: the first of a code is the one that decided its severity
        out.setdefault(f["code"], f)
    return out


@pytest.fixture(scope="module")
def documents(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("agreement")
    return {"script": _first_of_each_code(_script_document(tmp)), "live": _first_of_each_code(_live_document(tmp)),
            "step": _first_of_each_code(_step_document(tmp))}


def test_doctor_documents_of_live_step_and_script_agree_key_for_key(
        documents: dict[str, dict[str, dict[str, Any]]]) -> None:
    for doctor, findings in documents.items():
        assert set(SHARED) <= set(findings), f"{doctor} doctor reported {sorted(findings)}"
    for code in SHARED:
        rows = {doctor: findings[code] for doctor, findings in documents.items()}
        assert {d: f["severity"] for d, f in rows.items()} == dict.fromkeys(rows, rows["step"]["severity"]), code
        keys = {d: sorted(set(f["evidence"]) - OWN_KEYS[d]) for d, f in rows.items()}
        assert keys == dict.fromkeys(rows, keys["step"]), code
        spelled = {d: {k: f["evidence"][k] for k in DTYPE_KEYS if k in f["evidence"]} for d, f in rows.items()}
        assert spelled == dict.fromkeys(rows, spelled["step"]), code
        for name in spelled["step"].values():
            for one in name if isinstance(name, list) else [name]:
                assert one == dtype_name(one) == "fp16", (code, spelled)
