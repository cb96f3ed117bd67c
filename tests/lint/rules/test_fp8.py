"""``ampkit.lint.rules.fp8``: AMP117 (fp8 without compile), AMP118 (fp8 all-gather without the
scale precompute), AMP119 (the precompute before the step), AMP120 (conversion after fully_shard)."""

from __future__ import annotations

import pytest

from . import hits

_LOOP = (
    "for x in loader:\n"
    "    model(x).sum().backward()\n"
    "    opt.step()\n"
)


@pytest.mark.parametrize("imported, called", [
    ("from torchao.float8 import convert_to_float8_training", "convert_to_float8_training(model)"),
    ("from torchao.float8 import convert_to_float8_training as to_fp8", "to_fp8(model)"),
    ("import torchao", "torchao.float8.convert_to_float8_training(model)"),
    ("import torchao.float8 as f8", "f8.convert_to_float8_training(model)"),
    ("from torchao.float8.float8_linear_utils import convert_to_float8_training",
     "convert_to_float8_training(model)"),
])
def test_fp8_conversion_under_any_import_path_without_compile_is_reported(imported: str, called: str) -> None:
    assert hits(f"import torch\n{imported}\n{called}\n{_LOOP}") == [(3, "AMP117")]


@pytest.mark.parametrize("compiled", [
    "model = torch.compile(model)",
    "model.compile()",
    "from torch import compile as tc\nmodel = tc(model)",
    "model = apply_compile(model, job_config)",
    "if args.compile:\n    model = torch.compile(model)",
])
def test_fp8_conversion_with_compile_anywhere_is_not_reported(compiled: str) -> None:
    assert hits("import torch\nfrom torchao.float8 import convert_to_float8_training\n"
                f"convert_to_float8_training(model)\n{compiled}\n{_LOOP}") == []


def test_fp8_regex_and_builtin_compile_do_not_count_as_compiling_the_model() -> None:
    assert hits("import re\nimport torch\nfrom torchao.float8 import convert_to_float8_training\n"
                "PATTERN = re.compile('x')\ncode = compile('1', '<s>', 'eval')\n"
                f"convert_to_float8_training(model)\n{_LOOP}") == [(6, "AMP117")]


def test_fp8_conversion_in_a_helper_without_backward_is_not_judged() -> None:
    # A library function that converts leaves compiling to the caller's training script.
    assert hits("from torchao.float8 import convert_to_float8_training\n"
                "def to_fp8(model):\n    convert_to_float8_training(model)\n    return model\n") == []


@pytest.mark.parametrize("construction", [
    'ampkit.MixedPrecision("fp8", device="cuda")',
    'ampkit.MixedPrecision(precision="fp8-tensorwise")',
    'ampkit.mixed_precision.MixedPrecision("fp8-rowwise")',
    'ampkit.MixedPrecision("fp8-rowwise-gw-hp", device="cuda")',
    'ampkit.engine.Engine("fp8")',
])
def test_fp8_ampkit_engine_without_compile_is_reported(construction: str) -> None:
    assert hits(f"import ampkit\nmp = {construction}\nmodel = mp.prepare(model)\nmp.backward(loss)\n") \
        == [(2, "AMP117")]


def test_fp8_precision_names_are_every_spelling_of_an_fp8_precision() -> None:
    # lint never imports torch, so it spells the names out; they must follow ampkit.precision's.
    from ampkit.lint.rules.fp8 import _FP8_PRECISIONS
    from ampkit.precision import FP8_RECIPES, PRECISION_ALIASES

    assert {spelling for spelling, name in PRECISION_ALIASES.items() if name in FP8_RECIPES} == _FP8_PRECISIONS


@pytest.mark.parametrize("construction", [
    'ampkit.MixedPrecision("bf16")',
    'ampkit.MixedPrecision(args.precision)',
    'MixedPrecision("fp8")',  # not ampkit's: a bare name the file never imports from ampkit
    'torch.distributed.fsdp.MixedPrecision(param_dtype=torch.bfloat16)',
])
def test_fp8_other_engines_are_not_judged(construction: str) -> None:
    assert hits(f"import ampkit\nimport torch\nmp = {construction}\nmp.backward(loss)\n") == []


_SHARDED = (
    "import torch\n"
    "from torch.distributed.fsdp import fully_shard\n"
    "from torchao.float8 import Float8LinearConfig, convert_to_float8_training\n"
    "import torchao.float8 as f8\n"
    "config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)\n"
    "convert_to_float8_training(model, config=config)\n"
    "fully_shard(model)\n"
    "model = torch.compile(model)\n"
    "opt = torch.optim.AdamW(model.parameters())\n"
    "for x in loader:\n"
    "    model(x).sum().backward()\n"
    "    opt.step()\n"
)


def test_fp8_all_gather_without_precompute_is_reported_at_the_config() -> None:
    assert hits(_SHARDED) == [(5, "AMP118")]


@pytest.mark.parametrize("precompute", [
    "    f8.precompute_float8_dynamic_scale_for_fsdp(model)\n",
    "opt.register_step_post_hook(lambda *a: f8.precompute_float8_dynamic_scale_for_fsdp(model))\n",
])
def test_fp8_all_gather_with_precompute_is_not_reported(precompute: str) -> None:
    assert hits(_SHARDED + precompute) == []


def test_fp8_all_gather_set_by_dataclasses_replace_is_reported() -> None:
    source = _SHARDED.replace("Float8LinearConfig(enable_fsdp_float8_all_gather=True)",
                              "dataclasses.replace(Float8LinearConfig(), enable_fsdp_float8_all_gather=True)")
    assert hits(source) == [(5, "AMP118")]


@pytest.mark.parametrize("change", [
    ("enable_fsdp_float8_all_gather=True", "enable_fsdp_float8_all_gather=args.all_gather"),
    ("fully_shard(model)", "model = DDP(model)"),
    ("    opt.step()\n", ""),
])
def test_fp8_all_gather_rule_needs_the_flag_the_sharding_and_the_step(change: tuple[str, str]) -> None:
    assert hits(_SHARDED.replace(*change)) == []


def _precompute_loop(body: str) -> str:
    return ("import torch\nfrom torchao.float8 import precompute_float8_dynamic_scale_for_fsdp as pre\n"
            "def train(model, opt, loader):\n    for x in loader:\n" + body)


def test_fp8_precompute_between_backward_and_step_is_reported() -> None:
    assert hits(_precompute_loop(
        "        model(x).sum().backward()\n"
        "        pre(model)\n"
        "        opt.step()\n"
    )) == [(6, "AMP119")]


@pytest.mark.parametrize("body", [
    "        model(x).sum().backward()\n        opt.step()\n        pre(model)\n",
    "        pre(model)\n        model(x).sum().backward()\n        opt.step()\n",
    # Under a branch the step does not take: the paths never hold a precompute followed by the step.
    "        model(x).sum().backward()\n        if fp8:\n            opt.step()\n            pre(model)\n"
    "        else:\n            opt.step()\n",
])
def test_fp8_precompute_after_the_step_or_before_the_forward_is_not_reported(body: str) -> None:
    assert hits(_precompute_loop(body)) == []


def test_fp8_precompute_before_a_step_the_scaler_takes_is_reported() -> None:
    assert hits(_precompute_loop(
        "        scaler.scale(model(x).sum()).backward()\n"
        "        pre(model)\n"
        "        scaler.step(opt)\n"
        "        scaler.update()\n"
    )) == [(6, "AMP119")]


def test_fp8_precompute_with_the_steps_in_an_inner_loop_is_not_judged() -> None:
    assert hits(_precompute_loop(
        "        for micro in x:\n"
        "            model(micro).sum().backward()\n"
        "            opt.step()\n"
        "        pre(model)\n"
    )) == []


_SHARD_THEN = (
    "from torch.distributed.fsdp import fully_shard\n"
    "from torchao.float8 import convert_to_float8_training\n"
    "def build(model):\n"
)


@pytest.mark.parametrize("shard", [
    "    fully_shard(model)\n",
    "    for block in model.layers:\n        fully_shard(block)\n",
    "    for name, block in model.layers.named_children():\n        fully_shard(block)\n",
    "    torch.distributed.fsdp.fully_shard(model.layers[0])\n    fully_shard(model.embed)\n",
])
def test_fp8_conversion_after_sharding_the_model_or_its_blocks_is_reported(shard: str) -> None:
    source = _SHARD_THEN + shard + "    convert_to_float8_training(model)\n"
    assert hits(source) == [(source.count("\n"), "AMP120")]


def test_fp8_conversion_before_sharding_is_not_reported() -> None:
    assert hits(_SHARD_THEN + "    convert_to_float8_training(model)\n    fully_shard(model)\n") == []


def test_fp8_conversion_and_sharding_on_exclusive_branches_are_not_sequenced() -> None:
    assert hits(_SHARD_THEN + "    if fsdp:\n        fully_shard(model)\n"
                "    else:\n        convert_to_float8_training(model)\n") == []


def test_fp8_conversion_of_a_rebound_name_after_sharding_is_not_reported() -> None:
    # torchao's own FSDP2 test: the name is bound to a fresh model between the two calls.
    assert hits(_SHARD_THEN + "    fully_shard(model)\n    model = build_again()\n"
                "    model = convert_to_float8_training(model)\n") == []


def test_fp8_conversion_in_a_test_file_is_not_judged() -> None:
    # Tests run eager on purpose: they check numerics, not speed.
    assert hits(f"import pytest\nfrom torchao.float8 import convert_to_float8_training\n"
                f"convert_to_float8_training(model)\n{_LOOP}") == []
