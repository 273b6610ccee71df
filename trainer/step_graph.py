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
# Ops that run a function of their own (tf.cond, tf.while_loop, a call, an XLA cluster): a variable handed to one
# may be updated there, unread here.
_NESTED = ("If", "While", "Case", "PartitionedCall", "XlaLaunch", "XlaCompile")


def failed_node(error: BaseException) -> str | None:
    """The node TensorFlow names as the one that failed (its first), None when the error names none."""
    found = _FAILED_NODE.findall(str(error))
    return found[0] if found else None


def exchanges_every_update_waits_for(graph: Any, variables: Iterable[Any]) -> frozenset[str]:
    """The names of the collectives in ``graph`` (a traced step's FuncGraph) that every update of one of
    ``variables`` waits for, through its inputs and control inputs; empty when no such update is found in it, or
    when one of the variables is handed to a nested function (a loop, a condition, a call): what it does there is
    not read. One pass over the graph, whatever its size."""
    handles = {id(_handle(v)) for v in variables}
    captured = {internal.op.name for external, internal in graph.captures if id(external) in handles}
    operations = graph.get_operations()
    takes_a_variable = [op for op in operations if any(_source(t).op.name in captured for t in op.inputs)]
    if any(op.type.endswith(_NESTED) for op in takes_a_variable):
        return frozenset()
    updates = [op for op in takes_a_variable if op.type.startswith(_UPDATES)]
    if not updates:
        return frozenset()
    collectives = sorted({op.name for op in operations if op.type.startswith("Collective")})
    bit = {name: 1 << i for i, name in enumerate(collectives)}
    waits = _waits(operations, bit)
    common = ~0
    for update in updates:
        common &= waits[update.name]
    return frozenset(name for name in collectives if common & bit[name])


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


def _waits(operations: Iterable[Any], bit: dict[str, int]) -> dict[str, int]:
    """For every op, the collectives it waits for (a bit per collective), through its input and control edges to
    the graph's start: a depth-first walk, each op finished after the ops it waits for."""
    waits: dict[str, int] = {}
    for root in operations:
        if root.name in waits:
            continue
        stack: list[tuple[Any, bool]] = [(root, False)]
        while stack:
            op, parents_done = stack.pop()
            if op.name in waits:
                continue
            parents = [t.op for t in op.inputs] + list(op.control_inputs)
            if not parents_done:
                stack.append((op, True))
                stack.extend((parent, False) for parent in parents if parent.name not in waits)
                continue
            mask = 0
            for parent in parents:
                mask |= waits.get(parent.name, 0) | bit.get(parent.name, 0)
            waits[op.name] = mask
    return waits
