"""The house rules of docs/architecture.md: import-linter's contracts hold and can fail, and
modules and functions stay small enough to read in one sitting."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipelines", "flows", "refcell", "edge")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
# A function may stay longer only where splitting it would hurt reading; its first lines say so.
LONG_ON_PURPOSE = "# Long on purpose:"


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(tree)}  # the copy's packages, not the installed ones
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=tree, env=env, capture_output=True, text=True
    )


@pytest.fixture
def tree_copy(tmp_path: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def test_the_contracts_hold_on_this_tree(tree_copy: Path):
    result = lint_imports(tree_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("pipelines/contract/schema.py", "import prefect", "no orchestrator"),
        ("pipelines/ingest/store.py", "import refcell.cell", "no orchestrator"),
        ("edge/agent.py", "import pipelines.contract", "installs alone"),
        ("pipelines/ingest/sources.py", "import pipelines.training", "a later stage"),
        ("pipelines/quality/drift/report.py", "import pipelines.calibrate", "a later stage"),
        ("refcell/world.py", "import flows.cli", "flows -> refcell"),
        ("flows/loop.py", "import refcell.world", "only through storage"),
        ("flows/ingest.py", "import flows.cell", "only through storage"),
        ("pipelines/ingest/decoded.py", "import pipelines.ingest.store", "No import cycles"),
    ],
)
def test_a_change_that_breaks_a_contract_fails(tree_copy: Path, module, line, contract):
    with (tree_copy / module).open("a") as source:
        source.write(f"\n{line}  # noqa\n")
    result = lint_imports(tree_copy)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout
    broken = [row for row in result.stdout.splitlines() if row.endswith(" BROKEN")]
    assert any(contract in row for row in broken), result.stdout


def test_every_orchestrator_module_is_held_to_the_storage_boundary():
    """A new flows module must be listed in the boundary contract (or be a cell command)."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    boundary = next(c for c in contracts["contracts"] if "only through storage" in c["name"])
    modules = {f"flows.{path.stem}" for path in (ROOT / "flows").glob("*.py")}
    cell_side = {"flows.__init__", "flows.cell", "flows.cli"}
    assert modules - cell_side == set(boundary["source_modules"])


def python_files():
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def test_no_module_is_longer_than_a_sitting():
    long = {
        str(path.relative_to(ROOT)): n
        for path in python_files()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def long_functions(path: Path):
    source = path.read_text()
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        length = node.end_lineno - node.lineno + 1
        head = "\n".join(lines[node.lineno - 1 : node.lineno + 5])
        if length > MAX_FUNCTION_LINES and LONG_ON_PURPOSE not in head:
            yield f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)"


def test_functions_are_small_or_say_why_not():
    long = [row for path in python_files() for row in long_functions(path)]
    assert not long, "split into named steps, or say why not in a comment:\n" + "\n".join(long)
