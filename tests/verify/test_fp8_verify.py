"""`ampkit verify --precisions` with the fp8 precisions on CPU: real torchao float8 layers in the workers."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import jsonschema
import torch

from ampkit.precision import FP8_RECIPES
from ampkit.verify.harness import default_precisions
from ampkit.verify.report import load_schema
from tests.verify.verify_helpers import cli_command, task_ref, verify


def test_verify_runs_every_fp8_recipe_and_notes_the_cpu_emulation(tmp_path: Path) -> None:
    # 20 steps and no noise run: this is about the fp8 workers and the report, not the verdict's weight
    # (each fp8 worker imports torchao, about 2 s, and emulates its GEMMs on the CPU).
    fp8 = list(FP8_RECIPES)
    job = verify(tmp_path, task_ref("Regression"), "--precisions", ",".join(["fp32", *fp8]), "--seed", "7",
                 "--steps", "20", "--no-noise-band")
    report = job.report
    assert report["protocol"]["precisions"] == ["fp32", *fp8]
    for precision in fp8:
        run = job.run(precision)
        assert run["status"] == "ok" and len(run["loss"]) == 20, run.get("log_tail")
        assert run["init_sha256"] == job.run("fp32")["init_sha256"]  # converted after hashing the fp32 weights
        entry = job.comparison(precision)
        assert entry["verdict"] != "fail", entry["reasons"]
        assert entry["hardware"]["fast_path"] is False
        assert "CPUs have no fp8 GEMM units" in entry["hardware"]["note"]
    losses = [job.run(precision)["loss"] for precision in fp8]
    assert all(a != b for i, a in enumerate(losses) for b in losses[i + 1:])  # three recipes, three roundings
    jsonschema.validate(report, load_schema(), cls=jsonschema.Draft202012Validator)


def test_fp8_is_never_in_the_default_set_on_cpu() -> None:
    assert "fp8" not in default_precisions(torch.device("cpu"))


def test_verify_fp8_with_a_torchao_that_fails_to_import_exits_2_before_training(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow" / "torchao"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('libtorchao_ops.so: undefined symbol: _ZN3c10')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shadow.parent), os.environ.get("PYTHONPATH", "")]),
               TMPDIR=str(tmp_path))
    out = tmp_path / "out"
    proc = subprocess.run(cli_command("verify", task_ref("Regression"), "--precisions", "fp32,fp8", "--out", str(out),
                                      "--no-measure-env", "--no-progress"),
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'ampkit[fp8]'" in proc.stderr and "undefined symbol: _ZN3c10" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists() and not list(tmp_path.glob("ampkit-verify-*")), "nothing trained, nothing written"
