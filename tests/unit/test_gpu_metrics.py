"""GpuCollector against FakeNvml (a fake for hardware we lack), and against the real pynvml on a GPU-less machine.

Each test scrapes a fresh CollectorRegistry; get_sample_value is itself a scrape, read from the collector's cache
while the fake clock stands still.
"""

from __future__ import annotations

import ctypes
import json
import logging
import re
import shutil
import subprocess
import threading
from pathlib import Path

import pynvml  # type: ignore[import-untyped]
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from tfelastic.daemon.metrics.gpu import (
    INIT_RETRY_SECONDS,
    MAX_EVENTS_PER_REFRESH,
    PROCESS_LISTS,
    THROTTLE_REASONS,
    GpuCollector,
    GpuProcess,
    register_gpu_collector,
)

from tests.fakes import FakeClock
from tests.nvml_fake import FakeGpu, FakeGpuProcess, FakeNvml

GIB = 2**30
DOC = Path(__file__).resolve().parents[2] / "docs" / "gpu-metrics.md"
LOGGER = "tfelastic.metrics.gpu"


def registry_for(nvml: FakeNvml, cache_seconds: float = 5.0) -> tuple[CollectorRegistry, FakeClock]:
    registry, clock = CollectorRegistry(), FakeClock(1000.0)
    register_gpu_collector(registry, nvml=nvml, cache_seconds=cache_seconds, clock=clock)
    return registry, clock


def labels(nvml: FakeNvml, index: int, **extra: str) -> dict[str, str]:
    gpu = nvml.gpus[index]
    return {"gpu": str(index), "uuid": gpu.uuid, "name": gpu.name, **extra}


def per_gpu_sample_names(registry: CollectorRegistry) -> set[str]:
    return {s.name for family in registry.collect() for s in family.samples if "gpu" in s.labels}


def all_sample_names(registry: CollectorRegistry) -> set[str]:
    return {s.name for family in registry.collect() for s in family.samples}


def records(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= level]


# Readings, units and labels


def test_readings_are_in_base_units() -> None:
    nvml = FakeNvml([FakeGpu(utilization=87, memory_utilization=33, memory_used=12 * GIB, memory_total=80 * GIB,
                             temperature=61, power_mw=312_500, sm_clock_mhz=1755)])
    registry, _ = registry_for(nvml)
    value, gpu0 = registry.get_sample_value, labels(nvml, 0)
    assert value("tfelastic_gpu_nvml_up") == 1 and value("tfelastic_gpus") == 1
    assert value("tfelastic_gpu_utilization_ratio", gpu0) == 0.87
    assert value("tfelastic_gpu_memory_utilization_ratio", gpu0) == 0.33
    assert value("tfelastic_gpu_memory_used_bytes", gpu0) == 12 * GIB
    assert value("tfelastic_gpu_memory_total_bytes", gpu0) == 80 * GIB
    assert value("tfelastic_gpu_temperature_celsius", gpu0) == 61
    assert value("tfelastic_gpu_power_watts", gpu0) == 312.5
    assert value("tfelastic_gpu_sm_clock_hertz", gpu0) == 1_755_000_000
    assert value("tfelastic_gpu_info", labels(nvml, 0, driver_version="550.54.15")) == 1


def test_each_gpu_has_its_own_labels() -> None:
    nvml = FakeNvml([FakeGpu(name=f"NVIDIA A100-SXM4-{i}", temperature=30 + i) for i in range(8)])
    registry, _ = registry_for(nvml)
    assert registry.get_sample_value("tfelastic_gpus") == 8
    assert len({nvml.gpus[i].uuid for i in range(8)}) == 8
    for i in range(8):
        assert registry.get_sample_value("tfelastic_gpu_temperature_celsius", labels(nvml, i)) == 30 + i


def test_ecc_counters_are_the_volatile_ones() -> None:
    nvml = FakeNvml([FakeGpu(ecc_volatile=(3, 1), ecc_aggregate=(30, 10))])
    registry, _ = registry_for(nvml)
    value = registry.get_sample_value
    assert value("tfelastic_gpu_ecc_errors_total", labels(nvml, 0, type="corrected")) == 3
    assert value("tfelastic_gpu_ecc_errors_total", labels(nvml, 0, type="uncorrected")) == 1


def test_throttle_reasons_are_decoded_from_the_bit_mask() -> None:
    nvml = FakeNvml([FakeGpu(clocks_event_reasons=0x4 | 0x40)])
    registry, _ = registry_for(nvml)
    decoded = {reason: registry.get_sample_value("tfelastic_gpu_throttle_reason", labels(nvml, 0, reason=reason))
               for reason, _ in THROTTLE_REASONS}
    assert decoded == {reason: (1.0 if reason in ("sw_power_cap", "hw_thermal_slowdown") else 0.0)
                       for reason, _ in THROTTLE_REASONS}


def test_throttle_reason_bits_are_nvmls() -> None:
    for reason, bit in THROTTLE_REASONS:
        camel = "".join(word.capitalize() for word in reason.split("_"))
        assert getattr(pynvml, f"nvmlClocksEventReason{camel}") == bit, reason
        assert getattr(pynvml, f"nvmlClocksThrottleReason{camel}") == bit, reason


# What NVML cannot tell


def test_a_metric_not_supported_is_omitted_for_that_gpu_only(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    unsupported = ("nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetCurrentClocksEventReasons",
                   "nvmlDeviceGetCurrentClocksThrottleReasons")
    nvml = FakeNvml([FakeGpu().unsupported(*unsupported), FakeGpu()])
    registry, _ = registry_for(nvml)
    value = registry.get_sample_value
    assert value("tfelastic_gpu_power_watts", labels(nvml, 0)) is None
    assert value("tfelastic_gpu_ecc_errors_total", labels(nvml, 0, type="corrected")) is None
    assert value("tfelastic_gpu_throttle_reason", labels(nvml, 0, reason="gpu_idle")) is None
    assert value("tfelastic_gpu_temperature_celsius", labels(nvml, 0)) == 40
    assert value("tfelastic_gpu_power_watts", labels(nvml, 1)) == 250
    assert value("tfelastic_gpu_ecc_errors_total", labels(nvml, 1, type="corrected")) == 0
    assert value("tfelastic_gpu_throttle_reason", labels(nvml, 1, reason="gpu_idle")) == 0
    assert not records(caplog, logging.WARNING)  # not supported is a fact about the GPU, not a fault


def test_a_metric_no_gpu_supports_is_not_exposed() -> None:
    nvml = FakeNvml([FakeGpu().unsupported("nvmlDeviceGetPowerUsage") for _ in range(2)])
    registry, _ = registry_for(nvml)
    assert "tfelastic_gpu_power_watts" not in generate_latest(registry).decode()


def test_functions_an_old_driver_lacks_fall_back_to_their_older_names() -> None:
    nvml = FakeNvml([FakeGpu(clocks_event_reasons=0x8)])
    nvml.missing = {"nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage"}
    registry, _ = registry_for(nvml)
    value = registry.get_sample_value
    assert value("tfelastic_gpu_throttle_reason", labels(nvml, 0, reason="hw_slowdown")) == 1
    assert value("tfelastic_gpu_temperature_celsius", labels(nvml, 0)) == 40  # through nvmlDeviceGetTemperatureV
    assert value("tfelastic_gpu_power_watts", labels(nvml, 0)) is None  # no older name: omitted
    assert nvml.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 1


def test_other_nvml_errors_omit_the_metric_and_warn_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    nvml = FakeNvml([FakeGpu(errors={"nvmlDeviceGetPowerUsage": pynvml.NVML_ERROR_GPU_IS_LOST}), FakeGpu()])
    registry, clock = registry_for(nvml)
    for _ in range(3):
        assert registry.get_sample_value("tfelastic_gpu_power_watts", labels(nvml, 0)) is None
        assert registry.get_sample_value("tfelastic_gpu_power_watts", labels(nvml, 1)) == 250
        clock.now += 10
    assert nvml.calls["nvmlDeviceGetPowerUsage"] == 6
    assert [r.getMessage() for r in records(caplog, logging.WARNING)] == [
        "GPU 0: nvmlDeviceGetPowerUsage failed: GPU is lost"]


def test_a_gpu_nvml_cannot_open_is_left_out(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    nvml = FakeNvml([FakeGpu(), FakeGpu(errors={"nvmlDeviceGetUUID": pynvml.NVML_ERROR_GPU_IS_LOST}), FakeGpu()])
    registry, _ = registry_for(nvml)
    assert registry.get_sample_value("tfelastic_gpus") == 2
    assert registry.get_sample_value("tfelastic_gpu_temperature_celsius", labels(nvml, 2)) == 40
    assert {s.labels["gpu"] for f in registry.collect() for s in f.samples if "gpu" in s.labels} == {"0", "2"}
    assert len(records(caplog, logging.WARNING)) == 1


# Without a driver


def test_without_a_driver_only_the_health_gauges_say_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    nvml = FakeNvml(2, init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    registry, clock = registry_for(nvml)
    for _ in range(4):
        assert registry.get_sample_value("tfelastic_gpu_nvml_up") == 0
        assert registry.get_sample_value("tfelastic_gpus") == 0
        assert all_sample_names(registry) == {"tfelastic_gpu_nvml_up", "tfelastic_gpus"}
        clock.now += 10
    assert nvml.calls == {"nvmlInit": 1}
    assert [r.getMessage() for r in records(caplog)] == [
        "no GPU metrics: NVML is unavailable (NVML Shared Library Not Found); will retry every 60 s"]


def test_init_is_retried_at_most_once_a_minute_and_a_late_driver_is_picked_up(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    nvml = FakeNvml(1, init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    registry, clock = registry_for(nvml)
    start = clock.now
    up = registry.get_sample_value
    for offset, inits, value in [(0, 1, 0), (30, 1, 0), (INIT_RETRY_SECONDS, 2, 0), (90, 2, 0), (150, 3, 1)]:
        if offset == 90:
            nvml.init_error = None  # the driver got loaded
        clock.now = start + offset
        assert (up("tfelastic_gpu_nvml_up"), nvml.calls["nvmlInit"]) == (value, inits), offset
    assert up("tfelastic_gpus") == 1
    unavailable = [r for r in records(caplog) if "unavailable" in r.getMessage()]
    assert len(unavailable) == 1


def test_a_failed_discovery_leaves_nvml_shut_down() -> None:
    nvml = FakeNvml(1)
    nvml.missing = {"nvmlDeviceGetCount"}
    registry, _ = registry_for(nvml)
    assert registry.get_sample_value("tfelastic_gpu_nvml_up") == 0
    assert nvml.inits == 0 and nvml.calls["nvmlShutdown"] == 1


# Cost of a scrape


def test_registration_does_not_touch_nvml() -> None:
    nvml = FakeNvml(1)
    registry_for(nvml)
    assert nvml.total_calls == 0


def test_scrapes_within_the_interval_read_the_cache() -> None:
    nvml = FakeNvml(2)
    registry, clock = registry_for(nvml, cache_seconds=5.0)
    generate_latest(registry)
    first = nvml.total_calls
    assert first > 0
    nvml.gpus[0].temperature = 77
    clock.now += 4.9
    generate_latest(registry)
    assert registry.get_sample_value("tfelastic_gpu_temperature_celsius", labels(nvml, 0)) == 40
    assert nvml.total_calls == first
    clock.now += 0.1
    assert registry.get_sample_value("tfelastic_gpu_temperature_celsius", labels(nvml, 0)) == 77
    assert nvml.calls["nvmlInit"] == 1 and nvml.total_calls > first


def test_concurrent_scrapes_reach_nvml_once() -> None:
    reference = FakeNvml(8)
    generate_latest(registry_for(reference)[0])
    nvml = FakeNvml(8)
    nvml.latency = 0.001
    registry, _ = registry_for(nvml)
    barrier = threading.Barrier(8)
    texts: list[bytes] = []

    def scrape() -> None:
        barrier.wait()
        texts.append(generate_latest(registry))

    threads = [threading.Thread(target=scrape) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(texts) == 8 and len(set(texts)) == 1
    assert nvml.calls == reference.calls


# XID events


def test_xid_events_are_counted_since_the_collector_started() -> None:
    nvml = FakeNvml(2)
    registry, clock = registry_for(nvml)
    value = registry.get_sample_value
    assert value("tfelastic_gpu_xid_errors_total", labels(nvml, 1)) == 0
    assert value("tfelastic_gpu_last_xid", labels(nvml, 1)) == 0
    nvml.xid(1, 79)
    nvml.xid(1, 48)
    assert value("tfelastic_gpu_xid_errors_total", labels(nvml, 1)) == 0  # cached
    clock.now += 5
    assert (value("tfelastic_gpu_xid_errors_total", labels(nvml, 1)), value("tfelastic_gpu_last_xid", labels(nvml, 1))
            ) == (2, 48)
    assert (value("tfelastic_gpu_xid_errors_total", labels(nvml, 0)), value("tfelastic_gpu_last_xid", labels(nvml, 0))
            ) == (0, 0)
    assert set(nvml.wait_timeouts) == {0}  # never blocks a scrape


def test_xid_metrics_are_omitted_where_events_are_not_supported() -> None:
    nvml = FakeNvml([FakeGpu().unsupported("nvmlDeviceRegisterEvents"), FakeGpu()])
    registry, _ = registry_for(nvml)
    assert registry.get_sample_value("tfelastic_gpu_xid_errors_total", labels(nvml, 0)) is None
    assert registry.get_sample_value("tfelastic_gpu_last_xid", labels(nvml, 0)) is None
    assert registry.get_sample_value("tfelastic_gpu_xid_errors_total", labels(nvml, 1)) == 0


def test_without_event_sets_there_are_no_xid_metrics() -> None:
    nvml = FakeNvml(2)
    nvml.event_set_error = pynvml.NVML_ERROR_NOT_SUPPORTED
    registry, _ = registry_for(nvml)
    names = per_gpu_sample_names(registry)
    assert "tfelastic_gpu_temperature_celsius" in names
    assert not {"tfelastic_gpu_xid_errors_total", "tfelastic_gpu_last_xid"} & names
    assert nvml.calls["nvmlEventSetWait"] == 0


def test_an_xid_storm_is_drained_over_several_refreshes() -> None:
    nvml = FakeNvml(1)
    registry, clock = registry_for(nvml)
    generate_latest(registry)
    for i in range(MAX_EVENTS_PER_REFRESH + 10):
        nvml.xid(0, 13 + i % 2)
    clock.now += 5
    assert registry.get_sample_value("tfelastic_gpu_xid_errors_total", labels(nvml, 0)) == MAX_EVENTS_PER_REFRESH
    clock.now += 5
    assert registry.get_sample_value("tfelastic_gpu_xid_errors_total", labels(nvml, 0)) == MAX_EVENTS_PER_REFRESH + 10


# Processes on the GPUs (the GPU release check, agent/node.py)


def test_processes_of_every_kind_are_listed_with_their_gpu_and_memory() -> None:
    nvml = FakeNvml([FakeGpu(processes=[FakeGpuProcess(101, 3 * GIB)]),
                     FakeGpu(processes=[FakeGpuProcess(102, None)], graphics_processes=[FakeGpuProcess(103, GIB)])])
    collector = GpuCollector(nvml=nvml, clock=FakeClock())
    assert collector.processes() == [GpuProcess(0, 101, 3 * GIB), GpuProcess(1, 102, None), GpuProcess(1, 103, GIB)]
    assert nvml.calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 2


def test_a_process_is_listed_until_its_memory_is_given_back() -> None:
    nvml = FakeNvml([FakeGpu(processes=[FakeGpuProcess(101, frees_at=0.0), FakeGpuProcess(102)])])
    assert GpuCollector(nvml=nvml, clock=FakeClock()).processes() == [GpuProcess(0, 102, 4 * GIB)]


def test_an_old_driver_lists_processes_through_the_older_call() -> None:
    nvml = FakeNvml([FakeGpu(processes=[FakeGpuProcess(101)])])
    nvml.missing.add("nvmlDeviceGetComputeRunningProcesses_v3")
    assert GpuCollector(nvml=nvml, clock=FakeClock()).processes() == [GpuProcess(0, 101, 4 * GIB)]
    assert nvml.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 1


def test_the_process_lists_are_functions_of_pynvml() -> None:
    assert [name for names in PROCESS_LISTS for name in names if not hasattr(pynvml, name)] == []


def test_processes_are_none_where_nothing_can_be_listed() -> None:
    assert GpuCollector(nvml=FakeNvml(1, init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND),
                        clock=FakeClock()).processes() is None
    gpu = FakeGpu(processes=[FakeGpuProcess(101)]).unsupported("nvmlDeviceGetComputeRunningProcesses_v3",
                                                                "nvmlDeviceGetGraphicsRunningProcesses_v3")
    assert GpuCollector(nvml=FakeNvml([gpu]), clock=FakeClock()).processes() is None
    assert GpuCollector(nvml=FakeNvml(0), clock=FakeClock()).processes() == []  # no GPU: nothing is held


# The real library, and promtool


def _driver_loadable() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def test_the_real_pynvml_without_a_driver_reports_nvml_down() -> None:
    registry = CollectorRegistry()
    register_gpu_collector(registry)
    text = generate_latest(registry).decode()  # must not raise, driver or not
    up, gpus = registry.get_sample_value("tfelastic_gpu_nvml_up"), registry.get_sample_value("tfelastic_gpus")
    if _driver_loadable():
        assert up in (0, 1), text
    else:
        assert (up, gpus) == (0, 0), text
        assert all_sample_names(registry) == {"tfelastic_gpu_nvml_up", "tfelastic_gpus"}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus) is not installed")
@pytest.mark.parametrize("driver", [True, False], ids=["gpus", "no-driver"])
def test_promtool_finds_nothing_to_complain_about(driver: bool) -> None:
    nvml = FakeNvml([FakeGpu(clocks_event_reasons=0x1, ecc_volatile=(2, 0)), FakeGpu()],
                    init_error=None if driver else pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    registry, clock = registry_for(nvml)
    generate_latest(registry)
    nvml.xid(0, 31)
    clock.now += 5
    text = generate_latest(registry).decode()
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert check.returncode == 0 and check.stdout == "" and check.stderr == "", check.stdout + check.stderr


# The documented recording rules: DCGM's names and units from ours

RULE_INPUTS = {
    "tfelastic_gpu_utilization_ratio": 0.87, "tfelastic_gpu_memory_utilization_ratio": 0.25,
    "tfelastic_gpu_memory_used_bytes": 12 * GIB, "tfelastic_gpu_memory_total_bytes": 80 * GIB,
    "tfelastic_gpu_temperature_celsius": 61, "tfelastic_gpu_power_watts": 312.5,
    "tfelastic_gpu_sm_clock_hertz": 1_755_000_000, "tfelastic_gpu_last_xid": 79,
}
DCGM_EXPECTED = {
    "DCGM_FI_DEV_GPU_UTIL": 87, "DCGM_FI_DEV_MEM_COPY_UTIL": 25, "DCGM_FI_DEV_FB_USED": 12 * 1024,
    "DCGM_FI_DEV_FB_FREE": 68 * 1024, "DCGM_FI_DEV_GPU_TEMP": 61, "DCGM_FI_DEV_POWER_USAGE": 312.5,
    "DCGM_FI_DEV_SM_CLOCK": 1755, "DCGM_FI_DEV_XID_ERRORS": 79, "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": 3,
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 1, "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": 0x4 | 0x40,
}


def _rule_test(rules: Path) -> dict[str, object]:
    """A promtool rule test (JSON is YAML) feeding one GPU's series to the documented rules."""
    gpu = 'gpu="0",uuid="GPU-a",name="NVIDIA H100",instance="n1:9400",job="node"'
    inputs = [(name, "", value) for name, value in RULE_INPUTS.items()]
    inputs += [("tfelastic_gpu_ecc_errors_total", 'type="corrected",', 3),
               ("tfelastic_gpu_ecc_errors_total", 'type="uncorrected",', 1)]
    active = ("sw_power_cap", "hw_thermal_slowdown")
    inputs += [("tfelastic_gpu_throttle_reason", f'reason="{reason}",', int(reason in active))
               for reason, _ in THROTTLE_REASONS]
    series = [{"series": f"{name}{{{extra}{gpu}}}", "values": f"{value} {value}"} for name, extra, value in inputs]
    expected = [{"expr": name, "eval_time": "1m", "exp_samples": [
        {"labels": f'{name}{{{gpu},UUID="GPU-a",modelName="NVIDIA H100"}}', "value": value}]}
        for name, value in DCGM_EXPECTED.items()]
    return {"rule_files": [str(rules)], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": expected}]}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus) is not installed")
def test_the_documented_recording_rules_give_dcgm_names_and_units(tmp_path: Path) -> None:
    match = re.search(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    assert match, "no recording rules in docs/gpu-metrics.md"
    rules, test = tmp_path / "rules.yml", tmp_path / "test.yml"
    rules.write_text(match.group(1))
    test.write_text(json.dumps(_rule_test(rules)))
    check = subprocess.run(["promtool", "test", "rules", str(test)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_collect_is_an_iterable_of_families_for_the_registry() -> None:
    collector = GpuCollector(nvml=FakeNvml(1), clock=FakeClock())
    assert collector.describe() == []
    assert {family.name for family in collector.collect()} >= {"tfelastic_gpu_nvml_up", "tfelastic_gpu_ecc_errors"}
