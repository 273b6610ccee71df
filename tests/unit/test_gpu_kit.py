"""The GPU kit's comparison with nvidia-smi (bench/gpu_kit.py), on readings given here: what agrees, what is "not
supported", what fails. nvidia-smi is a FAKE (a script that answers its query, for hardware we lack), standing
for an older driver's that does not know some fields. The whole kit runs in tests/integration/test_gpu_kit.py."""

from __future__ import annotations

import os
import stat
import sys
import textwrap
from pathlib import Path

from bench.gpu_kit import SMI_FIELDS, SMI_OPTIONAL, NvidiaSmi, Tolerance, compare, requirements

MIB = 2**20
SMI = {"memory.total": "81559", "memory.used": "9000", "memory.reserved": "511", "utilization.gpu": "97",
       "temperature.gpu": "51", "power.draw": "612.40", "power.draw.average": "[N/A]", "clocks.sm": "1755",
       "ecc.errors.corrected.volatile.total": "0", "ecc.errors.uncorrected.volatile.total": "0"}
OURS = {"tfelastic_gpu_memory_total_bytes": 81559 * MIB, "tfelastic_gpu_memory_used_bytes": 9511 * MIB,
        "tfelastic_gpu_utilization_ratio": 0.98, "tfelastic_gpu_temperature_celsius": 52.0,
        "tfelastic_gpu_power_watts": 640.0, "tfelastic_gpu_sm_clock_hertz": 1755e6,
        "tfelastic_gpu_ecc_errors_total:corrected": 0.0, "tfelastic_gpu_ecc_errors_total:uncorrected": 0.0}


def test_a_reading_agrees_within_its_tolerance_of_the_two_nvidia_smi_readings_around_it() -> None:
    power = Tolerance(30, 0.15)
    assert power.allows(700, 600, 650)  # 650 + 15 % of 650
    assert not power.allows(760, 600, 650)
    assert power.allows(100, 90, 95)  # 95 + 30 W: the absolute bound is the larger
    assert Tolerance(0).allows(3, 3, 3) and not Tolerance(0).allows(4, 3, 3)


def test_every_reading_is_compared_with_the_field_that_agrees() -> None:
    fields = compare(OURS, SMI, SMI)
    assert all(f["ok"] for f in fields.values()), fields
    # NVML's v1 memory used counts the driver's reservation; this nvidia-smi reports it apart
    assert fields["memory_used_mib"]["nvidia_smi_field"] == "memory.used+memory.reserved"
    assert fields["power_watts"]["nvidia_smi_field"] == "power.draw"  # the average is [N/A] here


def test_a_reading_the_driver_gives_and_the_collector_lacks_fails() -> None:
    ours = {k: v for k, v in OURS.items() if k != "tfelastic_gpu_temperature_celsius"}
    assert compare(ours, SMI, SMI)["temperature_celsius"] == {
        "ours": None, "tolerance": "±3", "nvidia_smi": 51.0, "ok": False,
        "note": "the driver gives it, the collector does not"}


def test_a_reading_the_driver_does_not_support_is_said_so() -> None:
    no_ecc = dict(SMI, **{"ecc.errors.corrected.volatile.total": "[N/A]"})
    ours = {k: v for k, v in OURS.items() if k != "tfelastic_gpu_ecc_errors_total:corrected"}
    field = compare(ours, no_ecc, no_ecc)["ecc_corrected_volatile"]
    assert (field["ok"], field["nvidia_smi"], field["note"]) == (True, "not supported", "not supported by the driver")


def test_a_reading_that_disagrees_fails() -> None:
    assert not compare(dict(OURS, tfelastic_gpu_sm_clock_hertz=1200e6), SMI, SMI)["sm_clock_mhz"]["ok"]


def test_fields_an_older_nvidia_smi_does_not_know_are_left_out(tmp_path: Path) -> None:
    script = tmp_path / "nvidia-smi"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import sys
        fields = sys.argv[1].removeprefix("--query-gpu=").split(",")
        if "clocks_event_reasons.active" in fields:
            sys.exit('Field "clocks_event_reasons.active" is not a valid field to query.')
        print(", ".join("0" for _ in fields))
    """))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    smi = NvidiaSmi([str(script)], dict(os.environ))
    assert smi.fields == [*SMI_FIELDS, *(f for f in SMI_OPTIONAL if f != "clocks_event_reasons.active")]
    assert smi.query()["0"]["clocks_throttle_reasons.active"] == "0"


def test_the_kit_asks_for_the_floors_pyproject_declares(tmp_path: Path) -> None:
    """Not floors of its own, which went stale once already (the generated code's grpcio moved)."""
    floors = {distribution: lowest for _, distribution, lowest in requirements()}
    assert floors["grpcio"] == "1.65.5" and floors["protobuf"] == "4.21.6", floors  # pyproject.toml today
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["grpcio>=9.1", "grpcio-health-checking>=9.1", '
                         '"protobuf>=9.2,<10", "psutil>=9", "prometheus-client>=9", "nvidia-ml-py>=9"]\n')
    assert dict((d, v) for _, d, v in requirements(pyproject))["protobuf"] == "9.2"
    assert ("google.protobuf", "protobuf", "9.2") in requirements(pyproject)
