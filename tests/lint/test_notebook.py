"""``ampkit lint nb.ipynb``: the code cells are linted as one module, positions are per cell."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ampkit.cli.main import main
from ampkit.lint import lint_paths


def _notebook(path: Path, *cells: tuple[str, str]) -> Path:
    document = {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": kind, "metadata": {}, "source": text.splitlines(keepends=True),
         **({"outputs": [], "execution_count": None} if kind == "code" else {})}
        for kind, text in cells]}
    path.write_text(json.dumps(document, indent=1))
    return path


TRAIN = (
    ("markdown", "# Training\n"),
    ("code", "!pip install timm\n%matplotlib inline\nimport torch\nscaler = torch.cuda.amp.GradScaler()\n"),
    ("code", "for x in data:\n    scaler.scale(loss).backward()\n    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
             "    scaler.step(opt)\n    scaler.update()\n    files = !ls\n    model?\n"),
    ("code", "%%bash\necho torch.cuda.amp.GradScaler()\n"),
)


def test_notebook_code_cells_are_linted_across_cells_with_cell_positions(tmp_path: Path, capsys: Any) -> None:
    nb = _notebook(tmp_path / "nb.ipynb", *TRAIN)
    assert main(["lint", str(nb)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert [line.split(": ", 1)[0] + " " + line.split(": ", 1)[1][:6] for line in out] == [
        f"{nb}:cell 2:4:10 AMP101",  # the 4th line of the 2nd cell (the markdown cell counts)
        f"{nb}:cell 3:3:5 AMP102",   # the scaler of cell 2 followed into cell 3
    ]


def test_notebook_json_output_names_the_cell(tmp_path: Path, capsys: Any) -> None:
    nb = _notebook(tmp_path / "nb.ipynb", *TRAIN)
    main(["lint", "--format", "json", str(nb)])
    records = json.loads(capsys.readouterr().out)["violations"]
    assert [(r["cell"], r["line"], r["col"], r["code"]) for r in records] == [(2, 4, 10, "AMP101"), (3, 3, 5, "AMP102")]


def test_notebook_fix_refuses_to_rewrite_it_and_says_so(tmp_path: Path, capsys: Any) -> None:
    nb = _notebook(tmp_path / "nb.ipynb", *TRAIN)
    before = nb.read_bytes()
    assert main(["lint", "--fix", str(nb)]) == 1
    err = capsys.readouterr().err
    assert nb.read_bytes() == before
    assert f"ampkit lint: note: {nb}: --fix does not rewrite notebooks" in err


def test_notebook_malformed_json_is_an_error_and_the_rest_is_checked(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "bad.ipynb").write_text('{"cells": [')
    (tmp_path / "not_nb.ipynb").write_text('{"cells": 3}')
    (tmp_path / "ok.py").write_text("import torch\nstate = torch.load('p')\n")
    paths = [str(tmp_path / name) for name in ("bad.ipynb", "not_nb.ipynb", "ok.py")]
    assert main(["lint", *paths]) == 2
    out, err = capsys.readouterr()
    assert "ok.py:2:9: AMP113" in out
    assert f"ampkit lint: error: {paths[0]}: not valid notebook JSON (" in err
    assert f"ampkit lint: error: {paths[1]}: not a Jupyter notebook" in err


def test_notebook_a_cell_that_does_not_parse_is_amp000_at_its_cell(tmp_path: Path) -> None:
    nb = _notebook(tmp_path / "nb.ipynb", ("code", "x = 1\n"), ("code", "y = 2\ndef f(:\n"))
    report = lint_paths([str(nb)])
    assert [(v.cell, v.line, v.code) for v in report.violations] == [(2, 2, "AMP000")]


def test_notebook_directory_walks_take_py_files_only(tmp_path: Path) -> None:
    _notebook(tmp_path / "nb.ipynb", *TRAIN)
    (tmp_path / "ok.py").write_text("x = 1\n")
    report = lint_paths([str(tmp_path)])
    assert (report.files, report.violations) == (1, [])
