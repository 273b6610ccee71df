"""The import contract: docs/design.md's package map is the order of the layers, and the code follows it. Every
module of the two packages is in exactly one layer (a row below), a module imports only from its own layer and
the layers above it, and the daemon's layers go base, logic, I/O, so that a pure core cannot import I/O code. Read
from the source (``ast``), so that an import inside a function counts too."""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"daemon": "daemon", "trainer": "trainer"}  # module prefix (under tfelastic) -> directory
TYPING_ONLY = "TYPE_CHECKING"


LAYER = re.compile(r"^### (?P<name>.+) \((?P<kind>trainer|base|logic|I/O)\)$", re.MULTILINE)
KIND_ORDER = ("base", "logic", "I/O")  # a daemon layer of a kind sits above every layer of a later kind


def read_map(design: str) -> list[tuple[str, str, list[str]]]:
    """The package map's layers, lowest first: (name, kind, the module names or patterns, ``daemon.rpc.*``, of its
    lines ``- `module`: what it owns``)."""
    section = design.split("## Package map", 1)[1].split("\n## ", 1)[0]
    heads = list(LAYER.finditer(section))
    ends = [after.start() for after in heads[1:]] + [len(section)]
    return [(h["name"], h["kind"], re.findall(r"^- `([\w.*]+)`", section[h.end():end], re.MULTILINE))
            for h, end in zip(heads, ends, strict=True)]


def read_layers(design: str) -> list[list[str]]:
    """The package map's layers, lowest first: each a list of module names or patterns."""
    return [modules for _, _, modules in read_map(design)]


def order_problems(layers: list[tuple[str, str, list[str]]]) -> list[str]:
    """The daemon's layers out of the order base, logic, I/O: a pure layer below an I/O one could import it."""
    kinds = [(name, kind) for name, kind, _ in layers if kind != "trainer"]
    return [f"{name} ({kind}) sits below {other} ({other_kind})" for i, (name, kind) in enumerate(kinds)
            for other, other_kind in kinds[:i] if KIND_ORDER.index(other_kind) > KIND_ORDER.index(kind)]


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
            problems.append(f"{module} is in {len(rows)} layers of the package map, not 1")
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
    assert len(layers) > 10, "the package map's layers were not found in docs/design.md"
    assert contract_problems(repository_graph(), layers) == []


def test_every_logic_layer_sits_above_every_io_layer() -> None:
    layers = read_map((ROOT / "docs" / "design.md").read_text())
    assert {kind for _, kind, _ in layers} == {"trainer", *KIND_ORDER}
    assert order_problems(layers) == []


def test_the_order_check_finds_a_logic_layer_below_an_io_layer() -> None:
    layers = [("basics", "base", ["a"]), ("shells", "I/O", ["b"]), ("cores", "logic", ["c"])]
    assert order_problems(layers) == ["cores (logic) sits below shells (I/O)"]


def test_the_map_reads_each_layers_kind_and_modules() -> None:
    design = ("## Package map\n\nintro `not.a.module`\n\n### cores (logic)\n\n- `daemon.x`: owns x\n"
              "- `daemon.y.*`\n\n### shells (I/O)\n\n- `daemon.z`: owns z, see `daemon.x`\n\n## Next\n- `no`\n")
    assert read_map(design) == [("cores", "logic", ["daemon.x", "daemon.y.*"]), ("shells", "I/O", ["daemon.z"])]


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
        "y is in 2 layers of the package map, not 1"]
    assert contract_problems({"new": set()}, [["old"]]) == ["new is in 0 layers of the package map, not 1"]


def test_an_import_under_type_checking_and_from_a_package_count_as_they_should(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nfrom tfelastic.daemon import api\n"
                      "import tfelastic.daemon.errors\nif TYPE_CHECKING:\n    from tfelastic.daemon.state import S\n"
                      "def f():\n    from tfelastic.daemon.late import g\n")
    modules = {"daemon", "daemon.api", "daemon.errors", "daemon.state", "daemon.late"}
    assert imports_of(source, modules) == {"daemon.api", "daemon.errors", "daemon.late"}
