"""The survivors' save (trainer/survivors.py, trainer/step_graph.py) with real TensorFlow.

Which collectives of a step every update waits for, read from traced graphs (one subprocess for every case); and
a 2-worker mirrored job whose rank 0 is SIGKILLed at a random moment of a step: rank 1 saves the step it holds,
and a new process restores exactly that state, bit for bit against the checksum rank 1 took of it right after
the step, with the position in the data that goes with it. ``bench/survivors.py`` repeats the kill many times.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tfelastic.daemon.worker.process import PEER_FAILED_SIGNAL, PEER_FAILED_SIGNAL_ENV

from tests.cluster import ROOT, TF_DEADLINE, wait_for
from tests.workers import WorkerSet, run_script_report, worker_env

pytestmark = [pytest.mark.integration, pytest.mark.tensorflow]

SURVIVOR = ROOT / "tests" / "trainers" / "survivor.py"
STEPS_PER_EPOCH_FIT = 7  # tests/trainers/survivor.py
GLOBAL_BATCH = 64

GRAPHS = """
    import json
    import tensorflow as tf
    from tfelastic.trainer import step_graph

    a, b = tf.Variable(tf.ones([4])), tf.Variable(tf.ones([4]))
    counter = tf.Variable(0, dtype=tf.int64)

    def exchange(x, key):
        return tf.raw_ops.CollectiveReduceV2(input=x, group_size=tf.constant(2), group_key=tf.constant(1),
                                             instance_key=tf.constant(key), ordering_token=[], merge_op="Add",
                                             final_op="Id")

    @tf.function
    def one_exchange(x):  # TrainLoop's step: one all-reduce, and every update waits for it
        summed = exchange(x, 1)
        a.assign_sub(summed)
        b.assign_sub(summed)
        counter.assign_add(1)  # waits for nothing, as tf_keras's step counter
        return summed

    @tf.function
    def later_exchange(x):  # fit's step: the logs' all-reduce comes after, b's update waits for it, a's not
        a.assign_sub(exchange(x, 1))
        b.assign_sub(exchange(x, 2))
        return x

    @tf.function
    def in_a_loop(x):  # steps_per_execution: the updates are in the loop's own function
        def body(i):
            a.assign_sub(exchange(x, 1))
            return i + 1
        return tf.while_loop(lambda i: i < 2, body, [tf.constant(0)])

    def error(node, function):
        return tf.errors.UnavailableError(None, None, "Graph execution error:\\n\\nCollective ops is aborted by: "
                                          f"Socket closed\\n\\t [[{{{{node {node}}}}}]] [Op:{function}]")

    x = tf.ones([4])
    report = {}
    for fn in (one_exchange, later_exchange, in_a_loop):
        traced = fn.get_concrete_function(x)
        name = traced.name.decode()
        waited = step_graph.exchanges_every_update_waits_for(traced.graph, [a, b])
        collectives = sorted(op.name for op in traced.graph.get_operations() if op.type.startswith("Collective"))
        report[fn.__name__] = {
            "waited": sorted(waited), "collectives": collectives,
            "clean": {node: step_graph.interrupted_before_any_update(error(node, name), traced, [a, b])
                      for node in sorted({"CollectiveReduceV2", *collectives})},
            "another_function": step_graph.interrupted_before_any_update(
                error("CollectiveReduceV2", "__inference_agreed_interval_7"), traced, [a, b]),
            "no_node": step_graph.interrupted_before_any_update(
                tf.errors.UnavailableError(None, None, "Socket closed"), traced, [a, b]),
        }
    print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def graphs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_script_report(GRAPHS, tmp_path_factory.mktemp("graphs"))


def test_a_step_with_one_exchange_is_clean_wherever_it_fails(graphs: dict[str, Any]) -> None:
    case = graphs["one_exchange"]
    assert case["waited"] == case["collectives"] == ["CollectiveReduceV2"]
    assert case["clean"] == {"CollectiveReduceV2": True}


def test_an_exchange_that_not_every_update_waits_for_is_not_clean(graphs: dict[str, Any]) -> None:
    case = graphs["later_exchange"]
    assert case["collectives"] == ["CollectiveReduceV2", "CollectiveReduceV2_1"]
    # a's update may have run when the second exchange failed: the state may be half a step ahead
    assert case["clean"] == {"CollectiveReduceV2": True, "CollectiveReduceV2_1": False}


def test_what_the_graph_does_not_show_is_not_clean(graphs: dict[str, Any]) -> None:
    assert graphs["in_a_loop"]["waited"] == []  # the updates are in the loop's body, a function of its own
    assert graphs["in_a_loop"]["clean"] == {"CollectiveReduceV2": False}
    for case in ("one_exchange", "later_exchange"):
        assert graphs[case]["another_function"] is False  # the same node name in another function's graph
        assert graphs[case]["no_node"] is False


def chain_of(path: Path) -> tuple[dict[int, str], dict[str, Any]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return {line["step"]: line["checksum"] for line in lines if "step" in line}, lines[-1]


def killed_job(tmp_path: Path, style: str, kill_seconds: float) -> tuple[dict[int, str], dict[str, Any], str]:
    store, chain = tmp_path / "store", tmp_path / "chain.jsonl"
    workers = WorkerSet(tmp_path, [sys.executable, str(SURVIVOR), "train", style, str(store), str(kill_seconds),
                                   str(chain)]).start()
    codes = workers.wait(240)
    assert codes[0] == -9 and codes[1] == 1, workers.logs()
    steps, last = chain_of(chain)
    return steps, last, workers.logs()


def restored(tmp_path: Path, style: str) -> dict[str, Any]:
    result = subprocess.run([sys.executable, str(SURVIVOR), "restore", style, str(tmp_path / "store")],
                            capture_output=True, text=True, timeout=240, cwd=tmp_path, env=worker_env())
    assert result.returncode == 0, result.stderr[-3000:]
    report: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return report


@pytest.mark.parametrize("style", ["loop", "fit"])
def test_a_survivor_saves_the_step_it_holds_and_a_new_process_restores_it_bit_for_bit(
        tmp_path: Path, style: str) -> None:
    kill_seconds = random.Random(style).uniform(0.8, 1.6)  # some steps in, at any point of a step
    steps, last, logs = killed_job(tmp_path, style, kill_seconds)
    assert last["failed"] == "UnavailableError", logs
    held = max(steps)
    if style == "fit" and not last["survivors"]:
        # The peer died after this step's gradients were exchanged: fit's metrics and logs, exchanged next, failed
        # while the updates ran, so nothing is saved, and the next generation restores the newest snapshot.
        assert "the collective that failed is not one that every update waits for" in logs, logs
        return
    assert last["survivors"] == [f"step-{held:012d}"], (last, logs)
    back = restored(tmp_path, style)
    assert (back["step"], back["tier"], back["iterations"]) == (held, "survivors", held), back
    assert back["checksum"] == steps[held], (back, steps)  # every variable, the optimizer's slots included
    if style == "loop":
        assert (back["epoch"], back["examples_done"]) == (0, held * GLOBAL_BATCH), back
    else:  # the last batch completed: fit resumes after it
        assert (back["epoch"], back["batch"]) == divmod(held - 1, STEPS_PER_EPOCH_FIT), back


@pytest.mark.parametrize("style", ["loop", "fit"])
def test_the_agents_word_ends_a_wait_for_a_peer_and_the_step_held_is_saved(tmp_path: Path, style: str) -> None:
    """Rank 1 sleeps after step 3: rank 0 waits in step 4's all-reduce with no call in flight that could fail, as
    for a peer whose death it has not seen. SIGUSR1, what its agent sends, aborts the wait, and rank 0 saves."""
    store, chain = tmp_path / "store", tmp_path / "chain.jsonl"
    workers = WorkerSet(tmp_path, [sys.executable, str(SURVIVOR), "stall", style, str(store), "3", str(chain)],
                        env={PEER_FAILED_SIGNAL_ENV: str(int(PEER_FAILED_SIGNAL))}).start()
    try:
        wait_for(lambda: chain.exists() and '"step": 3' in chain.read_text(), TF_DEADLINE, "rank 0 at step 3",
                 interval=0.1)
        survivor = workers.workers[0].proc
        os.kill(survivor.pid, PEER_FAILED_SIGNAL)
        assert survivor.wait(60) == 1, workers.logs()
    finally:
        workers.kill()
    steps, last = chain_of(chain)
    assert last == {"failed": "UnavailableError", "survivors": ["step-000000000003"]}, workers.logs()
    assert "the agent says a peer failed" in workers.workers[0].output()
    back = restored(tmp_path, style)
    assert (back["step"], back["tier"], back["checksum"]) == (3, "survivors", steps[3]), back
