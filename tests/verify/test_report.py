"""The report files: escaping and rendering in a real browser."""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.helpers.browser import dump_dom, has_chromium, page_errors
from tests.verify.verify_helpers import Job, task_ref, verify

SRC = str(Path(__file__).resolve().parents[2] / "src")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))}

def test_report_html_renders_in_chromium_with_charts_and_no_errors(regression_job: Job, tmp_path: Path) -> None:
    page = regression_job.out / "report.html"
    dom, log = dump_dom(page)
    assert len(re.findall(r"<svg\b", dom)) == 6  # loss, gap, scale, grad norm, eval, performance
    assert 'id="verdict"' in dom and ">PASS<" in dom and "<table>" in dom
    assert page_errors(log) == []
    # the same check does catch a page that tries the network: the report's CSP refuses and Chromium logs it
    leaky = tmp_path / "leaky.html"
    leaky.write_text(page.read_text().replace("</body>", '<img src="https://example.invalid/x.png"></body>'))
    _, leaky_log = dump_dom(leaky)
    assert page_errors(leaky_log), "a blocked external load must show in the browser log"


def test_report_html_is_self_contained(regression_job: Job) -> None:
    text = (regression_job.out / "report.html").read_text()
    assert "<script" not in text and "http-equiv=\"Content-Security-Policy\"" in text
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", text)
    assert "$\\mathdefault" not in text  # axis labels rendered, not leaked mathtext source


def test_report_escapes_names_from_user_code(tmp_path: Path) -> None:
    job = verify(tmp_path, task_ref("Hostile"), "--precisions", "fp32", "--steps", "4", "--warmup", "1")
    assert job.code == 0
    html_text = (tmp_path / "report.html").read_text()
    md_text = (tmp_path / "report.md").read_text()
    for text in (html_text, md_text):
        assert "<script" not in text and "<img" not in text
        assert "&lt;img src=x onerror=alert(1)&gt;" in text
    # escaped in the markup (whichever spelling of the quote's character reference) and shown as the name
    assert "&lt;script&gt;alert(" in html_text
    assert "<script>alert('task')</script>" in html.unescape(re.sub(r"<[^>]+>", "", html_text))
    assert "&lt;script&gt;alert('task')&lt;/script&gt;" in md_text
    assert "r2 &amp; $\\alpha$ \\| x" in md_text  # table pipes escaped too
    assert job.report["task"]["name"] == "<script>alert('task')</script>"  # JSON keeps the data as it is
    if has_chromium():
        dom, log = dump_dom(tmp_path / "report.html")
        assert "<script" not in dom and "<img" not in dom and page_errors(log) == []


def test_report_html_escapes_script_and_quotes_in_a_task_name(regression_job: Job) -> None:
    from ampkit.verify.report import render_html

    evil = '<script>alert("x")</script>'
    report = regression_job.report
    report["task"]["name"], report["task"]["ref"] = evil, f"{evil}.py:Task"
    page = render_html(report, {})
    assert "<script" not in page and 'alert("x")' not in page  # no raw quote: no attribute can be broken out of
    shown = html.unescape(re.sub(r"<[^>]+>", "", page))
    assert f"ampkit verify: {evil}" in shown and f"{evil}.py:Task" in shown


# Rewrites one real report again and again, each time with a new "created"; a thread sends Ctrl-C
# the moment report.md's temp file appears (report.json's is renamed already, or about to be).
# torch's intra-op threads exist, as in a verify run: the kernel may hand SIGINT to any thread.
INTERRUPTED_REWRITES = textwrap.dedent("""
    import json, os, signal, sys, threading
    import torch
    torch.ones(256, 256) @ torch.ones(256, 256)
    from ampkit.verify.report import write_report
    report, out = json.loads(open(sys.argv[1]).read()), sys.argv[2]
    report["created"] = "run 001"
    write_report(report, out)

    def interrupt_during_the_markdown_write():
        while not any(name.startswith(".report.md.") for name in os.listdir(out)):
            pass
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_during_the_markdown_write, daemon=True).start()
    try:
        for run in range(2, 50):
            report["created"] = f"run {run:03d}"
            write_report(report, out)
        print("never interrupted")
    except KeyboardInterrupt:
        print("interrupted")
""")


def test_report_ctrl_c_during_the_writes_leaves_three_files_of_one_run_and_no_temp(
        regression_job: Job, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-c", INTERRUPTED_REWRITES, str(regression_job.out / "report.json"),
                             str(out)], env=ENV, capture_output=True, text=True, timeout=300)
    assert result.stdout == "interrupted\n", result.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["report.html", "report.json", "report.md"], "no temp file"
    created = json.loads((out / "report.json").read_text())["created"]
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert f"Created {created} with" in md, f"report.json is from {created!r}, report.md is not"
    assert f"{created} · ampkit" in page, f"report.json is from {created!r}, report.html is not"


def test_report_final_loss_column_says_it_is_the_mean_of_the_window(regression_job: Job) -> None:
    from ampkit.verify.report import FINAL_LOSS_WINDOW

    said = f"mean of the last {FINAL_LOSS_WINDOW} finite training losses"
    md, page = (regression_job.out / "report.md").read_text(), (regression_job.out / "report.html").read_text()
    assert said in md and said in page
    assert f"final loss (mean of last {FINAL_LOSS_WINDOW})" in md and f"final loss (mean of last {FINAL_LOSS_WINDOW})" in page
    losses = regression_job.run("fp32")["loss"][-FINAL_LOSS_WINDOW:]
    row = next(line for line in md.splitlines() if line.startswith("| fp32 | ok |"))
    assert row.split("|")[3].strip() == format(sum(losses) / len(losses), ".4g")
