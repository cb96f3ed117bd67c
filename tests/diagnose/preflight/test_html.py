"""The preflight HTML page: written atomically, module names from the model escaped, rendered in Chromium."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from torch import nn

from ampkit.diagnose.preflight.api import preflight_model
from ampkit.diagnose.preflight.heatmap import MAX_ROWS_WITH_CONTAINERS, heatmap_modules, render_heatmaps
from ampkit.diagnose.preflight.html import write_preflight_html
from ampkit.diagnose.preflight.result import FormatReport, LayerReport, PreflightResult
from tests.diagnose.preflight.models import OVERFLOW_GAIN, Stack, batches, loss
from tests.helpers.browser import page_errors, probe_page

EVIL = "<script>alert(1)</script>"
EVIL_MODULE = f"blocks.{EVIL}"


@pytest.fixture(scope="module")
def result() -> PreflightResult:
    """fp16 breaks at blocks.2.wo (a policy), bf16 is safe, mxfp8 is emulated; a Linear named <script> after
    blocks.2 overflows fp16 too, so its name is in the policy and the reason as well as in the heatmaps."""
    torch.manual_seed(0)
    model = Stack(OVERFLOW_GAIN)
    model.blocks.add_module(EVIL, nn.Linear(32, 32))
    return preflight_model(model, batches(), loss_fn=loss, formats="fp16,bf16,mxfp8")


@pytest.fixture(scope="module")
def page(result: PreflightResult, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("preflight_html") / "preflight.html"
    write_preflight_html(result, path)
    return path


def test_write_preflight_html_writes_one_page_and_no_temp_file(page: Path) -> None:
    assert [p.name for p in page.parent.iterdir()] == ["preflight.html"]
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    assert "http-equiv=\"Content-Security-Policy\"" in text
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", text)


def test_preflight_html_writes_the_script_module_name_escaped_only(result: PreflightResult, page: Path) -> None:
    assert EVIL_MODULE in {layer.module for layer in result.report("fp16").layers}
    text = page.read_text()
    assert "<script" not in text and "alert(1)</" not in text
    assert text.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 4  # policy, reason, a tick label of each heatmap


def test_heatmap_svg_holds_a_script_module_name_as_the_text_of_a_text_element(result: PreflightResult) -> None:
    # matplotlib escapes SVG text: the markup parses as XML, and the name comes back as a text node, never a tag
    for svg in render_heatmaps(result).values():
        assert "<script" not in svg
        root = ET.fromstring(svg)
        assert not [el for el in root.iter() if el.tag.rpartition("}")[2] == "script"]
        assert EVIL_MODULE in ["".join(el.itertext()) for el in root.iter() if el.tag.endswith("}text")]


def test_heatmaps_outline_the_broken_layer_of_each_format(result: PreflightResult) -> None:
    broken = sum(layer.broken for f in result.formats for layer in f.layers)
    assert broken >= 1
    for svg in render_heatmaps(result).values():
        assert svg.count("stroke: #111111") == broken


def test_preflight_html_renders_in_chromium_with_both_heatmaps_and_the_verdict_table(page: Path) -> None:
    probed, log = probe_page(page, """{
      verdicts: doc.getElementById("verdicts").innerText,
      charts: ["headroom", "sqnr"].map(name => {
        const svg = doc.querySelector(`#heatmap-${name} svg`);
        const box = svg.getBoundingClientRect(), style = doc.defaultView.getComputedStyle(svg);
        return {width: box.width, height: box.height, shown: style.display !== "none" && style.visibility === "visible",
                text: svg.textContent};
      }),
      scripts: doc.querySelectorAll("script").length,
    }""")
    verdicts = probed["verdicts"]
    for text in ("fp16", "bf16", "mxfp8", "emulated", "safe with policy", f"keep_fp32=['blocks.2.wo', '{EVIL_MODULE}']",
                 "aten::addmm", "FORWARD_OVERFLOW", "lowest forward SQNR"):
        assert text in verdicts, text
    for chart in probed["charts"]:
        assert chart["shown"] and chart["width"] > 300 and chart["height"] > 300, chart
        assert EVIL_MODULE in chart["text"]  # the name is shown as text
    assert probed["scripts"] == 0
    assert page_errors(log) == []


def test_heatmap_modules_keep_only_the_leaves_of_a_model_with_many_modules() -> None:
    def result_of(names: list[str]) -> PreflightResult:
        layers = [LayerReport(module=n, type="Linear") for n in names]
        return PreflightResult(formats=[FormatReport(format="bf16", verdict="safe", emulated=False, layers=layers)],
                               inputs={})

    few = ["a.0", "a.1", "a", ""]
    assert heatmap_modules(result_of(few)) == few
    many = [f"blocks.{i}.{leaf}" for i in range(MAX_ROWS_WITH_CONTAINERS // 2) for leaf in ("wi", "wo")]
    containers = [f"blocks.{i}" for i in range(MAX_ROWS_WITH_CONTAINERS // 2)] + ["blocks", "head", ""]
    assert heatmap_modules(result_of(many + containers)) == [*many, "head"]
