"""A trainer without TensorFlow for control-plane tests: counts steps, reports them, and can be told to fail.

It resumes from a step file in TFELASTIC_BACKUP_DIR, like a checkpoint. Environment knobs:
COUNTER_STEPS (target, default 50), COUNTER_STEP_SECONDS (default 0.05), COUNTER_EVENTS (a file to which
every rank appends one JSON line when it starts and when it ends).
"""

import json
import os
import sys
import time

from tfelastic.trainer.progress import ProgressReporter


def main() -> int:
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

    event("start", tf_config=os.environ["TF_CONFIG"], legacy_keras=os.environ.get("TF_USE_LEGACY_KERAS"))
    reporter = ProgressReporter.from_env(min_interval=0)
    while step < target:
        time.sleep(pause)
        step += 1
        if rank == 0:
            with open(state + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(state + ".tmp", state)
        reporter.report(step, examples=step * 32, loss=1.0 / step)
    event("end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
