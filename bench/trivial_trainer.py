"""The trainer of the control-plane benchmarks: no TensorFlow, no imports beyond the standard library.

It appends {"generation", "rank", "pid", "time"} to BENCH_EVENTS the moment it runs, then waits to be killed.
"""

import json
import os
import time

with open(os.environ["BENCH_EVENTS"], "a") as f:
    f.write(json.dumps({"generation": int(os.environ["TFELASTIC_GENERATION"]),
                        "rank": int(os.environ["TFELASTIC_RANK"]), "pid": os.getpid(), "time": time.time()}) + "\n")
while True:
    time.sleep(3600)
