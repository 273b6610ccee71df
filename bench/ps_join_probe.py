"""Does TensorFlow let a worker join a running parameter-server job at an address fixed for the job's life?

    python -m bench.ps_join_probe [--mode late|stand-in|direct] [--join-after 20] [--run-seconds 60] [--step-ms 50]

A chief, 1 ps and 3 worker tasks on localhost, by hand (TF_CONFIG, no agents). The chief's TF_CONFIG names worker
2 at the port of a TCP relay in this process, which accepts a connection and closes it while it has no backend, as
an agent's relay with no node behind the task would. ``--join-after`` seconds after the chief's start, worker 2
starts with a TF_CONFIG of its own that names its real port (its view of its address differs from the chief's),
and the relay forwards to it from when it serves.

* ``late``: nothing serves worker 2's task before it joins: does the chief's strategy come up without it?
* ``stand-in``: a stand-in worker serves the task while the chief creates its strategy, and is killed once the
  chief is ready: is the late worker re-attached?
* ``direct``: three workers at their own addresses from the start, no relay: the reference.

Each step reads one element of a per-worker dataset that sleeps ``--step-ms`` on the worker (tf.data's
``SleepDataset``), so that the throughput follows the number of workers, not this machine's two cores. It prints
when the chief's strategy came up, its steps per second before and after worker 2 served, each task's CPU
seconds (a worker that runs steps uses some), and the bytes the relay carried.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from tfelastic.daemon.netutil import free_port

from tests.cluster import wait_for

TASK = r'''
import json, os, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
from tensorflow.python.data.experimental.ops import testing  # its sleep: TF 2.21 has no public one

config = json.loads(os.environ["TF_CONFIG"])
kind, index = config["task"]["type"], config["task"]["index"]
if kind != "chief":
    server = tf.distribute.Server(tf.train.ClusterSpec(config["cluster"]), job_name=kind, task_index=index,
                                  protocol="grpc", start=True)
    print(f"serving as {kind} {index}", flush=True)
    server.join()

began = time.monotonic()
strategy = tf.distribute.experimental.ParameterServerStrategy(
    tf.distribute.cluster_resolver.TFConfigClusterResolver())
print(json.dumps({"event": "strategy", "seconds": time.monotonic() - began}), flush=True)
coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
with strategy.scope():
    weights = tf.Variable(tf.zeros([64, 64]))

def dataset_fn():
    return tf.data.Dataset.from_tensors(tf.ones([64, 64])).repeat().apply(
        testing.sleep(int(sys.argv[1])))

iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

@tf.function
def step(it):
    def replica(x):
        weights.assign_add(tf.matmul(x, weights) * 0.0 + 1e-6)
        return tf.reduce_sum(x)
    return strategy.run(replica, args=(next(it),))

print(json.dumps({"event": "ready", "seconds": time.monotonic() - began}), flush=True)
steps, deadline = 0, time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    for _ in range(10):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    steps += 10
    print(json.dumps({"event": "steps", "steps": steps, "time": time.monotonic()}), flush=True)
print(json.dumps({"event": "done", "steps": steps}), flush=True)
'''


class Forwarder:
    """A TCP relay on a port of its own; until ``backend`` is set it accepts and closes at once."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.backend: int | None = None
        self.relayed = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self._listener.accept()
            backend = self.backend
            if backend is None:
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", backend), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
                with self._lock:
                    self.relayed += len(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


STEP_SLEEP_US = 50_000  # set by --step-ms


def start(script: Path, cluster: dict[str, list[str]], kind: str, index: int, run_seconds: float,
          log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}}),
               TF_USE_LEGACY_KERAS="1", PYTHONUNBUFFERED="1")
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, str(script), str(STEP_SLEEP_US), str(run_seconds)], env=env,
                                stdout=out, stderr=subprocess.STDOUT)


def events(log: Path) -> list[dict[str, Any]]:
    found = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                found.append(json.loads(line))
            except ValueError:
                continue
    return found


def rate(samples: list[dict[str, Any]], since: float, until: float) -> float | None:
    inside = [s for s in samples if since <= s["time"] <= until]
    if len(inside) < 2:
        return None
    return float((inside[-1]["steps"] - inside[0]["steps"]) / (inside[-1]["time"] - inside[0]["time"]))


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def cpu_seconds(proc: subprocess.Popen[bytes]) -> float:
    try:
        p = psutil.Process(proc.pid)
        times = p.cpu_times()
        return float(times.user + times.system)
    except psutil.Error:
        return float("nan")


def _wait_event(log: Path, kind: str, proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any] | None:
    """The chief's first event of ``kind``, None if it did not come within ``timeout`` or the chief exited."""
    try:
        found = wait_for(lambda: [e for e in events(log) if e["event"] == kind] or proc.poll() is not None, timeout,
                         kind, interval=0.1)
    except AssertionError:
        return None
    return found[0] if isinstance(found, list) else None


def run(join_after: float, run_seconds: float, mode: str) -> None:
    """``mode``: "late" (worker 2's slot has no server until it joins), "stand-in" (a stand-in worker serves the slot
    until the chief's strategy is up, then is killed), "direct" (three workers at their own addresses, no forwarder)."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        script = tmp / "task.py"
        script.write_text(TASK)
        forwarder = Forwarder()
        real = [free_port() for _ in range(4)]  # the last: the stand-in's
        ps, chief = free_port(), free_port()
        workers = [f"127.0.0.1:{p}" for p in real[:3]]
        direct = mode == "direct"
        chief_view = {"chief": [f"127.0.0.1:{chief}"], "ps": [f"127.0.0.1:{ps}"],
                      "worker": workers if direct else [*workers[:2], f"127.0.0.1:{forwarder.port}"]}
        own_view = {**chief_view, "worker": workers}
        stand_in_view = {**chief_view, "worker": [*workers[:2], f"127.0.0.1:{real[3]}"]}
        procs: dict[str, subprocess.Popen[bytes]] = {}
        chief_log = tmp / "chief.log"
        try:
            procs["ps0"] = start(script, own_view, "ps", 0, run_seconds, tmp / "ps0.log")
            for i in range(3 if direct else 2):
                procs[f"worker{i}"] = start(script, own_view, "worker", i, run_seconds, tmp / f"worker{i}.log")
            if mode == "stand-in":
                procs["stand_in"] = start(script, stand_in_view, "worker", 2, run_seconds, tmp / "stand_in.log")
                wait_for(lambda: "serving" in (tmp / "stand_in.log").read_text(errors="replace"), 120,
                         "the stand-in")
                forwarder.backend = real[3]
            began = time.monotonic()
            procs["chief"] = start(script, chief_view, "chief", 0, run_seconds, chief_log)
            joined = began + join_after
            if mode == "stand-in":
                ready = _wait_event(chief_log, "ready", procs["chief"], 180)
                if ready is None:
                    print("the chief did not come up with the stand-in:\n" + chief_log.read_text()[-3000:])
                    return
                forwarder.backend = None
                stand_in = procs.pop("stand_in")
                stand_in.kill()
                stand_in.wait()
                print(f"chief ready {time.monotonic() - began:.1f}s after its start with the stand-in serving "
                      "worker 2's slot; the stand-in killed now")
            if not direct:
                time.sleep(max(0.0, joined - time.monotonic()))
                up = [e for e in events(chief_log) if e["event"] == "ready"]
                print(f"{join_after:g}s after the chief's start, worker 2 starts: the chief's strategy is "
                      f"{'up' if up else 'not up yet'}")
                procs["worker2"] = start(script, own_view, "worker", 2, run_seconds, tmp / "worker2.log")
                wait_for(lambda: "serving as worker 2" in (tmp / "worker2.log").read_text(errors="replace"), 120,
                         "worker 2 to serve", interval=0.1)
                serving = time.monotonic()
                forwarder.backend = real[2]
                relayed_before = forwarder.relayed
                print(f"worker 2 serving {serving - joined:.1f}s after its start; the relay forwards to it now")
            ready = _wait_event(chief_log, "ready", procs["chief"], 180)
            if ready is None:
                print("the chief never came up:\n" + chief_log.read_text()[-3000:])
                return
            strategy = next(e for e in events(chief_log) if e["event"] == "strategy")
            print(f"the chief's ParameterServerStrategy(...) returned after {strategy['seconds']:.1f}s in it, "
                  f"{time.monotonic() - began:.1f}s after the chief's start at the latest")
            code = procs["chief"].wait(run_seconds + 300)
            samples = [e for e in events(chief_log) if e["event"] == "steps"]
            print(f"chief exited {code}; {samples[-1]['steps'] if samples else 0} steps")
            if not samples:
                print(chief_log.read_text()[-3000:])
                return
            first, end = samples[0]["time"], samples[-1]["time"]
            if direct:
                print(f"steps/s with 3 direct workers: {_number(rate(samples, first, end))}")
            else:
                before = rate(samples, first, serving)
                after = rate(samples, max(first, serving + 10), end)
                print(f"steps/s before worker 2 served: {_number(before)}; from 10 s after: {_number(after)}")
                print(f"bytes relayed since worker 2 served: {forwarder.relayed - relayed_before}, "
                      f"{sum(1 for e in samples if e['time'] > serving) * 10} steps scheduled since")
            print("cpu seconds per task at the end:",
                  json.dumps({name: round(cpu_seconds(p), 1) for name, p in procs.items() if p.poll() is None}))
            lines = [line for line in chief_log.read_text(errors="replace").splitlines()
                     if "task:2" in line][:6]
            print("the chief's lines about worker 2:", *lines, sep="\n  ")
        finally:
            for p in procs.values():
                p.kill()
                p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--join-after", type=float, default=20.0)
    parser.add_argument("--run-seconds", type=float, default=60.0)
    parser.add_argument("--mode", choices=("late", "stand-in", "direct"), default="late")
    parser.add_argument("--step-ms", type=float, default=50.0, help="the workers' sleep per step (default 50 ms)")
    args = parser.parse_args()
    global STEP_SLEEP_US
    STEP_SLEEP_US = int(args.step_ms * 1000)
    run(args.join_after, args.run_seconds, args.mode)


if __name__ == "__main__":
    main()
