"""Static checks of the code's contract that no single behaviour test would catch, read from the source (``ast``):
every display limit on text from the network is a named bound of ``rendezvous/bounds.py``."""

from __future__ import annotations

import ast
from pathlib import Path

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
