"""The import contract: docs/design.md's package map is the order of the layers, and the code follows it. Every
module of the two packages is in exactly one row, and a module imports only from its own row and the rows above
it. Read from the source (``ast``), so that an import inside a function counts too."""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"daemon": "daemon", "trainer": "trainer"}  # module prefix (under tfelastic) -> directory
TYPING_ONLY = "TYPE_CHECKING"


def read_layers(design: str) -> list[list[str]]:
    """The package map's rows, lowest first: each a list of module names or patterns (``daemon.rpc.*``)."""
    section = design.split("## Package map", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`" in line.split("|")[2]]
    return [re.findall(r"`([\w.*]+)`", row.split("|")[2]) for row in rows]


def modules_of(root: Path) -> dict[str, Path]:
    found = {}
    for prefix, directory in PACKAGES.items():
        for path in (root / directory).rglob("*.py"):
            parts = path.relative_to(root / directory).with_suffix("").parts
            name = ".".join((prefix, *parts)).removesuffix(".__init__")
            found[name] = path
    return found


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The modules of ours that ``path`` imports at run time (``if TYPE_CHECKING:`` blocks left out): ``from
    PACKAGE import MODULE`` imports MODULE, not PACKAGE."""
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", "") == TYPING_ONLY for node in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tfelastic."):
            base = node.module.removeprefix("tfelastic.")
            submodules = {f"{base}.{alias.name}" for alias in node.names} & modules
            found |= submodules or {base}
        elif isinstance(node, ast.Import):
            found |= {alias.name.removeprefix("tfelastic.") for alias in node.names
                      if alias.name.startswith("tfelastic.")}
    return found & modules


def layer_of(module: str, layers: list[list[str]]) -> list[int]:
    return [i for i, row in enumerate(layers) if any(fnmatch.fnmatchcase(module, pattern) for pattern in row)]


def contract_problems(graph: dict[str, set[str]], layers: list[list[str]]) -> list[str]:
    """Modules in no row or in several, and imports from a row below the importer's."""
    problems = []
    for module in sorted(graph):
        rows = layer_of(module, layers)
        if len(rows) != 1:
            problems.append(f"{module} is in {len(rows)} rows of the package map, not 1")
    for module, imported in sorted(graph.items()):
        row = min(layer_of(module, layers), default=-1)
        for target in sorted(imported):
            target_row = max(layer_of(target, layers), default=-1)
            if target_row > row >= 0:
                problems.append(f"{module} (row {row + 1}) imports {target} (row {target_row + 1}, below it)")
    return problems


def repository_graph() -> dict[str, set[str]]:
    modules = modules_of(ROOT)
    return {name: imports_of(path, set(modules)) for name, path in modules.items()}


def test_the_code_follows_the_package_map() -> None:
    layers = read_layers((ROOT / "docs" / "design.md").read_text())
    assert len(layers) > 10, "the package map's table was not found in docs/design.md"
    assert contract_problems(repository_graph(), layers) == []


def test_the_trainer_never_imports_the_daemon() -> None:
    graph = repository_graph()
    assert {m: sorted(i) for m, i in graph.items() if m.startswith("trainer") and
            any(t.startswith("daemon") for t in i)} == {}


@pytest.mark.parametrize(("graph", "expected"), [
    ({"a": {"b"}, "b": set()}, []),
    ({"a": set(), "b": {"a"}}, ["b (row 1) imports a (row 2, below it)"]),
    ({"a": {"a2"}, "a2": set(), "b": set()}, []),
], ids=["from-the-row-above", "from-the-row-below", "within-a-row"])
def test_the_checker_finds_an_import_from_a_row_below(graph: dict[str, set[str]], expected: list[str]) -> None:
    layers = [["b"], ["a", "a2"]]  # the table's first row is the lowest layer
    assert contract_problems(graph, layers) == expected


def test_the_checker_finds_a_module_in_no_row_and_one_in_two() -> None:
    assert contract_problems({"x": set(), "y": set()}, [["x", "y"], ["y"]]) == [
        "y is in 2 rows of the package map, not 1"]
    assert contract_problems({"new": set()}, [["old"]]) == ["new is in 0 rows of the package map, not 1"]


def test_an_import_under_type_checking_and_from_a_package_count_as_they_should(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nfrom tfelastic.daemon import api\n"
                      "import tfelastic.daemon.errors\nif TYPE_CHECKING:\n    from tfelastic.daemon.state import S\n"
                      "def f():\n    from tfelastic.daemon.late import g\n")
    modules = {"daemon", "daemon.api", "daemon.errors", "daemon.state", "daemon.late"}
    assert imports_of(source, modules) == {"daemon.api", "daemon.errors", "daemon.late"}
