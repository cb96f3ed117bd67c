"""``ampkit`` dispatch: an unknown option is reported with the usage of the subcommand it followed."""

from __future__ import annotations

import pytest

from ampkit.cli.main import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    return int(exit_info.value.code or 0), capsys.readouterr().err


def test_main_unknown_flag_after_a_subcommand_prints_its_usage_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(capsys, "lint", "--bogus", "x.py")
    assert code == 2
    assert err.startswith("usage: ampkit lint ")
    assert "ampkit lint: error: unrecognized arguments: --bogus; see ampkit lint --help" in err
    assert "did you mean" not in err


def test_main_unknown_flag_suggests_the_closest_option(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(capsys, "verify", "--precisons", "bf16")
    assert code == 2 and err.startswith("usage: ampkit verify ")
    assert "unrecognized arguments: --precisons (did you mean --precisions?)" in err
    code, err = run(capsys, "env", "--jsn")
    assert code == 2 and "--jsn (did you mean --json?)" in err


def test_main_script_arguments_after_the_doctor_target_are_not_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    # Everything after the script belongs to the script; only options before it are checked.
    code, err = run(capsys, "doctor", "--jsno", "out.json", "train.py", "--epochs", "3")
    assert code == 2 and "unrecognized arguments: --jsno (did you mean --json?)" in err
    assert "--epochs" not in err.splitlines()[-1]


def test_closed_stdout_is_bad_input_not_a_traceback(tmp_path) -> None:
    import subprocess
    import sys

    script = tmp_path / "ok.py"
    script.write_text("x = 1\n")
    proc = subprocess.run([sys.executable, "-m", "ampkit.cli.main", "lint", str(script)], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, close_fds=True,
                          preexec_fn=lambda: __import__("os").close(1))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "standard output is closed; redirect it to a file or to /dev/null" in proc.stderr


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write, as `ampkit env | head -0`
    proc = subprocess.run([sys.executable, "-m", "ampkit.cli.main", "env", "--no-measure"], stdout=write_end,
                          stderr=subprocess.PIPE, text=True)
    os.close(write_end)
    assert proc.returncode == 141 and "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr
