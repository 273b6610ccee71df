"""FakeNvml: a fake of the pynvml module, a fake for hardware we lack (the test machines have no GPU and no driver).

It has only the functions tfelastic.daemon.metrics.gpu calls, with pynvml's arguments, return shapes and
exceptions: failures are ``pynvml.NVMLError(code)``, which builds pynvml's own subclass (NVMLError_NotSupported...),
so the collector's except clauses are the ones that meet the real library. Its behaviour follows NVML's documentation
as far as this fake goes; it says nothing about how a given GPU or driver actually behaves.
Every call is counted in ``calls``, so tests can tell a cached scrape from one that reached NVML.

Processes on a GPU (:class:`FakeGpuProcess`) are listed until the moment their memory is given back, which may be
late or never: a killed CUDA process can keep its memory for seconds after it exited, and a GPU in trouble for good.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field

import pynvml  # type: ignore[import-untyped]


@dataclass
class FakeGpu:
    """One GPU's readings in NVML's units: percent, bytes, celsius, milliwatts, MHz, counts, a bit mask."""

    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = ""  # empty: derived from the index
    utilization: int = 50
    memory_utilization: int = 20
    memory_total: int = 80 * 2**30
    memory_used: int = 10 * 2**30
    temperature: int = 40
    power_mw: int = 250_000
    sm_clock_mhz: int = 1980
    ecc_volatile: tuple[int, int] = (0, 0)  # corrected, uncorrected
    ecc_aggregate: tuple[int, int] = (0, 0)
    clocks_event_reasons: int = 0
    retired_pages_pending: int = 0  # NVML_FEATURE_DISABLED / NVML_FEATURE_ENABLED
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)  # corrected, uncorrected, pending, failure
    errors: dict[str, int] = field(default_factory=dict)  # NVML function -> the NVML_ERROR_* it fails with
    processes: list[FakeGpuProcess] = field(default_factory=list)  # compute processes (CUDA contexts)
    graphics_processes: list[FakeGpuProcess] = field(default_factory=list)

    def unsupported(self, *functions: str) -> FakeGpu:
        for function in functions:
            self.errors[function] = pynvml.NVML_ERROR_NOT_SUPPORTED
        return self


@dataclass
class FakeGpuProcess:
    """A process with a context on a GPU. NVML lists it until ``frees_at`` (``time.monotonic()``; the monotonic
    clock is the machine's, so several processes agree on it): its memory is back then, whether the process
    ended long before or not. ``math.inf``: never (a GPU that does not give a dead process's memory back)."""

    pid: int
    used_memory: int | None = 4 * 2**30  # bytes; None: NVML cannot tell (NVML_VALUE_NOT_AVAILABLE)
    frees_at: float = math.inf

    def listed(self, now: float) -> bool:
        return now < self.frees_at


@dataclass
class FakeProcessInfo:
    """What pynvml's nvmlDeviceGet*RunningProcesses_v3 return (nvmlStructToFriendlyObject of nvmlProcessInfo_t)."""

    pid: int
    usedGpuMemory: int | None
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


@dataclass(eq=False)  # compared by identity, as pynvml's ctypes handles are
class FakeHandle:
    index: int


@dataclass
class FakeUtilization:
    gpu: int
    memory: int


@dataclass
class FakeMemory:
    total: int
    free: int
    used: int


@dataclass
class FakeEventData:
    device: FakeHandle
    eventType: int
    eventData: int
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


class FakeEventSet:
    pass


class FakeNvml:
    """``gpus``: how many default GPUs, or the GPUs. ``init_error``: the NVML_ERROR_* nvmlInit fails with (12,
    library not found, is a machine without the driver); tests may clear it later, as when a driver gets loaded."""

    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVMLError_Timeout = pynvml.NVMLError_Timeout
    NVMLError_FunctionNotFound = pynvml.NVMLError_FunctionNotFound
    NVMLError_Uninitialized = pynvml.NVMLError_Uninitialized
    NVMLError_LibraryNotFound = pynvml.NVMLError_LibraryNotFound
    NVMLError_DriverNotLoaded = pynvml.NVMLError_DriverNotLoaded

    def __init__(self, gpus: int | list[FakeGpu] = 1, driver_version: str = "550.54.15",
                 init_error: int | None = None) -> None:
        self.gpus = [FakeGpu() for _ in range(gpus)] if isinstance(gpus, int) else gpus
        for index, gpu in enumerate(self.gpus):
            gpu.uuid = gpu.uuid or f"GPU-00000000-0000-0000-0000-{index:012d}"
        self.driver_version = driver_version
        self.init_error = init_error
        self.event_set_error: int | None = None
        self.missing: set[str] = set()  # functions the driver lacks: NVMLError_FunctionNotFound, as with an old one
        self.calls: Counter[str] = Counter()
        self.wait_timeouts: list[int] = []
        self.inits = 0  # NVML counts nvmlInit against nvmlShutdown
        self.latency = 0.0  # seconds each call takes, as the driver's do: lets concurrent scrapes overlap
        self._registered: set[int] = set()
        self._events: list[FakeEventData] = []

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    def xid(self, index: int, code: int) -> None:
        """The driver reports XID ``code`` on GPU ``index``: queued only if someone registered for it, as in NVML."""
        if index in self._registered:
            self._events.append(FakeEventData(FakeHandle(index), pynvml.nvmlEventTypeXidCriticalError, code))

    # Bookkeeping of every call

    def _enter(self, function: str) -> None:
        self.calls[function] += 1
        if self.latency:
            time.sleep(self.latency)
        if function in self.missing:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if not self.inits and function != "nvmlInit":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    def _device(self, function: str, handle: FakeHandle) -> FakeGpu:
        self._enter(function)
        gpu = self.gpus[handle.index]
        if function in gpu.errors:
            raise pynvml.NVMLError(gpu.errors[function])
        return gpu

    # The pynvml surface

    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.inits -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return FakeHandle(index)

    def nvmlDeviceGetIndex(self, handle: FakeHandle) -> int:
        self._device("nvmlDeviceGetIndex", handle)
        return handle.index

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        return self._device("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        return self._device("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> FakeUtilization:
        gpu = self._device("nvmlDeviceGetUtilizationRates", handle)
        return FakeUtilization(gpu.utilization, gpu.memory_utilization)

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle, version: int | None = None) -> FakeMemory:
        gpu = self._device("nvmlDeviceGetMemoryInfo", handle)
        return FakeMemory(gpu.memory_total, gpu.memory_total - gpu.memory_used, gpu.memory_used)

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        return self._temperature("nvmlDeviceGetTemperature", handle, sensor)

    def nvmlDeviceGetTemperatureV(self, handle: FakeHandle, sensor: int) -> int:
        return self._temperature("nvmlDeviceGetTemperatureV", handle, sensor)

    def _temperature(self, function: str, handle: FakeHandle, sensor: int) -> int:
        gpu = self._device(function, handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.temperature

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        return self._device("nvmlDeviceGetPowerUsage", handle).power_mw

    def nvmlDeviceGetClockInfo(self, handle: FakeHandle, clock_type: int) -> int:
        gpu = self._device("nvmlDeviceGetClockInfo", handle)
        if clock_type != pynvml.NVML_CLOCK_SM:  # the fake knows only the SM clock: another is a caller's mistake
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.sm_clock_mhz

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeHandle, error_type: int, counter_type: int) -> int:
        gpu = self._device("nvmlDeviceGetTotalEccErrors", handle)
        counts = gpu.ecc_volatile if counter_type == pynvml.NVML_VOLATILE_ECC else gpu.ecc_aggregate
        return counts[0 if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else 1]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: FakeHandle) -> int:
        return self._device("nvmlDeviceGetRetiredPagesPendingStatus", handle).retired_pages_pending

    def nvmlDeviceGetRemappedRows(self, handle: FakeHandle) -> tuple[int, int, int, int]:
        return self._device("nvmlDeviceGetRemappedRows", handle).remapped_rows

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeHandle) -> int:
        return self._device("nvmlDeviceGetCurrentClocksEventReasons", handle).clocks_event_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeHandle) -> int:
        return self._device("nvmlDeviceGetCurrentClocksThrottleReasons", handle).clocks_event_reasons

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: FakeHandle) -> list[FakeProcessInfo]:
        return self._listed(self._device("nvmlDeviceGetComputeRunningProcesses_v3", handle).processes)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: FakeHandle) -> list[FakeProcessInfo]:
        return self._listed(self._device("nvmlDeviceGetComputeRunningProcesses_v2", handle).processes)

    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle: FakeHandle) -> list[FakeProcessInfo]:
        return self._listed(self._device("nvmlDeviceGetGraphicsRunningProcesses_v3", handle).graphics_processes)

    def _listed(self, processes: list[FakeGpuProcess]) -> list[FakeProcessInfo]:
        now = time.monotonic()
        return [FakeProcessInfo(p.pid, p.used_memory) for p in processes if p.listed(now)]

    def nvmlEventSetCreate(self) -> FakeEventSet:
        self._enter("nvmlEventSetCreate")
        if self.event_set_error is not None:
            raise pynvml.NVMLError(self.event_set_error)
        return FakeEventSet()

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, event_types: int, event_set: FakeEventSet) -> None:
        self._device("nvmlDeviceRegisterEvents", handle)
        if event_types & pynvml.nvmlEventTypeXidCriticalError:
            self._registered.add(handle.index)

    def nvmlEventSetWait(self, event_set: FakeEventSet, timeoutms: int) -> FakeEventData:
        """Never blocks: with nothing queued it fails with NVML_ERROR_TIMEOUT, as NVML does once timeoutms pass."""
        self._enter("nvmlEventSetWait")
        self.wait_timeouts.append(timeoutms)
        if not self._events:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return self._events.pop(0)

    def nvmlEventSetFree(self, event_set: FakeEventSet) -> None:
        self._enter("nvmlEventSetFree")
