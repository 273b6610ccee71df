"""Static checks of the code's contract that no single behaviour test would catch, read from the source (``ast``):
every display limit on text from the network is a named bound of ``rendezvous/bounds.py``, and the agent's shells
call into its core only through inputs (methods that return actions, or that hand it a reading)."""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

from tfelastic.daemon.agent.api import Action
from tfelastic.daemon.agent.core import AgentCore

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for folder in ("daemon", "trainer") for p in (ROOT / folder).rglob("*.py"))


def _calls_named(tree: ast.AST, name: str) -> list[ast.Call]:
    def called(node: ast.Call) -> str:
        f = node.func
        return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""

    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and called(node) == name]


def literal_limits(source: str) -> list[int]:
    """The lines where ``printable(text, <a number>)`` is called: its limit written as a literal."""
    return [call.lineno for call in _calls_named(ast.parse(source), "printable")
            if len(call.args) > 1 and isinstance(call.args[1], ast.Constant)]


def test_the_check_finds_a_literal_limit() -> None:
    assert literal_limits("printable(reason, 200)\nbounds.printable(x, MAX)\nbounds.printable(y, 80)\n") == [1, 3]


def test_every_display_limit_is_a_named_bound() -> None:
    offenders = [f"{path.relative_to(ROOT)}:{line}" for path in SOURCES for line in literal_limits(path.read_text())]
    assert offenders == [], "name the limit in daemon/rendezvous/bounds.py: " + ", ".join(offenders)


SHELLS = [ROOT / "daemon" / "agent" / "agent.py", ROOT / "daemon" / "agent" / "worker_shell.py"]
CORE_NAMES = {"core", "_core"}  # how the shells hold the core (self.core, self._core)
# Inputs that hand the core a reading or an outcome and return nothing to carry out.
READINGS = {"node_read", "gpus_released", "refused"}
# For an operator's SIGUSR1 log line: a description, not a decision.
DESCRIPTIONS = {"describe"}


def core_reads(source: str) -> list[tuple[int, str]]:
    """Every ``self.core.X`` / ``self._core.X`` in ``source``: (line, X)."""
    return sorted((node.lineno, node.attr) for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                  and node.value.attr in CORE_NAMES and isinstance(node.value.value, ast.Name)
                  and node.value.value.id == "self")


def is_input(name: str) -> bool:
    """A method of the core that returns the actions to carry out."""
    member = inspect.getattr_static(AgentCore, name, None)
    if not inspect.isfunction(member):
        return False  # a property or an attribute: a predicate the shell would branch on
    return typing.get_type_hints(member).get("return") == list[Action]


def predicate_reads(source: str) -> list[str]:
    return [f"{line}: {name}" for line, name in core_reads(source)
            if not is_input(name) and name not in READINGS | DESCRIPTIONS]


def test_the_check_finds_a_predicate_read_and_passes_inputs() -> None:
    source = ("class Shell:\n    def f(self):\n        self._apply(self.core.tick())\n"
              "        if self.core.check_owed:\n            self.core.node_read(gpus=(0, 0.0))\n"
              "        self._core.worker.state\n        other.core.anything\n")
    assert predicate_reads(source) == ["4: check_owed", "6: worker"]


def test_the_shells_read_no_predicate_of_the_core() -> None:
    offenders = [f"{path.relative_to(ROOT)}:{read}" for path in SHELLS for read in predicate_reads(path.read_text())]
    assert offenders == [], "return an action from the core instead: " + ", ".join(offenders)


def others_private_reads(source: str) -> list[str]:
    """Every ``X._y`` in ``source`` where X is not ``self`` or ``cls``: a private member of another object (a
    collaborator's, ``self.worker_core._stopping``; another instance's, ``node._lease``), used from outside it. The
    standard library's few (``os._exit``) are allowed."""
    return sorted(f"{node.lineno}: {ast.unparse(node)}" for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                  and not (isinstance(node.value, ast.Name) and node.value.id in {"self", "cls", *STDLIB_PRIVATE}))


STDLIB_PRIVATE = {"os", "runpy", "sys"}  # os._exit, runpy._run_module_as_main, sys._getframe


def test_the_check_finds_a_collaborators_private_member() -> None:
    source = ("class Core:\n    def f(self, node):\n        self.worker_core._stopping\n        self._contact.open\n"
              "        node._lease\n        os._exit(0)\n")
    assert others_private_reads(source) == ["3: self.worker_core._stopping", "5: node._lease"]


def logic_modules() -> list[Path]:
    """The modules of docs/design.md's pure layers (kind ``logic``): the cores and what they are made of."""
    from tests.unit.test_layers import layer_of, modules_of, read_map

    layers = read_map((ROOT / "docs" / "design.md").read_text())
    logic = [i for i, (_, kind, _) in enumerate(layers) if kind == "logic"]
    rows = [modules for _, _, modules in layers]
    return sorted(path for name, path in modules_of(ROOT).items() if set(layer_of(name, rows)) & set(logic))


def test_no_core_uses_another_objects_private_member() -> None:
    modules = logic_modules()
    assert ROOT / "daemon" / "rendezvous" / "rounds.py" in modules and ROOT / "daemon" / "agent" / "core.py" in modules
    offenders = [f"{path.relative_to(ROOT)}:{read}" for path in modules
                 for read in others_private_reads(path.read_text())]
    assert offenders == [], "give the collaborator a public method instead: " + ", ".join(offenders)


def test_the_cores_are_composed_of_collaborators_not_classes_split_by_inheritance() -> None:
    """The agent's core holds the worker's side, the coordinator's holds its rounds: each a plain class."""
    from tfelastic.daemon.agent.worker_core import WorkerCore
    from tfelastic.daemon.rendezvous.rounds import Rounds
    from tfelastic.daemon.rendezvous.state import Rendezvous

    cores = (AgentCore, WorkerCore, Rendezvous, Rounds)
    assert {core.__name__: core.__bases__ for core in cores} == {core.__name__: (object,) for core in cores}
