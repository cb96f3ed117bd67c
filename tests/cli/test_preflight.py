"""`ampkit preflight` on the command line: a task, a script, a model directory, and bad input (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ampkit.cli.errors import UsageError
from ampkit.cli.main import main
from ampkit.cli.preflight import parse_duration

_TASK = '''
import torch
from torch import nn
from ampkit.tasks import TaskBase


class Tiny(TaskBase):
    name = "tiny"
    metrics = {"loss": "lower"}

    def __init__(self, gain=1.0):
        self.gain = gain

    def build_model(self, seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.LayerNorm(16), nn.Linear(16, 4))
        with torch.no_grad():
            model[2].weight.mul_(self.gain)
        return model

    def batches(self, seed, device):
        g = torch.Generator().manual_seed(seed)
        while True:
            yield torch.randn(8, 16, generator=g).to(device), torch.randint(0, 4, (8,), generator=g).to(device)

    def loss(self, model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x).float(), y)

    def evaluate(self, model, device):
        return {"loss": 0.0}


healthy = Tiny()
overflowing = Tiny(gain=1e5)  # layer 2's output passes fp16's 65504; the LayerNorm after it takes fp32
'''

_SCRIPT = '''
import sys, pathlib, torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(50):
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
pathlib.Path(sys.argv[1]).write_text("the loop finished")
'''


@pytest.fixture
def task_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny_task.py"
    path.write_text(_TASK)
    return path


def test_preflight_cli_on_a_healthy_task_exits_0_and_writes_a_schema_valid_json(
        task_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    assert main(["preflight", "--formats", "bf16,fp8", "--json", str(out), f"{task_file}:healthy"]) == 0
    doc = json.loads(out.read_text())
    assert [(f["format"], f["verdict"]) for f in doc["formats"]] == [("bf16", "safe"), ("fp8", "safe")]
    assert doc["inputs"]["batches"] == 2
    assert "verdict" in capsys.readouterr().out


def test_preflight_cli_prints_the_fix_of_a_policy_and_the_layer_table(
        task_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["preflight", "--formats", "fp16,bf16", "--precision", "fp16", f"{task_file}:overflowing"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "safe with policy" in out and "keep_fp32=['2']" in out
    assert "fp16: per layer" in out and "BREAKS" in out


def test_preflight_cli_runs_a_script_until_its_first_steps_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    marker = tmp_path / "finished.txt"
    out = tmp_path / "p.json"
    assert main(["preflight", "--formats", "bf16", "--json", str(out), str(script), str(marker)]) == 0
    assert not marker.exists()  # stopped after its first optimizer steps
    doc = json.loads(out.read_text())
    assert doc["inputs"]["batches"] == 2 and doc["formats"][0]["verdict"] == "safe"


def test_preflight_cli_on_a_script_that_never_steps_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "nothing.py"
    script.write_text("print('no training here')\n")
    assert main(["preflight", str(script)]) == 2
    assert "never made a call of a model" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["preflight", "--formats", "fp4", "tinygpt"], "'fp4' is not a format"),
    (["preflight", "--formats", "bf16", "--precision", "fp16", "tinygpt"], "not among the judged formats"),
    (["preflight", "--time-budget", "soon", "tinygpt"], "not a duration"),
    (["preflight", "--steps", "0", "tinygpt"], "--steps 0 must be at least 1"),
    (["preflight", "missing_script.py"], "no such script"),
    (["preflight", "no_such_task_anywhere"], "cannot load task"),
    (["preflight"], "give a training script"),
])
def test_preflight_cli_bad_input_exits_2_naming_it(argv: list[str], message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_preflight_cli_model_directory_needs_text_or_batches(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert main(["preflight", str(tmp_path)]) == 2
    assert "give exactly one of --text FILE or --batches FILE" in capsys.readouterr().err
    assert main(["preflight", str(tmp_path), "--text", "sample.txt"]) == 2
    assert "options come before TARGET" in capsys.readouterr().err


def test_preflight_cli_on_a_hugging_face_directory_with_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(tmp_path / "model")
    vocab = {chr(97 + i): i for i in range(26)} | {" ": 26, "[UNK]": 27}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "model")
    text = tmp_path / "sample.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 20)
    out = tmp_path / "p.json"
    code = main(["preflight", "--formats", "bf16", "--seq-len", "16", "--batch-size", "2", "--json", str(out),
                 "--text", str(text), str(tmp_path / "model")])
    assert code == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert doc["inputs"]["shapes"][0] == {"input_ids": [2, 16], "labels": [2, 16]}
    assert doc["formats"][0]["verdict"] == "safe"


def test_parse_duration_reads_seconds_minutes_and_hours() -> None:
    assert [parse_duration(t) for t in ("45", "90s", "10m", "1h")] == [45.0, 90.0, 600.0, 3600.0]
    with pytest.raises(UsageError):
        parse_duration("-3")


def test_preflight_cli_html_writes_the_page_beside_the_json(
        task_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page, doc = tmp_path / "p.html", tmp_path / "p.json"
    assert main(["preflight", "--formats", "fp16,bf16", "--html", str(page), "--json", str(doc),
                 f"{task_file}:overflowing"]) == 0
    text = page.read_text()
    assert 'id="verdicts"' in text and 'id="heatmap-headroom"' in text and 'id="heatmap-sqnr"' in text
    assert "safe with policy" in text and json.loads(doc.read_text())["formats"][0]["verdict"] == "policy"
    err = capsys.readouterr().err
    assert f"ampkit preflight: wrote {page}" in err and f"ampkit preflight: wrote {doc}" in err
