"""Whether a training step that a peer's failure interrupted left this worker's variables exactly as the last
completed step left them: read from the step's graph, by the collective that failed.

A step under MultiWorkerMirroredStrategy exchanges with its peers in collectives, which TensorFlow runs one after
another (its ordering tokens). An update of a variable waits for the collectives its value depends on (the
gradients' all-reduce) and for nothing else; a collective after them (``fit``'s metrics and logs) can fail while
the updates run, and leave some variables one step ahead of the others. So the state is one step's when the
collective that failed is one that *every* update of the variables waits for: then no update ran. TensorFlow's
error names it and its function (``{{node NAME}}``, ``[Op:__inference_NAME]``); which ones every update waits
for is read from the function's graph.

Invariant: anything this module cannot read (no node named, updates inside a nested function, such as a loop of
``steps_per_execution`` or an XLA cluster, no update found) answers "not known to be one step's": the caller then
falls back to the newest snapshot.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

_FAILED_NODE = re.compile(r"\{\{node ([^}]+)\}\}")
_FAILED_FUNCTION = re.compile(r"\[Op:(__inference_[A-Za-z0-9_]+)\]")
_UPDATES = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp", "ResourceApply", "ResourceSparseApply",
            "ResourceScatter")
_PASS_THROUGH = ("Identity", "IdentityN")


def failed_node(error: BaseException) -> str | None:
    """The node TensorFlow names as the one that failed (its first), None when the error names none."""
    found = _FAILED_NODE.findall(str(error))
    return found[0] if found else None


def exchanges_every_update_waits_for(graph: Any, variables: Iterable[Any]) -> frozenset[str]:
    """The names of the collectives in ``graph`` (a traced step's FuncGraph) that every update of one of
    ``variables`` waits for, through its inputs and control inputs; empty when no such update is found in it."""
    handles = {id(_handle(v)) for v in variables}
    captured = {internal.op.name for external, internal in graph.captures if id(external) in handles}
    updates = [op for op in graph.get_operations()
               if op.type.startswith(_UPDATES) and op.inputs and _source(op.inputs[0]).op.name in captured]
    if not updates:
        return frozenset()
    common: set[str] | None = None
    for update in updates:
        waited = {op.name for op in _upstream(update) if op.type.startswith("Collective")}
        common = waited if common is None else common & waited
    return frozenset(common or ())


def failed_function(error: BaseException) -> str | None:
    """The traced function TensorFlow names as the one whose run failed ("__inference_train_step_1208")."""
    found = _FAILED_FUNCTION.findall(str(error))
    return found[-1] if found else None


def interrupted_before_any_update(error: BaseException, function: Any, variables: Iterable[Any]) -> bool:
    """Whether ``error`` was raised by a run of ``function`` (a concrete function: a traced step) and failed in
    a collective that every update of ``variables`` waits for: then no update of them ran."""
    node, name = failed_node(error), failed_function(error)
    return node is not None and name is not None and name == _name(function) and \
        node in exchanges_every_update_waits_for(function.graph, variables)


def _name(function: Any) -> str:
    name = function.name
    return name.decode() if isinstance(name, bytes) else str(name)


def _handle(variable: Any) -> Any:
    """The resource handle a step's graph captures for ``variable`` (a distributed variable's local copy)."""
    local = getattr(variable, "_get_on_device_or_primary", None)
    return (local() if local is not None else variable).handle


def _source(tensor: Any) -> Any:
    while tensor.op.type in _PASS_THROUGH and tensor.op.inputs:
        tensor = tensor.op.inputs[tensor.value_index if tensor.op.type == "IdentityN" else 0]
    return tensor


def _upstream(op: Any) -> list[Any]:
    """Every op that ``op`` waits for, through data and control edges."""
    seen: dict[str, Any] = {}
    stack = [op]
    while stack:
        current = stack.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent.name not in seen:
                seen[parent.name] = parent
                stack.append(parent)
    return list(seen.values())
