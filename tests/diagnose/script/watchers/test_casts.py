"""The cast watcher: where parameters became fp16/bf16, named by LOW_PRECISION_PARAMS and DTYPE_MISMATCH."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import torch
from torch import nn

from ampkit.diagnose.script.runner import run_script
from ampkit.diagnose.script.watchers.casts import CastWatch
from diagnose.script.observe import observe
from diagnose.script.watchers.alone import watching

HELPERS = Path(__file__).parents[3] / "integrations"
HERE = Path(__file__).relative_to(Path.cwd())


def _here(fn: object, offset: int) -> str:
    code = fn.__code__  # type: ignore[attr-defined]
    return f"{Path(code.co_filename).relative_to(Path.cwd())}:{code.co_firstlineno + offset}"


def _low_params(ctx: object) -> list:
    return [f for f in ctx.state.ledger.findings() if f.code == "LOW_PRECISION_PARAMS"]  # type: ignore[attr-defined]


def test_low_precision_params_names_the_half_call_and_fixes_it_there() -> None:
    def train() -> None:
        model = nn.Linear(4, 2)
        model.half()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(3, 4, dtype=torch.float16)).float().pow(2).mean().backward()
        opt.step()

    (f,) = _low_params(observe(train))
    assert f.location == _here(train, 2)
    assert f"through `.half()` at {_here(train, 2)}" in f.message
    assert f.fix.startswith(f"keep the parameters in fp32: drop `.half()` at {_here(train, 2)}")
    assert f.evidence["made_low_precision"] == {"location": _here(train, 2), "call": ".half()", "dtype": "fp16",
                                                "kind": "cast"}


def test_low_precision_params_names_a_to_dtype_call_and_ignores_a_later_device_move() -> None:
    def train() -> None:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        model.to(torch.bfloat16)
        model.to("cpu")  # changes no dtype: not the cause
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(3, 4, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()

    (f,) = _low_params(observe(train))
    assert f.evidence["made_low_precision"]["call"] == ".to(torch.bfloat16)"
    assert f.location == _here(train, 2)


def test_low_precision_params_names_from_pretrained_dtype_and_says_load_in_fp32(tmp_path: Path) -> None:
    sys.path.insert(0, str(HELPERS))
    try:
        from hf_helpers import tiny_gpt2
    finally:
        sys.path.remove(str(HELPERS))
    tiny_gpt2().save_pretrained(tmp_path)
    from transformers import GPT2LMHeadModel

    def train() -> None:
        model = GPT2LMHeadModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, 64, (2, 8))
        model(x, labels=x).loss.backward()
        opt.step()

    (f,) = _low_params(observe(train))
    at = _here(train, 1)
    assert f.location == at
    assert f"through `from_pretrained(dtype=torch.bfloat16)` at {at}" in f.message
    assert f.fix.startswith(f"load in fp32: drop dtype=torch.bfloat16 from from_pretrained at {at}")
    assert "model.half()" not in f.fix
    assert f.evidence["made_low_precision"]["kind"] == "load"


def test_cast_watch_restores_module_methods_and_the_import_hook() -> None:
    before = {name: vars(nn.Module)[name] for name in ("half", "bfloat16", "to", "type")}
    finders = list(sys.meta_path)
    observe(lambda: nn.Linear(2, 2).half())
    assert {name: vars(nn.Module)[name] for name in before} == before
    assert sys.meta_path == finders


def test_dtype_mismatch_of_a_half_model_under_autocast_names_fp16_params_their_cast_and_the_forward_line(
        tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        import torch
        from torch import nn

        model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
        model.half()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(torch.randn(4, 8))
            out.float().pow(2).mean().backward()
            opt.step()
    """))
    report = run_script(script, measure_speed=False)
    (f,) = [f for f in report.findings if f.code == "DTYPE_MISMATCH"]
    assert f.location is not None and f.location.endswith("train.py:9")  # model(...): the forward line
    assert "ran under autocast" in f.message and "stored in fp16" in f.message
    assert "through `.half()` at" in f.message and "train.py:5" in f.message
    assert "call chain:" in f.message
    assert f.fix.startswith("keep the parameters in fp32: drop `.half()` at") and "mp.autocast()" not in f.fix
    assert f.evidence["made_low_precision"]["call"] == ".half()"


def test_low_precision_params_names_a_lightning_true_precision_conversion(tmp_path: Path) -> None:
    import lightning as L

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 1)

        def training_step(self, batch: list[torch.Tensor], i: int) -> torch.Tensor:
            return self.net(batch[0]).float().pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def train() -> None:
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
        L.Trainer(accelerator="cpu", precision="bf16-true", max_steps=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path).fit(Net(), data)

    (f,) = _low_params(observe(train))
    assert f.evidence["made_low_precision"]["kind"] == "framework"
    assert f"lightning converted them to bf16 with `.to(torch.bfloat16)` during the call at {_here(train, 3)}" in f.message
    assert "precision='bf16-mixed'" in f.fix


def test_cast_watch_alone_records_where_parameters_became_low_precision() -> None:
    with watching(CastWatch) as w:
        model, kept = nn.Linear(2, 2), nn.Linear(2, 2)
        line = sys._getframe().f_lineno + 1
        model.to(torch.bfloat16)
        kept.double()  # not fp16/bf16: no site
    site = w.state.casts.origin(model.parameters())
    assert site is not None and (site.how, site.dtype, site.kind, site.location) == (
        ".to(torch.bfloat16)", "bf16", "cast", f"{HERE}:{line}")
    assert w.state.casts.origin(kept.parameters()) is None and len(w.state.casts) == 2
