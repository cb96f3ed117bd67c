"""load_task: built-in names, files, modules, and the errors for each way a reference can be wrong."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import ampkit
from ampkit.tasks import TaskBase, TaskLoadError, load_task
from tests.verify.verify_helpers import SYNTHETIC


def test_load_task_builtin_names_resolve_to_instances() -> None:
    task = load_task("tinygpt")
    assert isinstance(task, ampkit.Task) and task.name == "tinygpt"
    assert task.metrics == {"bits_per_byte": "lower"}
    assert task.tokens_per_batch == task.samples_per_batch * 256


def test_load_task_file_with_attribute_instantiates_the_class() -> None:
    task = load_task(f"{SYNTHETIC}:Fp16Overflow")
    assert task.name == "fp16-overflow" and task.metrics == {"mse": "lower"}


def test_load_task_file_without_attribute_uses_its_task_variable() -> None:
    assert load_task(str(SYNTHETIC)).name == "regression"


def test_load_task_relative_file_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(SYNTHETIC.parent.parent)
    assert load_task(f"verify/{SYNTHETIC.name}:Slow").name == "slow"


def test_load_task_module_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "mytasks"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "pick.py").write_text(
        "from ampkit.tasks import TaskBase\n"
        "class Only(TaskBase):\n"
        "    name, metrics, samples_per_batch = 'only', {'acc': 'higher'}, 2\n"
        "def make():\n"
        "    return Only()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_task("mytasks.pick:make").name == "only"
    assert load_task("mytasks.pick:Only").name == "only"
    # no attribute: the module's only TaskBase subclass
    assert load_task("mytasks.pick").name == "only"
    for name in [m for m in sys.modules if m.startswith("mytasks")]:
        del sys.modules[name]


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("no-such-task", "is not a built-in task (digits, tinygpt)"),
        ("missing/dir/task.py", "does not exist"),
        (f"{SYNTHETIC}:NoSuchAttr", "has no attribute 'NoSuchAttr'"),
        (f"{SYNTHETIC}:NotATask", "is not an ampkit.Task: it lacks metrics, samples_per_batch"),
        (f"{SYNTHETIC}:", "ends with ':'"),
        ("surely_not_a_module_xyz:task", "module 'surely_not_a_module_xyz' was not found"),
        ("", "an empty task reference"),
    ],
)
def test_load_task_bad_reference_says_what_was_looked_for(ref: str, expected: str) -> None:
    with pytest.raises(TaskLoadError) as info:
        load_task(ref)
    assert expected in str(info.value)


def test_load_task_file_that_raises_reports_the_exception(tmp_path: Path) -> None:
    bad = tmp_path / "broken.py"
    bad.write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(TaskLoadError, match="raised RuntimeError: boom at import"):
        load_task(str(bad))


def test_load_task_rejects_invalid_metric_direction(tmp_path: Path) -> None:
    f = tmp_path / "dirs.py"
    f.write_text(
        "from ampkit.tasks import TaskBase\n"
        "class T(TaskBase):\n"
        "    name, metrics, samples_per_batch = 't', {'acc': 'up'}, 2\n"
        "task = T()\n"
    )
    with pytest.raises(TaskLoadError, match="must map a name to 'higher' or 'lower'"):
        load_task(str(f))


def test_load_task_module_with_several_tasks_asks_for_one(tmp_path: Path) -> None:
    f = tmp_path / "two.py"
    f.write_text(
        "from ampkit.tasks import TaskBase\n"
        "class A(TaskBase):\n    name, metrics = 'a', {'m': 'lower'}\n"
        "class B(TaskBase):\n    name, metrics = 'b', {'m': 'lower'}\n"
    )
    with pytest.raises(TaskLoadError, match=r"defines several tasks \(A, B\)"):
        load_task(str(f))


def test_task_base_is_the_exported_helper() -> None:
    assert ampkit.TaskBase is TaskBase and "Task" in ampkit.__all__
