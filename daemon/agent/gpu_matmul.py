"""``python -m tfelastic.daemon.agent.gpu_matmul GPU``: a small matmul on each visible device of the type, checked
against the exact answer. Exit 0: every device computed it; exit 1: the line printed last names the device and
what went wrong. Run by the node check in a subprocess of its own (a wedged GPU costs a timeout, not the agent).
"""

from __future__ import annotations

import os
import sys

SIZE = 256


def main(argv: list[str]) -> int:
    device_type = argv[0] if argv else "GPU"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    devices = tf.config.list_logical_devices(device_type)
    if not devices:
        print(f"no {device_type} is visible to TensorFlow")
        return 1
    rng = np.random.default_rng(0)
    a = rng.integers(-4, 5, size=(SIZE, SIZE)).astype(np.float32)
    b = rng.integers(-4, 5, size=(SIZE, SIZE)).astype(np.float32)
    expected = a @ b  # small integers: exact in float32, whatever the summation order
    for device in devices:
        try:
            with tf.device(device.name):
                got = tf.linalg.matmul(tf.constant(a), tf.constant(b)).numpy()
        except Exception as e:  # the device itself failed: that is the finding
            print(f"{device.name}: {type(e).__name__}: {e}")
            return 1
        if not np.array_equal(got, expected):
            print(f"{device.name}: wrong result ({int(np.sum(got != expected))} of {SIZE * SIZE} elements differ)")
            return 1
    print(f"ok: {len(devices)} {device_type}(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
