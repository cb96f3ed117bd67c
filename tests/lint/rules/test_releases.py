"""``ampkit.lint.rules.releases``: which torch releases reach a line (used by AMP110 and AMP113)."""

from __future__ import annotations

import ast

import pytest

from ampkit.lint.rules.releases import implies_older

from . import hits


def _older(test: str, negated: bool = False) -> tuple[int, ...] | None:
    return implies_older(ast.parse(test, mode="eval").body, negated)


@pytest.mark.parametrize(("test", "negated", "bound"), [
    ("torch.__version__ < '1.13'", False, (1, 13)),
    ("version.parse(torch.__version__) >= version.parse('2.4')", True, (2, 4)),
    ("(2, 4) > TORCH_VERSION", False, (2, 4)),
    ("TORCH_VERSION <= (1, 12)", False, (1, 12, 1)),
    ("not TORCH_GE_1_13", False, (1, 13)),
    ("_TORCH_LESS_2_0", False, (2, 0)),
    ("TORCH_VERSION != 'parrots' and digit_version(TORCH_VERSION) < digit_version('1.7.0')", False, (1, 7, 0)),
    ("hasattr(torch.serialization, 'add_safe_globals')", True, ()),
])
def test_releases_check_holding_only_on_old_torch_gives_its_bound(test: str, negated: bool,
                                                                  bound: tuple[int, ...]) -> None:
    assert _older(test, negated) == bound


@pytest.mark.parametrize(("test", "negated"), [
    ("TORCH_GE_1_13", False),                          # true on new releases
    ("not _TORCH_GREATER_EQUAL_2_3", True),            # the code after `if not GE: raise`
    ("version != ARCHIVE_VERSION", False),             # a file format's version
    ("reader.version < (1, 2)", False),                # names no torch
    ("hasattr(self, 'fused')", True),                  # feature check on something else
    ("TORCH_VERSION == (2, 4)", False),
    ("TORCH_GE_1_13 or other", False),                 # true without an old torch
])
def test_releases_check_not_confined_to_old_torch_gives_none(test: str, negated: bool) -> None:
    assert _older(test, negated) is None


def test_releases_old_branch_above_the_argument_release_is_still_reported() -> None:
    # Below 2.0 is not below 1.13 only: weights_only exists in 1.13-1.99, so the bare load is judged.
    assert hits(
        "import torch\n"
        "def load(p):\n"
        "    if torch.__version__ < '2.0':\n"
        "        return torch.load(p)\n"
        "    return torch.load(p, weights_only=True)\n"
    ) == [(4, "AMP113")]


def test_releases_nested_old_branch_inside_a_loop_is_silent() -> None:
    assert hits(
        "import torch\n"
        "TORCH_GE_1_13 = True\n"
        "def load_all(paths):\n"
        "    out = []\n"
        "    for p in paths:\n"
        "        if TORCH_GE_1_13:\n"
        "            out.append(torch.load(p, weights_only=True))\n"
        "        else:\n"
        "            out.append(torch.load(p))\n"
        "    return out\n"
    ) == []


def _amp113_lines(root, manifest: str) -> list[int]:
    from ampkit.lint import lint_paths

    (root / "pkg").mkdir()
    name, _, content = manifest.partition(":")
    (root / name).write_text(content)
    (root / "pkg" / "train.py").write_text("import torch\n\nstate = torch.load('ckpt.pt')\n")
    return [v.line for v in lint_paths([str(root / "pkg")]).violations if v.code == "AMP113"]


@pytest.mark.parametrize("manifest", [
    'pyproject.toml:[project]\ndependencies = ["torch>=2.6", "torchvision>=0.1"]\n',
    "setup.py:install_requires = ['torch >= 2.7.0']\n",
    "requirements.txt:numpy\ntorch==2.8.0\n",
])
def test_releases_project_requiring_torch_2_6_silences_bare_load(tmp_path, manifest: str) -> None:
    # From torch 2.6 a bare torch.load is weights_only=True: a project that needs 2.6 is safe.
    assert _amp113_lines(tmp_path, manifest) == []


@pytest.mark.parametrize("manifest", [
    'pyproject.toml:[project]\ndependencies = ["torch>=2.5", "torchvision>=2.6"]\n',
    "requirements.txt:torch\n",
    "setup.cfg:[options]\ninstall_requires = pytorch-lightning>=2.6\n",
])
def test_releases_project_allowing_older_torch_keeps_bare_load(tmp_path, manifest: str) -> None:
    assert _amp113_lines(tmp_path, manifest) == [3]
