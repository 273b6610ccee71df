"""The agent's node check (:mod:`tfelastic.daemon.agent.nodecheck`): the backup directory on a real filesystem,
the GPU health with NVML's named fake (tests/nvml_fake.py: these machines have no GPU), and the probe listener.
The matmul subprocess runs with real TensorFlow in tests/integration/test_node_check.py."""

from __future__ import annotations

import logging
import os
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pynvml  # type: ignore[import-untyped]
import pytest
from tfelastic.daemon.agent.nodecheck import NO_TENSORFLOW, NodeCheck, PortListener
from tfelastic.daemon.metrics.gpu import GpuCollector

from tests.nvml_fake import FakeGpu, FakeNvml
from tests.ports import free_port


def test_a_writable_backup_dir_with_room_passes_and_is_created_if_missing(tmp_path: Path) -> None:
    backup = tmp_path / "backup" / "job"
    check = NodeCheck(str(backup), "n1", min_free_bytes=1)
    assert check.run() == ""
    assert backup.is_dir() and list(backup.iterdir()) == []  # the probe file is gone again


def test_a_backup_dir_that_cannot_be_written_fails_the_check(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    check = NodeCheck(str(tmp_path / "file" / "backup"), "n1", min_free_bytes=1)
    assert check.run() == f"backup dir {tmp_path}/file/backup is not writable: Not a directory"


def test_a_backup_dir_without_room_for_a_checkpoint_fails_the_check(tmp_path: Path) -> None:
    stat = os.statvfs(tmp_path)
    free_mib = stat.f_bavail * stat.f_frsize / 2**20
    check = NodeCheck(str(tmp_path), "n1", min_free_bytes=1 << 60)
    problem = check.run()
    assert problem.startswith(f"backup dir {tmp_path} has ")
    assert abs(float(problem.split(" has ")[1].split(" MiB")[0]) - free_mib) < 64
    assert problem.endswith(f"MiB free, less than the {2**40:.0f} MiB a checkpoint needs")


def gpu_check(nvml: FakeNvml) -> tuple[NodeCheck, GpuCollector]:
    collector = GpuCollector(nvml=nvml, cache_seconds=0.0)
    return NodeCheck("", "n1", gpu_problems=collector.health_problems, gpu_count=lambda: 0), collector


def test_healthy_gpus_pass() -> None:
    check, _ = gpu_check(FakeNvml(2))
    assert check.run() == ""


def test_a_new_xid_fails_one_check_and_is_not_counted_again() -> None:
    nvml = FakeNvml(2)
    check, _ = gpu_check(nvml)
    assert check.run() == ""  # registers for XID events
    nvml.xid(1, 79)  # GPU has fallen off the bus
    assert check.run() == ("GPU 1 (GPU-00000000-0000-0000-0000-000000000001): 1 XID error(s) since the last check, "
                           "the last XID 79")
    assert check.run() == ""


def test_xids_of_a_generation_that_already_failed_do_not_fail_the_next_check() -> None:
    nvml = FakeNvml(1)
    check, collector = gpu_check(nvml)
    check.run()
    nvml.xid(0, 31)  # the failing trainer's illegal memory access
    collector.forget_xids()  # its worker stopped: that failure was already counted against the node
    assert check.run() == ""
    nvml.xid(0, 79)  # with no trainer running: the GPU itself
    assert "the last XID 79" in check.run()


def test_two_checks_at_once_do_not_trip_over_each_others_probe_file(tmp_path: Path) -> None:
    check = NodeCheck(str(tmp_path), "n1", min_free_bytes=1)
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(lambda _: check.backup_dir_problems(), range(64))) == [[]] * 64


def test_an_xid_drained_by_a_scrape_still_fails_the_next_check() -> None:
    nvml = FakeNvml(1)
    check, collector = gpu_check(nvml)
    check.run()
    nvml.xid(0, 48)
    list(collector.collect())  # a Prometheus scrape reads the event first
    assert "1 XID error(s) since the last check, the last XID 48" in check.run()


@pytest.mark.parametrize(("gpu", "problem"), [
    (FakeGpu(ecc_volatile=(5, 2)), "2 uncorrectable ECC error(s) since the driver loaded: reset the GPU or reload the "
                                   "driver, and replace it if they come back"),
    (FakeGpu(retired_pages_pending=1), "retired pages pending: reset the GPU"),
    (FakeGpu(remapped_rows=(0, 1, 1, 0)), "row remapping pending: reset the GPU"),
    (FakeGpu(remapped_rows=(0, 1, 0, 1)), "row remapping failed: the GPU needs service"),
])
def test_a_gpu_in_trouble_fails_the_check(gpu: FakeGpu, problem: str) -> None:
    check, _ = gpu_check(FakeNvml([FakeGpu(), gpu]))
    assert check.run() == f"GPU 1 (GPU-00000000-0000-0000-0000-000000000001): {problem}"


def test_gpus_that_cannot_tell_pass() -> None:
    unsupported = FakeGpu().unsupported("nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRetiredPagesPendingStatus",
                                        "nvmlDeviceGetRemappedRows")
    check, _ = gpu_check(FakeNvml([unsupported]))
    assert check.run() == ""


def test_without_nvml_the_gpu_part_passes() -> None:
    check, _ = gpu_check(FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    assert check.run() == ""


def test_the_matmul_is_skipped_without_gpus() -> None:
    assert NodeCheck("", "n1", gpu_count=lambda: 0).matmul_problems() == []


def test_the_probe_listener_accepts_connections_until_closed() -> None:
    port = free_port()
    listener = PortListener()
    listener.open(port)
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    listener.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
    with socket.socket() as s:  # the trainer can bind the port right away
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))


def test_a_worker_port_held_by_another_process_fails_the_check() -> None:
    port = free_port()
    with socket.create_server(("0.0.0.0", port)):
        problem = PortListener().open(port)
    assert problem.startswith(f"cannot listen on the worker port {port}: Address already in use")
    assert problem.endswith("free it, or choose another --worker-port)")


def test_gpus_without_tensorflow_pass_on_their_nvml_health_and_the_check_says_nothing_ran_on_them(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """As on a GPU machine whose agent's Python has no TensorFlow (a None in sys.modules makes it unimportable)."""
    collector = GpuCollector(nvml=FakeNvml(1), cache_seconds=0.0)
    check = NodeCheck("", "n1", gpu_problems=collector.health_problems, gpu_count=lambda: 1)
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    assert check.matmul_skipped() == NO_TENSORFLOW
    with caplog.at_level(logging.INFO, "tfelastic.agent"):
        assert check.run() == ""
    assert f"node check: {NO_TENSORFLOW}" in caplog.text
    assert NodeCheck("", "n1", gpu_count=lambda: 0).matmul_skipped() == ""  # no GPU: nothing to say
