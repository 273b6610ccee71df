"""The GPU kit's dry mode (bench/gpu_kit.py --dry): FAKES for the hardware these machines lack, so that the kit
runs here, in the suite, and cannot rot. Nothing it reports in this mode says anything about a GPU.

* :class:`DryNvml`: the fake NVML of tests/nvml_fake.py with one fake GPU, whose processes are the kit's CPU
  stand-in trainers (bench/gpu_standin_trainer.py --device cpu). Each registers its pid and the bytes it "holds"
  as a file in ``GPU_KIT_HOLDERS``; every process that reads this NVML (the agents, the kit, the fake
  nvidia-smi) lists it from there while it runs, and for :data:`RELEASE_DELAY` seconds after it is gone, as a
  killed CUDA process keeps its memory a while. The first reader that sees it gone writes down when, for all.
* ``python -m tests.gpu_kit_dry nvidia-smi --query-gpu=F1,F2 --format=csv,noheader,nounits``: nvidia-smi's
  query over that NVML, with the fields the kit asks for.
* ``python -m tests.gpu_kit_dry agent ARGS``: ``tfelastic ARGS`` whose GPU collector reads :class:`DryNvml`.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pynvml  # type: ignore[import-untyped]

from tests.nvml_fake import FakeGpu, FakeGpuProcess, FakeHandle, FakeMemory, FakeNvml, FakeProcessInfo

HOLDERS_ENV = "GPU_KIT_HOLDERS"
RELEASE_DELAY = 1.0  # seconds a stand-in's "GPU memory" stays listed after the process is gone
GPU_NAME = "Fake GPU of tests/nvml_fake.py (dry run)"
DRIVER = "0.0.dry"
BASE_USED = 512 * 2**20  # what the driver itself holds on the fake GPU
MIB = 2**20


def register_holder(holders: str, pid: int, used_bytes: int) -> None:
    """A stand-in trainer "allocates GPU memory": from now on the fake GPU lists ``pid`` with ``used_bytes``."""
    path = Path(holders)
    path.mkdir(parents=True, exist_ok=True)
    temporary = path / f".{pid}.tmp"
    temporary.write_text(str(used_bytes))
    temporary.rename(path / str(pid))


class DryNvml(FakeNvml):
    """One fake GPU whose processes are the stand-ins registered in ``holders`` (see the module's docstring)."""

    def __init__(self, holders: str) -> None:
        super().__init__([FakeGpu(name=GPU_NAME, memory_used=BASE_USED)], driver_version=DRIVER)
        self.holders = Path(holders)

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: FakeHandle) -> list[FakeProcessInfo]:
        self._refresh()
        return super().nvmlDeviceGetComputeRunningProcesses_v3(handle)

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle, version: int | None = None) -> FakeMemory:
        self._refresh()
        return super().nvmlDeviceGetMemoryInfo(handle, version)

    def _refresh(self) -> None:
        gpu = self.gpus[0]
        gpu.processes = [p for p in (self._holder(entry) for entry in self._entries()) if p is not None]
        now = time.monotonic()
        gpu.memory_used = BASE_USED + sum(p.used_memory or 0 for p in gpu.processes if p.listed(now))

    def _entries(self) -> list[Path]:
        with contextlib.suppress(FileNotFoundError):
            return [entry for entry in self.holders.iterdir() if entry.name.isdigit()]
        return []

    def _holder(self, entry: Path) -> FakeGpuProcess | None:
        pid = int(entry.name)
        try:
            used = int(entry.read_text())
        except (OSError, ValueError):
            return None
        if _running(pid):
            return FakeGpuProcess(pid, used, math.inf)
        return FakeGpuProcess(pid, used, self._gone_at(pid) + RELEASE_DELAY)

    def _gone_at(self, pid: int) -> float:
        """When the first reader saw ``pid`` gone (the monotonic clock is the machine's: every process agrees)."""
        gone = self.holders / f"{pid}.gone"
        with contextlib.suppress(FileExistsError), open(gone, "x") as f:
            f.write(repr(time.monotonic()))
        for _ in range(100):  # its writer may not have written yet
            with contextlib.suppress(ValueError):
                return float(gone.read_text())
            time.sleep(0.001)
        return time.monotonic()


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# nvidia-smi's query over DryNvml: the fields the kit asks for, in nvidia-smi's spelling and units.

def _smi_readings(nvml: DryNvml, handle: FakeHandle) -> dict[str, str]:
    gpu = nvml.gpus[handle.index]
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    rates = nvml.nvmlDeviceGetUtilizationRates(handle)
    corrected, uncorrected = gpu.ecc_volatile
    return {
        "index": str(handle.index), "uuid": gpu.uuid, "name": gpu.name, "driver_version": nvml.driver_version,
        "memory.total": str(memory.total // MIB), "memory.used": str(memory.used // MIB),
        "memory.reserved": "[N/A]", "utilization.gpu": str(rates.gpu), "utilization.memory": str(rates.memory),
        "temperature.gpu": str(nvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
        "power.draw": f"{nvml.nvmlDeviceGetPowerUsage(handle) / 1000:.2f}", "power.draw.average": "[N/A]",
        "power.draw.instant": "[N/A]",
        "clocks.sm": str(nvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
        "ecc.errors.corrected.volatile.total": str(corrected),
        "ecc.errors.uncorrected.volatile.total": str(uncorrected),
        "retired_pages.pending": "Yes" if gpu.retired_pages_pending else "No",
        "remapped_rows.pending": "Yes" if gpu.remapped_rows[2] else "No",
        "remapped_rows.failure": "Yes" if gpu.remapped_rows[3] else "No",
        "clocks_event_reasons.active": f"0x{gpu.clocks_event_reasons:016X}",
        "clocks_throttle_reasons.active": f"0x{gpu.clocks_event_reasons:016X}",
    }


def nvidia_smi(argv: list[str]) -> int:
    """``--query-gpu=FIELDS --format=csv,noheader,nounits``; an unknown field fails as nvidia-smi's does."""
    options = dict(arg.split("=", 1) for arg in argv if "=" in arg)
    if options.get("--format") != "csv,noheader,nounits" or "--query-gpu" not in options:
        print(f"the dry run's nvidia-smi knows only --query-gpu=... --format=csv,noheader,nounits, not {argv}",
              file=sys.stderr)
        return 2
    nvml = DryNvml(os.environ[HOLDERS_ENV])
    nvml.nvmlInit()
    fields = options["--query-gpu"].split(",")
    for index in range(nvml.nvmlDeviceGetCount()):
        readings = _smi_readings(nvml, nvml.nvmlDeviceGetHandleByIndex(index))
        unknown = [field for field in fields if field not in readings]
        if unknown:
            print(f'Field "{unknown[0]}" is not a valid field to query.', file=sys.stderr)
            return 2
        print(", ".join(readings[field] for field in fields))
    return 0


def agent(argv: list[str]) -> int:
    """``tfelastic ARGV``, its GPU collector on :class:`DryNvml` instead of the driver's NVML."""
    from tfelastic.daemon.agent import node
    from tfelastic.daemon.cli import main
    from tfelastic.daemon.metrics import gpu

    dry = DryNvml(os.environ[HOLDERS_ENV])

    def register(registry: Any, nvml: Any = None, **kwargs: Any) -> gpu.GpuCollector:
        return gpu.register_gpu_collector(registry, nvml=dry, **kwargs)

    node.register_gpu_collector = register  # type: ignore[attr-defined]  # the one place the agent opens NVML
    return main(argv)


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    sys.exit({"nvidia-smi": nvidia_smi, "agent": agent}[command](rest))
