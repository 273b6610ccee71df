"""Flash snapshots (trainer/flash.py) with real TensorFlow: a Keras model with its optimizer restores exactly
(directly, and deferred to an optimizer built later), a checkpoint with more than variables keeps TensorFlow's
writer, damage and a changed model are caught, and the local tier reuses its files' memory. One subprocess runs
every case (TensorFlow stays out of pytest)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.workers import run_script_report

pytestmark = [pytest.mark.integration, pytest.mark.tensorflow]

CASES = """
    import json, os, shutil
    import numpy as np
    from tfelastic.trainer import flash, snapshots
    from tfelastic.trainer.environment import TrainerEnvironment
    from tfelastic.trainer.tiered import TieredCheckpoint
    import tensorflow as tf
    import tf_keras as keras

    def build():
        model = keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3)])
        model.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    def state(model):  # every variable, in a fixed order: the model's, then the optimizer's
        return [v.numpy().tolist() for v in model.variables + model.optimizer.variables()]

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 8)).astype("float32"), rng.integers(0, 3, size=64)
    model = build()
    model.fit(x, y, epochs=2, batch_size=16, verbose=0)
    checkpoint = tf.train.Checkpoint(model=model)
    checkpoint.write("reference/ckpt")
    writer = flash.FlashWriter.from_tensorflow_snapshot(checkpoint, "reference")
    os.makedirs("one")
    writer.write("one")
    report = {"format": sorted(os.listdir("one")), "size": writer.size}
    saved = state(model)

    direct = build()
    direct.optimizer.build(direct.trainable_variables)
    flash.restore(tf.train.Checkpoint(model=direct), "one")
    report["direct_equal"] = state(direct) == saved

    deferred = build()  # no optimizer slots yet: they are created by the first step
    flash.restore(tf.train.Checkpoint(model=deferred), "one")
    deferred.optimizer.build(deferred.trainable_variables)
    report["deferred_equal"] = state(deferred) == saved
    report["deferred_iterations"] = int(deferred.optimizer.iterations.numpy())

    dataset = tf.data.Dataset.range(10)
    iterator = iter(dataset)
    with_iterator = tf.train.Checkpoint(model=model, iterator=iterator)
    with_iterator.write("iterator/ckpt")
    report["iterator_writer"] = flash.FlashWriter.from_tensorflow_snapshot(with_iterator, "iterator") is None

    shutil.copytree("one", "damaged")
    with open("damaged/flash.bin", "r+b") as f:  # same size, other bytes
        f.seek(100)
        f.write(b"\\xff" * 8)
    try:
        flash.restore(tf.train.Checkpoint(model=build()), "damaged")
    except flash.FlashDamagedError as e:
        report["damaged"] = "checksum" in str(e) and "model/layer_with_weights-0/kernel" in str(e)
    shutil.copytree("one", "garbled")
    with open("garbled/flash.json", "r+b") as f:
        f.write(b"}")
    try:
        flash.restore(tf.train.Checkpoint(model=build()), "garbled")
    except flash.FlashDamagedError:
        report["garbled"] = True

    changed = keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(17), keras.layers.Dense(3)])
    try:
        flash.restore(tf.train.Checkpoint(model=changed), "one")
    except ValueError as e:
        report["changed"] = str(e)

    # The local tier: the oldest snapshot's file becomes the newest's (same inode, no new memory).
    value = tf.Variable(tf.zeros([1000]))
    local = os.path.abspath("local")
    tier = TieredCheckpoint(tf.train.Checkpoint(value=value), os.path.abspath("shared/v"), is_chief=True,
                            env=TrainerEnvironment(progress_socket="agent.sock", local_checkpoint_dir=local),
                            keep_local=2, persist_seconds=3600)
    inodes = {}
    for step in range(1, 7):
        value.assign(tf.fill([1000], float(step)))
        tier.save(step)
        tier.flush() if step == 6 else tier.checkpoint.sync()
        data = os.path.join(local, "v", snapshots.snapshot_name(step), "flash.bin")
        tier.wait_sealed()
        tier._persister.wait_idle()  # the copy to the shared tier holds its snapshot in the local tier until done
        inodes[step] = os.stat(data).st_ino if os.path.exists(data) else None
    tier.close()
    report["inodes"] = inodes
    report["local"] = sorted(os.listdir(os.path.join(local, "v")))
    value.assign(tf.zeros([1000]))
    restored = TieredCheckpoint(tf.train.Checkpoint(value=value), os.path.abspath("shared/v"), is_chief=True,
                                env=TrainerEnvironment(local_checkpoint_dir=local)).restore()
    report["restored"] = [restored.step, restored.tier, float(value.numpy()[0])]

    # A worker that keeps no snapshot still writes each one (all-reduces of sync-on-read variables), into one
    # spare file.
    other = TieredCheckpoint(tf.train.Checkpoint(value=value), os.path.abspath("shared/w"), is_chief=False,
                             env=TrainerEnvironment(progress_socket="agent.sock"))
    spares = []
    for step in range(1, 5):
        other.save(step)
        other.wait_sealed()
        spare = os.path.join(other._scratch, "spare-flash.bin")
        spares.append(os.stat(spare).st_ino if os.path.exists(spare) else None)
    report["scratch"] = {"spares": spares, "left": sorted(os.listdir(other._scratch)),
                         "shared": os.path.exists("shared/w")}
    other.close()

    # Sizes that are not multiples of 8 or of the copy's chunk or piece, and every kind of fixed-size value, on
    # the mapped path; the second write reuses the first's file.
    odd = {"half": tf.Variable(tf.reshape(tf.range(15, dtype=tf.float32), [3, 5])),
           "brain": tf.Variable(tf.cast(tf.reshape(tf.range(15), [5, 3]), tf.bfloat16)),
           "flags": tf.Variable([True, False, True, True, False, False, True]),
           "count": tf.Variable(tf.constant(2**40 + 3, tf.int64)),
           "small": tf.Variable(tf.constant([1.5, -2.5, 3.25, 7.0, 9.5], tf.float16)),
           "large": tf.Variable(tf.range(300_001, dtype=tf.float32) * 0.5),  # 1.2 MB: two chunks and a tail
           # 16 MiB and 12 bytes: two pieces for the copy threads, whose checksums add up to the restore's
           "huge": tf.Variable(tf.range(4_194_307, dtype=tf.int32) * 3)}
    odd_checkpoint = tf.train.Checkpoint(**odd)
    odd_checkpoint.write("odd-reference/ckpt")
    odd_writer = flash.FlashWriter.from_tensorflow_snapshot(odd_checkpoint, "odd-reference")
    os.makedirs("odd1")
    odd_writer.write("odd1", keep_mapped=True)
    os.makedirs("odd2")
    odd["large"].assign_add(tf.ones([300_001]))
    odd["huge"].assign_add(tf.ones([4_194_307], tf.int32))
    odd_writer.write("odd2", recycled="odd1/flash.bin", keep_mapped=True)
    odd_writer.release()
    expected = {name: v.numpy().tolist() for name, v in odd.items()}
    for v in odd.values():
        v.assign(tf.zeros_like(v))
    flash.restore(odd_checkpoint, "odd2")
    report["odd"] = {"equal": {name: v.numpy().tolist() == expected[name] for name, v in odd.items()},
                     "reused": not os.path.exists("odd1/flash.bin")}

    # The custom loop's final save at a step a flash snapshot already has: TensorFlow's format in both tiers.
    final = TieredCheckpoint(tf.train.Checkpoint(value=value), os.path.abspath("shared/final"), is_chief=True,
                             env=TrainerEnvironment(progress_socket="agent.sock",
                                                    local_checkpoint_dir=os.path.abspath("final-local")))
    for step in (1, 2):
        final.save(step)
        final.flush()
    final.save(2, portable=True)
    final.close()
    report["final"] = [sorted(os.listdir(os.path.join(root, snapshots.snapshot_name(2))))
                       for root in ("final-local/final", "shared/final")]

    # The copy's tasks: a thousand small variables in one, a large one in 16 MiB pieces, every byte once.
    layout = [flash.Entry(f"v{i}", f"v{i}", "float32", (1024,), i * 4096, 4096) for i in range(1000)]
    layout.append(flash.Entry("big", "big", "float32", (10 << 20,), 1000 * 4096, 40 << 20))
    tasks = flash._copy_tasks(layout)
    covered = sorted((index, start, end) for task in tasks for index, start, end in task)
    report["tasks"] = {"count": len(tasks), "sizes": [sum(end - start for _, start, end in t) for t in tasks],
                       "exact": all(sum(e - s for i, s, e in covered if i == index) == entry.padded
                                    for index, entry in enumerate(layout))}

    report["host_devices"] = [flash.host_device(d) for d in (
        "", "/job:worker/replica:0/task:1/device:CPU:0", "/job:worker/replica:0/task:0/device:GPU:0")]
    print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_script_report(CASES, tmp_path_factory.mktemp("flash"))


def test_a_flash_snapshot_is_one_data_file_with_its_layout_and_object_graph(cases: dict[str, Any]) -> None:
    assert cases["format"] == ["flash.bin", "flash.json", "objects.pb"]
    assert cases["size"] >= (8 * 16 + 16 + 16 * 3 + 3) * 4 * 3  # weights and Adam's two slots


def test_a_model_and_its_optimizer_restore_exactly(cases: dict[str, Any]) -> None:
    assert cases["direct_equal"] is True


def test_slots_created_after_the_restore_get_the_snapshots_values(cases: dict[str, Any]) -> None:
    """TensorFlow's deferred restore: an optimizer built after the restore still gets its slots back."""
    assert cases["deferred_equal"] is True
    assert cases["deferred_iterations"] == 8  # 2 epochs of 4 batches


def test_a_checkpoint_with_more_than_variables_keeps_tensorflows_writer(cases: dict[str, Any]) -> None:
    assert cases["iterator_writer"] is True


def test_damaged_data_or_layout_is_reported_as_damage(cases: dict[str, Any]) -> None:
    assert cases.get("damaged") is True
    assert cases.get("garbled") is True


def test_a_model_that_changed_is_an_error_naming_the_variable(cases: dict[str, Any]) -> None:
    assert "model/layer_with_weights-0/kernel" in cases["changed"]
    assert "(8, 17)" in cases["changed"] and "(8, 16)" in cases["changed"]


def test_the_local_tier_reuses_the_oldest_snapshots_file(cases: dict[str, Any]) -> None:
    """Step 1 is TensorFlow's; 2 and 3 get new files; from 4 on each takes over the file of the one two before."""
    inodes = {int(step): inode for step, inode in cases["inodes"].items()}
    assert inodes[1] is None and inodes[2] != inodes[3]
    assert (inodes[4], inodes[5], inodes[6]) == (inodes[2], inodes[3], inodes[2])
    assert cases["local"] == ["step-000000000005", "step-000000000006"]  # nothing temporary left
    assert cases["restored"] == [6, "local", 6.0]


def test_a_worker_that_keeps_no_snapshot_writes_each_into_one_spare_file(cases: dict[str, Any]) -> None:
    """Step 1 is TensorFlow's (read at step 2, then removed); from step 2 on one file, kept as the spare."""
    spares = cases["scratch"]["spares"]
    assert spares[0] is None and spares[1] is not None and spares[1:] == [spares[1]] * 3
    assert cases["scratch"]["left"] == ["spare-flash.bin"] and cases["scratch"]["shared"] is False


def test_small_variables_share_a_copy_task_and_large_ones_are_split(cases: dict[str, Any]) -> None:
    assert cases["tasks"] == {"count": 4, "sizes": [1000 * 4096, 16 << 20, 16 << 20, 8 << 20], "exact": True}


def test_only_variables_in_host_memory_get_flash_snapshots(cases: dict[str, Any]) -> None:
    assert cases["host_devices"] == [True, True, False]


def test_odd_sizes_and_every_fixed_size_type_round_trip_through_a_mapped_file(cases: dict[str, Any]) -> None:
    assert cases["odd"] == {"equal": {name: True for name in ("half", "brain", "flags", "count", "small", "large",
                                                                "huge")},
                            "reused": True}


def test_a_portable_save_of_a_step_already_saved_replaces_it_with_tensorflows_format_in_both_tiers(
        cases: dict[str, Any]) -> None:
    """TrainLoop's final save hands the shared copy's path to the user: it must be a TensorFlow checkpoint."""
    tensorflow = ["MANIFEST.json", "ckpt.data-00000-of-00001", "ckpt.index"]
    assert cases["final"] == [tensorflow, tensorflow]
