"""GPU metrics from NVML, per GPU labelled ``gpu`` (NVML's index), ``uuid`` and ``name``.

Scrapes run in prometheus_client's HTTP server threads. NVML calls block (microseconds to milliseconds each, more
on a GPU in trouble), so this collector must never be scraped from the asyncio loop. Readings are cached for
``cache_seconds``: however many scrapes come, each interval costs one round of NVML calls.
docs/gpu-metrics.md lists the metrics and their DCGM exporter counterparts.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pynvml  # type: ignore[import-untyped]
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("tfelastic.metrics.gpu")

INIT_RETRY_SECONDS = 60.0  # a driver may be loaded after the daemon started
MAX_EVENTS_PER_REFRESH = 256  # an XID storm must not turn one scrape into an unbounded loop
LABELS = ("gpu", "uuid", "name")

# nvmlClocksEventReason* bits of nvml.h (the same values as the older nvmlClocksThrottleReason* names). Literals
# rather than pynvml's names, which older nvidia-ml-py releases lack; a test checks them against pynvml's.
THROTTLE_REASONS: tuple[tuple[str, int], ...] = (
    ("gpu_idle", 0x1),
    ("applications_clocks_setting", 0x2),
    ("sw_power_cap", 0x4),
    ("hw_slowdown", 0x8),
    ("sync_boost", 0x10),
    ("sw_thermal_slowdown", 0x20),
    ("hw_thermal_slowdown", 0x40),
    ("hw_power_brake_slowdown", 0x80),
    ("display_clock_setting", 0x100),
)

# NVML functions in order of preference: the deprecated temperature call first because every driver has it; the
# newer clocks-event call first because the throttle one is the deprecated name of the same thing.
TEMPERATURE = ("nvmlDeviceGetTemperature", "nvmlDeviceGetTemperatureV")
CLOCK_EVENT_REASONS = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")

# Single readings: (metric, help, NVML functions, their arguments after the handle, factor to base units).
SCALARS: tuple[tuple[str, str, tuple[str, ...], tuple[int, ...], float], ...] = (
    ("tfelastic_gpu_temperature_celsius", "GPU core temperature.", TEMPERATURE, (pynvml.NVML_TEMPERATURE_GPU,), 1.0),
    ("tfelastic_gpu_power_watts", "Power drawn by the GPU board.", ("nvmlDeviceGetPowerUsage",), (), 1e-3),
    ("tfelastic_gpu_sm_clock_hertz", "Current SM clock.", ("nvmlDeviceGetClockInfo",), (pynvml.NVML_CLOCK_SM,), 1e6),
)

# The processes with a context on a GPU, by kind; the versioned names, because pynvml's unversioned ones raise an
# exception outside NVMLError when the driver is older than the binding.
PROCESS_LISTS: tuple[tuple[str, ...], ...] = (
    ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"),
    ("nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v2"),
    ("nvmlDeviceGetMPSComputeRunningProcesses_v3", "nvmlDeviceGetMPSComputeRunningProcesses_v2"),
)

ECC_TYPES = (("corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
             ("uncorrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED))


@dataclass(frozen=True)
class GpuProcess:
    """A process NVML lists on a GPU: ``pid`` as NVML sees it (the host's pid namespace: inside a container of
    its own it is not the container's pid), the device memory it holds (None where NVML cannot tell)."""

    gpu: int
    pid: int
    used_bytes: int | None


@dataclass
class _Gpu:
    index: int
    handle: Any
    labels: tuple[str, str, str]
    xids: int | None = None  # None: this GPU cannot report XID events
    last_xid: int = 0  # no XID has code 0
    xids_at_check: int = 0  # XIDs counted when the last node check looked (health_problems)


class _Families:
    """Families created on their first sample, so that a metric no GPU supports is not exposed at all."""

    def __init__(self) -> None:
        self._families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

    def gauge(self, name: str, doc: str, gpu: _Gpu, value: float, **extra: str) -> None:
        self._add(GaugeMetricFamily, name, doc, gpu, value, extra)

    def counter(self, name: str, doc: str, gpu: _Gpu, value: float, **extra: str) -> None:
        self._add(CounterMetricFamily, name, doc, gpu, value, extra)

    def _add(self, kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, doc: str, gpu: _Gpu,
             value: float, extra: dict[str, str]) -> None:
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = kind(name, doc, labels=[*LABELS, *extra])
        family.add_metric([*gpu.labels, *extra.values()], value)

    def all(self) -> list[Metric]:
        return list(self._families.values())


class GpuCollector(Collector):
    """``nvml`` is the pynvml module, or a stand-in with the same functions; ``clock`` paces the cache and retries.
    ``visible``: report only these GPUs (see :func:`visible_gpus`); None: every GPU of the machine."""

    def __init__(self, nvml: Any = None, cache_seconds: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, visible: tuple[str, ...] | None = None) -> None:
        self._nvml = pynvml if nvml is None else nvml
        self._visible = visible
        self._cache_seconds = cache_seconds
        self._clock = clock
        self._lock = threading.Lock()  # scrapes come from several HTTP server threads at once
        self._cache: list[Metric] = []
        self._cached_at: float | None = None
        self._init_tried_at: float | None = None
        self._up = False
        self._said_unavailable = False
        self._driver = ""
        self._gpus: dict[int, _Gpu] = {}
        self._events: Any = None
        self._warned: set[tuple[object, ...]] = set()

    def utilization(self) -> tuple[int, float]:
        """(GPUs, their mean utilization 0..1) from the readings, refreshing them if stale: it may call NVML,
        so call it off the event loop."""
        samples = [s.value for family in self.collect() if family.name == "tfelastic_gpu_utilization_ratio"
                   for s in family.samples]
        return len(samples), (sum(samples) / len(samples) if samples else 0.0)

    def health_problems(self) -> list[str]:
        """For the node check: a GPU that reported an XID since the last check, has uncorrectable ECC errors
        since the driver loaded, or has retired pages or remapped rows pending (a GPU reset is due). Empty
        without NVML. Calls NVML: call it off the event loop."""
        with self._lock:
            if not self._ensure_nvml(self._clock()):
                return []
            self._drain_xid_events()
            return [f"GPU {gpu.index} ({gpu.labels[1]}): {problem}"
                    for gpu in self._gpus.values() for problem in self._gpu_problems(gpu)]

    def forget_xids(self) -> None:
        """The node's worker ended: XIDs until now belong to that generation's failure, already counted against
        the node. The next check looks only at what comes after (with no trainer running: the GPU itself)."""
        with self._lock:
            if not self._ensure_nvml(self._clock()):
                return
            self._drain_xid_events()
            for gpu in self._gpus.values():
                gpu.xids_at_check = gpu.xids or 0

    def processes(self) -> list[GpuProcess] | None:
        """The processes with a context on the reported GPUs (compute, graphics and MPS), or None where nothing
        can be listed (no NVML, or a driver that lists no kind of process). Calls NVML: call it off the event
        loop."""
        with self._lock:
            if not self._ensure_nvml(self._clock()):
                return None
            found: list[GpuProcess] = []
            listed = False
            for gpu in self._gpus.values():
                for functions in PROCESS_LISTS:
                    processes = self._value(gpu, functions)
                    if processes is not None:
                        listed = True
                        found.extend(GpuProcess(gpu.index, int(p.pid), p.usedGpuMemory) for p in processes)
            return found if listed or not self._gpus else None

    def _gpu_problems(self, gpu: _Gpu) -> list[str]:
        problems = []
        if gpu.xids is not None and gpu.xids > gpu.xids_at_check:
            problems.append(f"{gpu.xids - gpu.xids_at_check} XID error(s) since the last check, the last XID "
                            f"{gpu.last_xid}")
            gpu.xids_at_check = gpu.xids
        uncorrected = self._value(gpu, ("nvmlDeviceGetTotalEccErrors",), pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                  pynvml.NVML_VOLATILE_ECC)
        if uncorrected:
            problems.append(f"{uncorrected} uncorrectable ECC error(s) since the driver loaded: reset the GPU or "
                            "reload the driver, and replace it if they come back")
        if self._value(gpu, ("nvmlDeviceGetRetiredPagesPendingStatus",)):
            problems.append("retired pages pending: reset the GPU")
        remapped = self._value(gpu, ("nvmlDeviceGetRemappedRows",))
        if remapped is not None and remapped[3]:
            problems.append("row remapping failed: the GPU needs service")
        elif remapped is not None and remapped[2]:
            problems.append("row remapping pending: reset the GPU")
        return problems

    def describe(self) -> list[Metric]:
        return []  # do not collect (and touch NVML) at registration

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            now = self._clock()
            if self._cached_at is None or now - self._cached_at >= self._cache_seconds:
                self._cache = self._refresh(now)
                self._cached_at = now
            return iter(self._cache)

    def _refresh(self, now: float) -> list[Metric]:
        if not self._ensure_nvml(now):
            return _health(False, 0)
        self._drain_xid_events()
        families = _Families()
        for gpu in self._gpus.values():
            self._read(gpu, families)
        return [*_health(True, len(self._gpus)), *families.all()]

    # NVML's lifecycle

    def _ensure_nvml(self, now: float) -> bool:
        if self._up:
            return True
        if self._init_tried_at is not None and now - self._init_tried_at < INIT_RETRY_SECONDS:
            return False
        self._init_tried_at = now
        try:
            self._start()
        except pynvml.NVMLError as e:
            if not self._said_unavailable:  # a GPU-less node is normal: one line, not one per retry
                log.info("no GPU metrics: NVML is unavailable (%s); will retry every %.0f s", e, INIT_RETRY_SECONDS)
                self._said_unavailable = True
            return False
        self._up = True
        log.info("GPU metrics: %d GPU(s), driver %s", len(self._gpus), self._driver)
        return True

    def _start(self) -> None:
        self._nvml.nvmlInit()
        try:
            self._discover()
        except pynvml.NVMLError:
            with contextlib.suppress(pynvml.NVMLError):
                self._nvml.nvmlShutdown()  # NVML counts inits: leave it as we found it before the next try
            raise

    def _discover(self) -> None:
        self._driver = _text(self._nvml.nvmlSystemGetDriverVersion())
        gpus = (self._open(index) for index in range(self._nvml.nvmlDeviceGetCount()))
        self._gpus = {gpu.index: gpu for gpu in gpus if gpu is not None and _is_visible(gpu, self._visible)}
        self._register_xid_events()

    def _open(self, index: int) -> _Gpu | None:
        try:
            handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
            uuid, name = self._nvml.nvmlDeviceGetUUID(handle), self._nvml.nvmlDeviceGetName(handle)
        except pynvml.NVMLError as e:  # a lost GPU must not hide the others
            log.warning("GPU %d: no metrics, NVML cannot open it: %s", index, e)
            return None
        return _Gpu(index, handle, (str(index), _text(uuid), _text(name)))

    # XID events

    def _register_xid_events(self) -> None:
        try:
            self._events = self._nvml.nvmlEventSetCreate()
        except pynvml.NVMLError as e:
            log.info("no XID metrics: NVML event sets are unavailable (%s)", e)
            return
        for gpu in self._gpus.values():
            try:
                self._nvml.nvmlDeviceRegisterEvents(gpu.handle, pynvml.nvmlEventTypeXidCriticalError, self._events)
                gpu.xids = 0
            except pynvml.NVMLError as e:
                log.info("GPU %d: no XID metrics: %s", gpu.index, e)

    def _drain_xid_events(self) -> None:
        if not any(gpu.xids is not None for gpu in self._gpus.values()):
            return
        for _ in range(MAX_EVENTS_PER_REFRESH):
            try:
                event = self._nvml.nvmlEventSetWait(self._events, 0)
            except pynvml.NVMLError_Timeout:
                return  # NVML says the queue is empty by timing out
            except pynvml.NVMLError as e:
                self._warn_once(("events", type(e)), "waiting on NVML events failed: %s", e)
                return
            self._count_xid(event)

    def _count_xid(self, event: Any) -> None:
        if not event.eventType & pynvml.nvmlEventTypeXidCriticalError:
            return
        try:  # event.device is a fresh handle: ctypes handles compare by identity, so ask NVML whose it is
            gpu = self._gpus.get(self._nvml.nvmlDeviceGetIndex(event.device))
        except pynvml.NVMLError as e:
            self._warn_once(("xid", type(e)), "an XID event of an unknown GPU: %s", e)
            return
        if gpu is not None and gpu.xids is not None:
            gpu.xids += 1
            gpu.last_xid = int(event.eventData)

    # Readings

    def _read(self, gpu: _Gpu, out: _Families) -> None:
        out.gauge("tfelastic_gpu_info", "The GPU and its driver; always 1.", gpu, 1, driver_version=self._driver)
        self._read_utilization(gpu, out)
        self._read_memory(gpu, out)
        for name, doc, functions, args, factor in SCALARS:
            value = self._value(gpu, functions, *args)
            if value is not None:
                out.gauge(name, doc, gpu, value * factor)
        self._read_ecc(gpu, out)
        self._read_throttle_reasons(gpu, out)
        if gpu.xids is not None:
            out.counter("tfelastic_gpu_xid_errors_total", "XID errors reported since the collector started.", gpu,
                        gpu.xids)
            out.gauge("tfelastic_gpu_last_xid", "Code of the last XID error since the collector started; 0: none.",
                      gpu, gpu.last_xid)

    def _read_utilization(self, gpu: _Gpu, out: _Families) -> None:
        rates = self._value(gpu, ("nvmlDeviceGetUtilizationRates",))
        if rates is not None:
            out.gauge("tfelastic_gpu_utilization_ratio", "Fraction of the last sample period a kernel was running.",
                      gpu, rates.gpu / 100)
            out.gauge("tfelastic_gpu_memory_utilization_ratio",
                      "Fraction of the last sample period device memory was being read or written.", gpu,
                      rates.memory / 100)

    def _read_memory(self, gpu: _Gpu, out: _Families) -> None:
        memory = self._value(gpu, ("nvmlDeviceGetMemoryInfo",))
        if memory is not None:
            out.gauge("tfelastic_gpu_memory_used_bytes", "Device memory allocated, driver's reservation included.",
                      gpu, memory.used)
            out.gauge("tfelastic_gpu_memory_total_bytes", "Device memory.", gpu, memory.total)

    def _read_ecc(self, gpu: _Gpu, out: _Families) -> None:
        for kind, error_type in ECC_TYPES:
            count = self._value(gpu, ("nvmlDeviceGetTotalEccErrors",), error_type, pynvml.NVML_VOLATILE_ECC)
            if count is not None:
                out.counter("tfelastic_gpu_ecc_errors_total", "ECC errors since the driver was loaded (volatile).",
                            gpu, count, type=kind)

    def _read_throttle_reasons(self, gpu: _Gpu, out: _Families) -> None:
        mask = self._value(gpu, CLOCK_EVENT_REASONS)
        if mask is not None:
            for reason, bit in THROTTLE_REASONS:
                out.gauge("tfelastic_gpu_throttle_reason", "1 while this reason holds the clocks down, else 0.", gpu,
                          1 if mask & bit else 0, reason=reason)

    def _value(self, gpu: _Gpu, functions: tuple[str, ...], *args: int) -> Any:
        """The first of ``functions`` the library has, called on ``gpu``; None where NVML cannot tell."""
        try:
            return self._call_first(functions, gpu.handle, *args)
        except pynvml.NVMLError_NotSupported:
            return None
        except pynvml.NVMLError as e:  # GPU lost, no permission...: omit rather than invent
            self._warn_once((gpu.index, functions[0], type(e)), "GPU %d: %s failed: %s", gpu.index, functions[0], e)
            return None

    def _call_first(self, functions: tuple[str, ...], *args: Any) -> Any:
        for function in functions:
            call = getattr(self._nvml, function, None)
            if call is None:
                continue  # a pynvml release without this binding
            try:
                return call(*args)
            except pynvml.NVMLError_FunctionNotFound:
                continue  # a driver without this function
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def _warn_once(self, key: tuple[object, ...], message: str, *args: object) -> None:
        if key not in self._warned:  # a failing GPU would otherwise log on every refresh
            self._warned.add(key)
            log.warning(message, *args)


def _health(up: bool, gpus: int) -> list[Metric]:
    return [GaugeMetricFamily("tfelastic_gpu_nvml_up", "1 if NVML is initialised, else 0.", value=1 if up else 0),
            GaugeMetricFamily("tfelastic_gpus", "GPUs this collector reports on.", value=gpus)]


def visible_gpus(cuda_visible_devices: str | None) -> tuple[str, ...] | None:
    """The GPUs CUDA_VISIBLE_DEVICES leaves a trainer, as NVML indices or UUID prefixes; None: all of them.

    With several agents on one node (SLURM tasks), each then reports only its own trainer's GPUs. Indices match
    NVML's when CUDA orders GPUs like NVML (PCI bus order: identical GPUs, or CUDA_DEVICE_ORDER=PCI_BUS_ID). MIG
    instances are not NVML devices: with one in the list, every GPU is reported.
    """
    if cuda_visible_devices is None:
        return None
    wanted: list[str] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if entry.startswith("MIG-"):
            return None
        if entry.isascii() and entry.isdigit():
            wanted.append(str(int(entry)))
        elif entry.startswith("GPU-"):
            wanted.append(entry)
        else:
            break  # CUDA ignores the list from its first invalid entry on ("-1" hides every GPU)
    return tuple(wanted)


def _is_visible(gpu: _Gpu, visible: tuple[str, ...] | None) -> bool:
    index, uuid, _ = gpu.labels
    return visible is None or any(v == index or (v.startswith("GPU-") and uuid.startswith(v)) for v in visible)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value  # older nvidia-ml-py releases returned bytes


def register_gpu_collector(registry: CollectorRegistry, **kwargs: Any) -> GpuCollector:
    collector = GpuCollector(**kwargs)
    registry.register(collector)
    return collector
