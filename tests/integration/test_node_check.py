"""The node check's matmul, in its own subprocess with real TensorFlow. These machines have no GPU: the CPU shows
the path works, and a device type TensorFlow cannot see shows what a node whose driver lost its GPUs reports."""

from __future__ import annotations

import time

import pytest
from tfelastic.daemon.agent.nodecheck import NodeCheck

pytestmark = [pytest.mark.integration, pytest.mark.tensorflow]


def test_a_matmul_on_each_visible_device_passes() -> None:
    started = time.monotonic()
    assert NodeCheck("", "n1", matmul_devices="CPU").matmul_problems() == []
    print(f"matmul check on the CPU: {time.monotonic() - started:.2f}s")


def test_gpus_that_nvml_sees_but_tensorflow_cannot_use_fail_the_check() -> None:
    check = NodeCheck("", "n1", gpu_count=lambda: 8)  # NVML says 8; TensorFlow here has none
    assert check.matmul_problems() == ["the GPU matmul check failed: no GPU is visible to TensorFlow"]
