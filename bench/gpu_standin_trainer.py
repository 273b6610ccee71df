"""The GPU kit's stand-in trainer (bench/gpu_kit.py): what a trainer does to a GPU, with PyTorch, which the lent
GPU machines have (TensorFlow they have not).

    python bench/gpu_standin_trainer.py --events PATH [--gib 4] [--device cuda|cpu]

With ``--device cuda`` it allocates GIB of device memory, then runs matrix products until it is stopped, and
reports each step to its agent with tfelastic.trainer.progress, as a trainer of the library does. It appends
JSON lines to PATH: ``start`` (the script runs), ``first_gpu_step`` (the first product is computed: the GPU
works for this generation) with what PyTorch says of the device.

``--device cpu`` is the kit's dry mode (no PyTorch here): it holds GIB of host memory instead and registers it,
with its pid, in ``GPU_KIT_HOLDERS``, where the dry mode's fake NVML (tests/gpu_kit_dry.py) lists it on the fake
GPU, and its "matrix products" are a few microseconds of arithmetic.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

from tfelastic.trainer.environment import GENERATION_ENV, NODE_ID_ENV, RANK_ENV
from tfelastic.trainer.progress import Phase, ProgressReporter

MATRIX = 8192  # bf16: about 1.1 TFLOP a product, a few ms on an H100


def event(path: str, name: str, **fields: Any) -> None:
    record = {"event": name, "generation": int(os.environ.get(GENERATION_ENV, "0")),
              "rank": int(os.environ.get(RANK_ENV, "-1")), "node": os.environ.get(NODE_ID_ENV, ""),
              "pid": os.getpid(), "time": time.time(), **fields}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def on_gpu(gib: float) -> tuple[Callable[[], float], dict[str, Any]]:
    """Allocates on the GPU; returns one training step (a product, synchronized) and what the device is."""
    torch: Any = importlib.import_module("torch")  # on the GPU machines only

    device = torch.device("cuda")
    held = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    held.fill_(1)  # touched: the memory is the process's for sure
    a = torch.randn(MATRIX, MATRIX, device=device, dtype=torch.bfloat16)
    b = torch.randn(MATRIX, MATRIX, device=device, dtype=torch.bfloat16)

    def step() -> float:
        c = a @ b
        torch.cuda.synchronize()
        return float(c[0, 0])

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(device),
            "held_bytes": held.numel(), "allocated_bytes": torch.cuda.memory_allocated(device)}
    return step, info


def on_cpu(gib: float) -> tuple[Callable[[], float], dict[str, Any]]:
    """The dry mode's stand-in for :func:`on_gpu`."""
    from tests.gpu_kit_dry import HOLDERS_ENV, register_holder

    held = bytearray(int(gib * 2**30))
    register_holder(os.environ[HOLDERS_ENV], os.getpid(), len(held))
    rows = [[float(i + j) for j in range(16)] for i in range(16)]

    def step() -> float:
        time.sleep(0.02)
        return sum(x * y for x, y in zip(rows[0], rows[1], strict=True))

    return step, {"device": "cpu (dry run)", "held_bytes": len(held)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", required=True)
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    event(args.events, "start")
    reporter = ProgressReporter.from_env()
    reporter.report(0, phase=Phase.SETUP)
    step, info = (on_gpu if args.device == "cuda" else on_cpu)(args.gib)
    value = step()
    event(args.events, "first_gpu_step", **info)
    number = 1
    while True:
        reporter.report(number, loss=value)
        value = step()
        number += 1


if __name__ == "__main__":
    main()
