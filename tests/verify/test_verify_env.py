"""Environment record and `ampkit env`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ampkit.cli.main import main
from ampkit.verify.env import CPU_FLAGS, collect_environment, format_environment


def test_env_record_reads_the_cpu_flags_from_proc_cpuinfo() -> None:
    env = collect_environment(measure=False)
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo on this platform")
    flags = set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    assert env["cpu"]["flags"] == {f: f in flags for f in CPU_FLAGS}
    assert env["threads"]["intra_op"] == torch.get_num_threads()
    assert env["torch"] == torch.__version__ and env["cuda"] == torch.version.cuda
    assert "matmul_tflops" not in env


def test_env_autocast_dtypes_list_what_autocast_enables_on_cpu() -> None:
    env = collect_environment(measure=False)
    assert env["autocast"]["cpu"]["default"] == "bf16"
    assert "bf16" in env["autocast"]["cpu"]["supported"]


def test_env_cli_json_includes_measured_matmul_throughput(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--json", "--matmul-n", "64"]) == 0
    env = json.loads(capsys.readouterr().out)
    rates = env["matmul_tflops"]["cpu"]
    assert set(rates) == {"fp32", "bf16", "fp16"} and all(v > 0 for v in rates.values())


def test_env_cli_text_names_versions_and_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--no-measure"]) == 0
    text = capsys.readouterr().out
    assert f"torch    {torch.__version__}" in text and "avx512_bf16=" in text and "autocast cpu:" in text
    assert format_environment(collect_environment(measure=False)).splitlines()[0].startswith("ampkit")


def test_env_cli_bad_matrix_size_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--matmul-n", "3"]) == 2
    assert "--matmul-n 3" in capsys.readouterr().err
