"""``ampkit lint`` on the command line: exit codes, formats, noqa, selection, file discovery."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from ampkit.cli.main import main
from tests.helpers.mounts import read_only, run_after_mounting

LINT_SCHEMA = {
    "type": "object",
    "required": ["schema", "violations"],
    "properties": {
        "schema": {"const": "ampkit.lint/1"},
        "violations": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["code", "path", "line", "col", "message"],
                "properties": {
                    "code": {"type": "string", "pattern": "^AMP[0-9]{3}$"},
                    "path": {"type": "string"},
                    "line": {"type": "integer", "minimum": 1},
                    "col": {"type": "integer", "minimum": 1},
                    "message": {"type": "string", "minLength": 1},
                },
            },
        },
    },
}

UNSAFE_LOAD = "import torch\nstate = torch.load('ckpt.pt')\n"
DEPRECATED = "import torch\nscaler = torch.cuda.amp.GradScaler()\n"
CLEAN = "import torch\nstate = torch.load('ckpt.pt', weights_only=True)\n"


def lint(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["lint", *args])
    out, err = capsys.readouterr()
    return code, out, err


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_cli_lint_exits_0_on_clean_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path / "train.py", CLEAN)
    code, out, err = lint(capsys, str(tmp_path))
    assert (code, out) == (0, "")
    assert "1 file(s) checked, no violations" in err


def test_cli_lint_exits_1_and_prints_path_line_col_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = write(tmp_path / "train.py", UNSAFE_LOAD)
    code, out, _ = lint(capsys, str(target))
    assert code == 1
    assert re.fullmatch(rf"{re.escape(str(target))}:2:9: AMP113 torch\.load without weights_only=True .+\n", out)


def test_cli_lint_exits_2_on_unknown_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path / "train.py", CLEAN)
    code, out, err = lint(capsys, "--select", "AMP101,AMP999", str(tmp_path))
    assert (code, out) == (2, "")
    assert "unknown rule code 'AMP999'" in err and "AMP116" in err
    assert lint(capsys, "--ignore", "XYZ1", str(tmp_path))[0] == 2


def test_cli_lint_exits_2_on_missing_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = lint(capsys, str(tmp_path / "nope.py"))
    assert code == 2
    assert "no such file or directory" in err and "nope.py" in err


def test_cli_lint_rejects_unknown_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["lint", "--format", "xml", str(tmp_path)])
    assert exc.value.code == 2


def test_cli_lint_json_follows_the_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path / "a.py", UNSAFE_LOAD)
    write(tmp_path / "b.py", DEPRECATED)
    code, out, _ = lint(capsys, "--format", "json", str(tmp_path))
    document = json.loads(out)
    jsonschema.validate(document, LINT_SCHEMA)
    assert code == 1
    assert [(v["path"], v["line"], v["col"], v["code"]) for v in document["violations"]] == [
        (str(tmp_path / "a.py"), 2, 9, "AMP113"),
        (str(tmp_path / "b.py"), 2, 10, "AMP101"),
    ]
    assert document["files_checked"] == 2


def test_cli_lint_json_is_valid_when_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path / "a.py", CLEAN)
    code, out, _ = lint(capsys, "--format", "json", str(tmp_path))
    assert code == 0
    assert json.loads(out)["violations"] == []


def test_cli_lint_github_format_prints_escaped_annotations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = write(tmp_path / "odd,dir" / "train.py", UNSAFE_LOAD)
    code, out, _ = lint(capsys, "--format", "github", str(target))
    assert code == 1
    escaped = str(target).replace(",", "%2C").replace(":", "%3A")
    assert out.startswith(f"::error file={escaped},line=2,col=9,title=AMP113::torch.load without weights_only=True")
    assert out.count("\n") == 1


def test_cli_lint_noqa_with_code_silences_only_that_rule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = write(tmp_path / "t.py", (
        "import torch\n"
        "a = torch.load('a.pt')  # noqa: AMP113\n"
        "b = torch.load('b.pt')  # noqa: AMP101\n"
        "c = torch.load('c.pt')  # noqa:AMP101,AMP113\n"
        "s = torch.cuda.amp.GradScaler()  # noqa\n"
        "d = torch.load(\n"
        "    'd.pt',\n"
        ")  # noqa: AMP113\n"
    ))
    code, out, _ = lint(capsys, "--format", "json", str(target))
    assert code == 1
    assert [(v["code"], v["line"]) for v in json.loads(out)["violations"]] == [("AMP113", 3)]


def test_cli_lint_select_and_ignore_filter_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path / "t.py", UNSAFE_LOAD + "scaler = torch.cuda.amp.GradScaler()\n")
    _, out, _ = lint(capsys, "--select", "AMP113", str(tmp_path))
    assert [line.split()[1] for line in out.splitlines()] == ["AMP113"]
    _, out, _ = lint(capsys, "--ignore", "AMP113", str(tmp_path))
    assert [line.split()[1] for line in out.splitlines()] == ["AMP101"]
    _, out, _ = lint(capsys, "--select", "AMP10", str(tmp_path))  # a prefix: AMP101..AMP109
    assert [line.split()[1] for line in out.splitlines()] == ["AMP101"]
    code, out, _ = lint(capsys, "--select", "AMP101", "--ignore", "AMP101", str(tmp_path))
    assert (code, out) == (0, "")


def test_cli_lint_reports_syntax_error_and_lints_the_rest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path / "a_broken.py", "def f(:\n    pass\n")
    write(tmp_path / "b_train.py", UNSAFE_LOAD)
    code, out, _ = lint(capsys, "--select", "AMP113", str(tmp_path))
    lines = out.splitlines()
    assert code == 1
    assert lines[0].startswith(f"{tmp_path / 'a_broken.py'}:1:7: AMP000 syntax error:")
    assert lines[1].startswith(f"{tmp_path / 'b_train.py'}:2:9: AMP113")
    assert len(lines) == 2


def test_cli_lint_skips_virtualenvs_caches_and_excluded_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for skipped in (".venv/lib/x.py", "venv/x.py", "env/lib/site-packages/pkg/x.py", "myenv/bin/x.py",
                    ".git/hooks/x.py", "__pycache__/x.py", "build/gen/x.py", "src/schema_pb2.py"):
        write(tmp_path / skipped, UNSAFE_LOAD)
    write(tmp_path / "myenv" / "pyvenv.cfg", "home = /usr/bin\n")
    write(tmp_path / "src" / "train.py", UNSAFE_LOAD)
    write(tmp_path / "src" / "notes.txt", UNSAFE_LOAD)
    code, out, _ = lint(capsys, "--exclude", "build/", "--exclude", "*_pb2.py", str(tmp_path))
    assert code == 1
    assert [line.split(":")[0] for line in out.splitlines()] == [str(tmp_path / "src" / "train.py")]


def test_cli_lint_explicit_file_is_linted_whatever_its_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = write(tmp_path / "train_script", UNSAFE_LOAD)  # no .py suffix, named on the command line
    assert lint(capsys, str(script))[0] == 1


def test_cli_lint_runs_as_a_subprocess(tmp_path: Path) -> None:
    # One real process (each one imports torch, seconds apiece); exit codes 0 and 2 are covered in-process.
    bad = write(tmp_path / "bad.py", UNSAFE_LOAD)
    good = write(tmp_path / "good.py", CLEAN)
    command = [sys.executable, "-m", "ampkit.cli.main", "lint", "--format", "json", str(good), str(bad)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert [v["path"] for v in json.loads(result.stdout)["violations"]] == [str(bad)]


def test_cli_lint_pre_commit_hook_entry_runs(tmp_path: Path) -> None:
    hooks = (Path(__file__).parents[2] / ".pre-commit-hooks.yaml").read_text()
    assert re.search(r"^- id: ampkit-lint$", hooks, re.MULTILINE)
    assert re.search(r"^  types: \[python\]$", hooks, re.MULTILINE)
    entry = re.search(r"^  entry: (.+)$", hooks, re.MULTILINE)
    assert entry is not None and entry.group(1).split() == ["ampkit", "lint"]
    # pre-commit appends the staged file names to the entry; run it the same way.
    executable = Path(sys.executable).with_name("ampkit")
    bad = write(tmp_path / "bad.py", DEPRECATED)
    result = subprocess.run([str(executable), "lint", str(bad)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "AMP101" in result.stdout


def test_lint_fix_on_a_read_only_file_exits_2_names_it_and_leaves_it_unchanged(tmp_path: Path) -> None:
    source = "import torch\nscaler = torch.cuda.amp.GradScaler()\n"
    target = tmp_path / "train.py"
    target.write_text(source)
    result = run_after_mounting(read_only(tmp_path), [sys.executable, "-m", "ampkit.cli.main", "lint", "--fix",
                                                       str(target)])
    assert result.returncode == 2, result.stderr
    assert f"could not write the fix, the file is unchanged: {target}: " in result.stderr
    assert "read-only file system" in result.stderr and "Traceback" not in result.stderr
    assert "AMP101" in result.stdout  # the violation is still reported
    assert target.read_text() == source
