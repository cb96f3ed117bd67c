"""`ampkit env`: the JSON and text forms of the environment record, and bad input."""

from __future__ import annotations

import json

import pytest
import torch

from ampkit.cli.main import main
from ampkit.env import collect_environment, format_environment


def test_env_cli_json_includes_measured_matmul_throughput(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--json", "--matmul-n", "64"]) == 0
    env = json.loads(capsys.readouterr().out)
    rates = env["matmul_tflops"]["cpu"]
    assert set(rates) == {"fp32", "bf16", "fp16"} and all(v > 0 for v in rates.values())


def test_env_cli_text_names_versions_and_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--no-measure"]) == 0
    text = capsys.readouterr().out
    assert f"torch    {torch.__version__}" in text and "avx512_bf16=" in text and "autocast cpu:" in text
    assert format_environment(collect_environment(full=True)).splitlines()[0].startswith("ampkit")


def test_env_cli_bad_matrix_size_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--matmul-n", "3"]) == 2
    assert "--matmul-n 3" in capsys.readouterr().err
    # a size whose matrices cannot be allocated is bad input too, refused before any allocation
    assert main(["env", "--matmul-n", "1000000"]) == 2
    assert "--matmul-n 1000000: use a matrix size from 16 to 8192" in capsys.readouterr().err
