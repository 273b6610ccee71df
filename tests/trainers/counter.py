"""A trainer without TensorFlow for control-plane tests: counts steps, reports them, and can be told to fail.

It resumes from a step file in TFELASTIC_BACKUP_DIR, like a checkpoint. Environment knobs:
COUNTER_STEPS (target, default 50), COUNTER_STEP_SECONDS (default 0.05), COUNTER_EVENTS (a file to which
every rank appends one JSON line when it starts and when it ends), COUNTER_HANG_AT (a step at which the chief
stops making progress while its process stays alive, once), COUNTER_FAIL_AT (a step at which the chief exits 3,
once), COUNTER_EXIT_ON_TERM=1 (exit 0 on SIGTERM, like a trainer that checkpoints and stops), COUNTER_RECORD_ENV
(comma-separated variable names: the start event records their values as "env", null where unset),
COUNTER_LINGER_AFTER_DONE (seconds: at the target, report that training completed, then stay this long silent),
COUNTER_DONE_AT (a step at which it reports that training completed, and goes on: a second fit follows),
COUNTER_RAISE_AT (a step at which the chief divides by zero, every time: an uncaught ZeroDivisionError),
COUNTER_PRINT=1 (print a line per step, without flushing: what a custom loop's print does),
COUNTER_LOSE_BACKUP_AT (a step at which the chief deletes its step file and exits 3, once: a backup deleted
after training, as tf_keras' BackupAndRestore does on success, then a failure),
COUNTER_BAD_WHILE (a path: while it exists, this rank, whatever its rank, exits 1 after COUNTER_STEP_SECONDS with
a "bad GPU" error, every time: a bad node; set it for one agent only),
COUNTER_TIERED=1 (report what a trainer on the fast checkpoint tier reports: where it restored from, 'shared' or
'none', and a 1 ms save stall at each save of the chief).

COUNTER_HOLD_PORT_MB (N: bind this rank's own TF_CONFIG port as TensorFlow's server does, and hold N MB of
touched memory and a few threads, so that a killed trainer takes a while to let the port go, as a real one does;
a port still held makes it exit 1 with the bind error, as TensorFlow's server does); COUNTER_IGNORE_TERM=1 (trains on
through SIGTERM, as a MultiWorkerMirroredStrategy worker does once its coordination service runs: a stop kills it).

COUNTER_EAT_MEMORY_AT (a step at which the chief allocates and touches memory, 16 MB at a time, until the kernel's
OOM killer kills it: run it in a memory cgroup with a limit).

COUNTER_BURN_SECONDS (N: every rank starts one busy process per core, in its own process group, that spins for N
seconds: an input pipeline that saturates every core of the node).

COUNTER_SAVE_EVERY (the chief saves its step file every N steps, default 1) and COUNTER_CHECKPOINT_ON_TERM=1 (on
SIGTERM the chief saves the step it reached, each rank records a "checkpointed" event and exits 42,
CHECKPOINTED_AND_STOPPED: a trainer that loses no step on a planned stop; set before the start event is written);
with it COUNTER_TEARDOWN_SECONDS (N: after that save, announce the exit to the agent as tfelastic.trainer does, then
stay N seconds before exiting, as a trainer whose input pipeline takes a minute to be torn down).

Unlike MWMS ranks, counters do not wait for each other. Faults hit the chief (rank 0) so that the other rank
cannot finish the job alone: a chief's exit 0 completes a job (see rendezvous/rounds.py).

At start it records in its event every live process of the same job from an older generation ("stale"): the
agents promise there is none (docs/facts.md, fact 4).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
from tfelastic.trainer.exit_codes import CHECKPOINTED_AND_STOPPED
from tfelastic.trainer.progress import Phase, ProgressReporter


def stale_workers(backup: str, generation: int, events: str | None) -> list[int]:
    """Live processes of an older generation: by the environment they were started with, and, since a warm-started
    trainer's /proc environ is its standby's, by the pids that older generations recorded in their start events
    (the process must have been created before that event, so a reused pid does not count)."""
    stale = _recorded_older(events, generation)
    for p in psutil.process_iter(["environ"]):
        try:
            env = p.info["environ"] or {}
            same_job = env.get("TFELASTIC_BACKUP_DIR") == backup
            older = int(env.get("TFELASTIC_GENERATION", generation)) < generation
            if same_job and older and p.status() != psutil.STATUS_ZOMBIE and p.pid not in stale:
                stale.append(p.pid)
        except (psutil.Error, ValueError):
            continue
    return stale


def _recorded_older(events: str | None, generation: int) -> list[int]:
    if not events or not os.path.exists(events):
        return []
    found = []
    with open(events) as f:
        for line in f:
            e = json.loads(line)
            if e["event"] != "start" or e["generation"] >= generation:
                continue
            try:
                p = psutil.Process(e["pid"])
                if p.status() != psutil.STATUS_ZOMBIE and p.create_time() <= e["time"] + 0.01:
                    found.append(p.pid)
            except psutil.Error:
                continue
    return found


def hold_port(megabytes: int) -> tuple[socket.socket, list[bytearray]] | None:
    """Binds this rank's worker port, like tf.distribute.Server; raises OSError if it is held."""
    if not megabytes:
        return None
    config = json.loads(os.environ["TF_CONFIG"])
    task = config["task"]
    port = int(config["cluster"][task["type"]][task["index"]].rpartition(":")[2])
    server = socket.socket(socket.AF_INET6)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's listeners do
    server.bind(("::", port))
    server.listen()
    held = [bytearray(1 << 20) for _ in range(megabytes)]
    for block in held:
        for i in range(0, len(block), 4096):
            block[i] = 1
    for _ in range(8):
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    return server, held


def burn_every_core(seconds: float) -> list[subprocess.Popen[bytes]]:
    """One spinning child per core, each ending by itself after ``seconds`` (a killed trainer's group takes them
    along)."""
    spin = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 1)]


def once(backup: str, name: str) -> bool:
    """True the first time it is called for ``name`` in this job."""
    try:
        os.close(os.open(os.path.join(backup, name), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def main() -> int:
    try:  # first, as a warm-started TensorFlow trainer binds its server before anything else
        held = hold_port(int(os.environ.get("COUNTER_HOLD_PORT_MB", "0")))  # noqa: F841 (until the process ends)
    except OSError as e:
        bind_failed = str(e)
    else:
        bind_failed = ""
    backup = os.environ["TFELASTIC_BACKUP_DIR"]
    rank = int(os.environ["TFELASTIC_RANK"])
    os.makedirs(backup, exist_ok=True)
    state = os.path.join(backup, "step")
    step = 0
    if os.path.exists(state):
        with open(state) as f:
            step = int(f.read())
    target = int(os.environ.get("COUNTER_STEPS", "50"))
    pause = float(os.environ.get("COUNTER_STEP_SECONDS", "0.05"))
    events = os.environ.get("COUNTER_EVENTS")

    def event(kind: str, **extra: object) -> None:
        if events:
            with open(events, "a") as f:
                f.write(json.dumps({"event": kind, "rank": rank, "pid": os.getpid(), "time": time.time(),
                                    "generation": int(os.environ["TFELASTIC_GENERATION"]),
                                    "world_size": int(os.environ["TFELASTIC_WORLD_SIZE"]),
                                    "restart_count": int(os.environ["TFELASTIC_RESTART_COUNT"]),
                                    "step": step, **extra}) + "\n")

    terminated: list[int] = []
    if os.environ.get("COUNTER_CHECKPOINT_ON_TERM"):  # before "start": a test that saw it may stop us
        signal.signal(signal.SIGTERM, lambda *_: terminated.append(1))  # finish the step, then save
    save_every = int(os.environ.get("COUNTER_SAVE_EVERY", "1"))
    generation = int(os.environ["TFELASTIC_GENERATION"])
    recorded = [name for name in os.environ.get("COUNTER_RECORD_ENV", "").split(",") if name]
    event("start", tf_config=os.environ["TF_CONFIG"], legacy_keras=os.environ.get("TF_USE_LEGACY_KERAS"),
          nice=os.getpriority(os.PRIO_PROCESS, 0),
          stale=stale_workers(backup, generation, events), env={name: os.environ.get(name) for name in recorded})
    if bind_failed:
        event("bind_failed", error=bind_failed)
        print(f"RuntimeError: Could not start gRPC server: {bind_failed}", file=sys.stderr)
        return 1
    bad_while = os.environ.get("COUNTER_BAD_WHILE")
    if bad_while and os.path.exists(bad_while):
        time.sleep(pause)
        event("bad")
        print("RuntimeError: CUDA error: an illegal memory access was encountered (a bad GPU)", file=sys.stderr)
        return 1
    if os.environ.get("COUNTER_IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.environ.get("COUNTER_EXIT_ON_TERM"):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    hang_at = int(os.environ.get("COUNTER_HANG_AT", "-1"))
    fail_at = int(os.environ.get("COUNTER_FAIL_AT", "-1"))
    done_at = int(os.environ.get("COUNTER_DONE_AT", "-1"))
    raise_at = int(os.environ.get("COUNTER_RAISE_AT", "-1"))
    lose_at = int(os.environ.get("COUNTER_LOSE_BACKUP_AT", "-1"))
    eat_at = int(os.environ.get("COUNTER_EAT_MEMORY_AT", "-1"))
    prints = bool(os.environ.get("COUNTER_PRINT"))
    linger = float(os.environ.get("COUNTER_LINGER_AFTER_DONE", "-1"))
    burning = burn_every_core(float(os.environ.get("COUNTER_BURN_SECONDS", "0"))) \
        if os.environ.get("COUNTER_BURN_SECONDS") else []
    reporter = ProgressReporter.from_env(min_interval=0)
    reporter.report(step, phase=Phase.SETUP)  # its "restore": a trainer that announces its long work
    tiered = bool(os.environ.get("COUNTER_TIERED"))
    if tiered:
        reporter.report(step, restored_tier="shared" if step else "none", restored_step=step)
    while step < target:
        time.sleep(pause)
        step += 1
        if rank == 0 and (step % save_every == 0 or terminated):
            with open(state + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(state + ".tmp", state)
        if terminated:
            event("checkpointed")
            teardown = float(os.environ.get("COUNTER_TEARDOWN_SECONDS", "0"))
            if teardown:
                reporter.announce_exit(CHECKPOINTED_AND_STOPPED, step)
                time.sleep(teardown)
            return CHECKPOINTED_AND_STOPPED
        reporter.report(step, examples=step * 32, loss=1.0 / step, checkpoint_step=step if rank == 0 else None,
                        done=step == done_at, stall=0.001 if tiered and rank == 0 else None)
        if rank == 0 and step == hang_at and once(backup, "hung"):
            event("hang")
            time.sleep(3600)
        if prints:
            print(f"counter step {step}")
        if rank == 0 and step == eat_at:
            eaten = []
            while True:  # until the OOM killer's SIGKILL
                eaten.append(b"x" * (16 << 20))
        if rank == 0 and step == raise_at:
            print(1.0 / (step - raise_at))
        if rank == 0 and step == lose_at and once(backup, "lost"):
            os.remove(state)
            return 3
        if rank == 0 and step == fail_at and once(backup, "failed"):
            event("fail")
            return 3
    if linger >= 0:  # training complete, then silent work such as an evaluation or an export
        reporter.report(step, done=True)
        time.sleep(linger)
    for spinner in burning:
        spinner.wait()
    event("end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
