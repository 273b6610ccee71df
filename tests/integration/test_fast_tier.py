"""The fast checkpoint tier with real TensorFlow (trainer/tiered.py): snapshots in the local tier persisted to the
shared one, the restore of the step the coordinator chose from the local tier first, a damaged snapshot set
aside, and what happens without a chosen step. One subprocess runs every case (TensorFlow stays out of pytest)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.workers import run_script_report, worker_env

pytestmark = [pytest.mark.integration, pytest.mark.tensorflow]

CASES = """
    import json, os, shutil, sys
    from tfelastic.trainer import snapshots
    from tfelastic.trainer.checkpoint import NoRestorableCheckpointError
    from tfelastic.trainer.environment import TrainerEnvironment
    from tfelastic.trainer import tier_restore
    from tfelastic.trainer.tiered import TieredCheckpoint
    import tensorflow as tf

    local_root, shared = os.path.abspath("local"), os.path.abspath("shared/fit")
    value = tf.Variable(tf.zeros([1000]))
    checkpoint = tf.train.Checkpoint(value=value)

    def tier(restore_step=None, managed=True, local=True, chief=True):
        env = TrainerEnvironment(progress_socket="agent.sock" if managed else None, restore_step=restore_step,
                                 local_checkpoint_dir=local_root if local else None)
        return TieredCheckpoint(checkpoint, shared, is_chief=chief, env=env, keep_local=3, keep_shared=3,
                                persist_seconds=0)

    def restore(new_process=True, **kwargs):
        # A restore as a new trainer process makes it: the coordinator's step is for a process's first.
        tier_restore._chosen_step_used = not new_process
        value.assign(tf.fill([1000], -1.0))
        try:
            result = tier(**kwargs).restore()
        except NoRestorableCheckpointError as e:
            return {"error": str(e)}
        return {"step": result.step, "tier": result.tier, "value": float(value.numpy()[0]),
                "skipped": [os.path.relpath(p) for p, _ in result.skipped]}

    writer = tier()
    for step in (10, 20, 30):
        value.assign(tf.fill([1000], float(step)))
        writer.save(step)
        writer.wait_sealed()
        writer._persister.wait_idle()  # a newer offer replaces one not taken on yet: every step copied here
    writer.close()
    throttled_shared = os.path.abspath("throttled/fit")
    throttled = TieredCheckpoint(checkpoint, throttled_shared, is_chief=True, env=TrainerEnvironment(
        progress_socket="agent.sock", local_checkpoint_dir=os.path.abspath("throttled-local")))
    throttled.pace_copies(0)  # the schedule's pace never goes under persist_seconds
    for step in (1, 2, 3):
        throttled.save(step)
        throttled.flush() if step == 3 else throttled.checkpoint.sync()
    paced_shared = os.path.abspath("paced/fit")
    paced = TieredCheckpoint(checkpoint, paced_shared, is_chief=True, persist_seconds=0, env=TrainerEnvironment(
        progress_socket="agent.sock", local_checkpoint_dir=os.path.abspath("paced-local")))
    paced.pace_copies(3600)  # copies dear enough for one an hour
    for step in (1, 2):
        paced.save(step)
        paced.wait_sealed()
        paced._persister.wait_idle()
    paced_steps = snapshots.complete_steps(paced_shared)
    beside = [paced.copy_beside_step(), paced.copy_beside_step()]  # step 1's copy began and ended: seen once
    paced.pace_copies(0)
    paced.save(3)
    paced.wait_sealed()
    paced._persister.wait_idle()
    paced_steps = [paced_steps, snapshots.complete_steps(paced_shared)]
    paced.close()
    report = {"throttled": snapshots.complete_steps(throttled_shared), "paced": paced_steps, "beside": beside,
              "local": snapshots.complete_steps(os.path.join(local_root, "fit")),
              "shared": snapshots.complete_steps(shared),
              "sealed": writer.sealed_step, "persisted": writer.persisted_step,
              "formats": {tier_name: [sorted(os.listdir(os.path.join(store, snapshots.snapshot_name(s))))
                                      for s in (10, 20, 30)]
                          for tier_name, store in (("local", os.path.join(local_root, "fit")), ("shared", shared))}}

    def modes(snapshot):  # the snapshot directory's, then its files'
        return [oct(os.stat(snapshot).st_mode & 0o777), sorted({oct(os.stat(os.path.join(snapshot, name)).st_mode
                                                                     & 0o777) for name in os.listdir(snapshot)})]

    report["modes"] = {"node": oct(os.stat(local_root).st_mode & 0o777),
                       "local": [modes(snapshots.snapshot_dir(os.path.join(local_root, "fit"), s)) for s in (10, 30)]}
    if os.geteuid() == 0:  # another user's directory where the agent's should be (nobody's, mode 0777)
        hostile = os.path.abspath("hostile")
        os.mkdir(hostile)
        os.chown(hostile, 65534, 65534)
        os.chmod(hostile, 0o777)
        refused = TieredCheckpoint(checkpoint, os.path.abspath("refused/fit"), is_chief=True, persist_seconds=0,
                                   env=TrainerEnvironment(progress_socket="agent.sock", local_checkpoint_dir=hostile))
        refused.save(1)
        refused.close()
        report["hostile"] = {"local_store": refused.local_store, "left": os.listdir(hostile),
                             "mode": oct(os.stat(hostile).st_mode & 0o777),
                             "shared": snapshots.complete_steps(os.path.abspath("refused/fit"))}
    data = os.path.join(local_root, "fit", snapshots.snapshot_name(30), snapshots.FLASH_DATA)
    with open(data, "r+b") as f:  # same size, other bytes: the manifest cannot tell, the restore can
        f.seek(200)
        f.write(b"\\xff" * 64)
    report["damaged_local"] = restore(restore_step=30)
    report["local_after_damage"] = snapshots.complete_steps(os.path.join(local_root, "fit"))
    report["set_aside"] = sorted(n for n in os.listdir(os.path.join(local_root, "fit")) if n.startswith("damaged-"))
    other = tf.train.Checkpoint(value=tf.Variable(tf.zeros([7])))  # a model changed since the snapshots
    try:
        TieredCheckpoint(other, shared, is_chief=True, env=TrainerEnvironment(restore_step=30)).restore()
    except Exception as e:
        report["model_changed"] = {"error": type(e).__name__, "shared": snapshots.complete_steps(shared)}
    report["chosen_local"] = restore(restore_step=20)  # an older step: 30 is another history now
    report["after_older_restore"] = {"local": snapshots.complete_steps(os.path.join(local_root, "fit")),
                                     "shared": snapshots.complete_steps(shared)}
    report["second_in_process"] = restore(restore_step=10, new_process=False)
    shutil.rmtree(os.path.join(local_root, "fit", snapshots.snapshot_name(20)))
    report["chosen_shared"] = restore(restore_step=20)
    report["nobody_has_it"] = restore(restore_step=25)
    value.assign(tf.fill([1000], 40.0))
    local_only = tier(local=True, chief=False)  # a non-chief keeps its snapshot in the local tier only
    local_only.save(40)
    local_only.close()
    report["standalone"] = restore(restore_step=None, managed=False)
    report["no_common_step"] = restore(restore_step=None)
    report["after_no_common_step"] = {"local": snapshots.complete_steps(os.path.join(local_root, "fit")),
                                      "shared": snapshots.complete_steps(shared)}
    print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_script_report(CASES, tmp_path_factory.mktemp("fast_tier"))


def test_every_snapshot_is_sealed_locally_and_persisted_to_the_shared_tier(cases: dict[str, Any]) -> None:
    assert cases["local"] == [30, 20, 10] and cases["shared"] == [30, 20, 10]
    assert (cases["sealed"], cases["persisted"]) == (30, 30)


def test_the_first_snapshot_is_tensorflows_and_the_next_are_flash_snapshots(cases: dict[str, Any]) -> None:
    """The first snapshot, TensorFlow's, maps the variables onto its keys; the next copy them into one file."""
    tensorflow = ["MANIFEST.json", "ckpt.data-00000-of-00001", "ckpt.index"]
    flash = ["MANIFEST.json", "flash.bin", "flash.json", "objects.pb"]
    for tier in ("local", "shared"):
        assert cases["formats"][tier] == [tensorflow, flash, flash]


def test_the_local_tier_is_this_users_alone(cases: dict[str, Any]) -> None:
    """The node's directory 0700, each snapshot's 0700 and its files (TensorFlow's, a flash snapshot's) 0600."""
    assert cases["modes"] == {"node": "0o700", "local": [["0o700", ["0o600"]], ["0o700", ["0o600"]]]}


def test_a_node_directory_another_user_owns_is_refused_and_the_snapshots_go_to_the_shared_tier(
        cases: dict[str, Any]) -> None:
    if "hostile" not in cases:
        pytest.skip("building another user's directory needs root")
    assert cases["hostile"] == {"local_store": None, "left": [], "mode": "0o777", "shared": [1]}


def test_the_copy_to_the_shared_tier_is_throttled_and_flush_copies_the_newest(cases: dict[str, Any]) -> None:
    """Three snapshots within the 30 s: the first is copied in the background, the newest at flush()."""
    assert cases["throttled"] == [3, 1]


def test_the_save_schedule_paces_the_copies_to_the_shared_tier(cases: dict[str, Any]) -> None:
    """Paced to one an hour, the second snapshot is not copied; paced to the floor again (0 s), the third is."""
    assert cases["paced"] == [[1], [3, 1]]


def test_a_copy_that_began_and_ended_within_a_step_is_seen_beside_it_once(cases: dict[str, Any]) -> None:
    """The save schedule charges a copy to the steps beside it, even one too short to be under way at a step's end."""
    assert cases["beside"] == [[True, True], [False, False]]


def test_the_chosen_step_comes_from_the_local_tier_when_the_node_has_it(cases: dict[str, Any]) -> None:
    assert cases["chosen_local"] == {"step": 20, "tier": "local", "value": 20.0, "skipped": []}
    assert cases["chosen_shared"] == {"step": 20, "tier": "shared", "value": 20.0, "skipped": []}


def test_a_second_restore_in_the_same_process_continues_from_the_newest_snapshot(cases: dict[str, Any]) -> None:
    """A second fit() in one process: the coordinator chose a step for the process's start, not for it."""
    assert cases["second_in_process"] == {"step": 20, "tier": "local", "value": 20.0, "skipped": []}


def test_a_damaged_local_snapshot_is_set_aside_and_the_shared_copy_restores(cases: dict[str, Any]) -> None:
    assert cases["damaged_local"] == {"step": 30, "tier": "shared", "value": 30.0,
                                      "skipped": ["local/fit/step-000000000030"]}
    assert cases["local_after_damage"] == [20, 10]  # 30 set aside
    assert [name[:len("damaged-step-000000000030")] for name in cases["set_aside"]] == ["damaged-step-000000000030"]


def test_a_snapshot_that_no_longer_fits_the_model_is_an_error_and_is_kept(cases: dict[str, Any]) -> None:
    assert cases["model_changed"] == {"error": "ValueError", "shared": [30, 20, 10]}


def test_a_chosen_step_this_store_does_not_hold_falls_back_to_its_newest_shared_one(cases: dict[str, Any]) -> None:
    """Another store's step (a job with two), or a scan gone stale: the agreement check covers the workers."""
    assert cases["nobody_has_it"] == {"step": 20, "tier": "shared", "value": 20.0, "skipped": []}


def test_without_a_chosen_step_the_workers_take_the_shared_tier_and_alone_the_newest(cases: dict[str, Any]) -> None:
    assert cases["standalone"] == {"step": 40, "tier": "local", "value": 40.0, "skipped": []}
    assert cases["no_common_step"] == {"step": 20, "tier": "shared", "value": 20.0, "skipped": []}
    assert cases["after_no_common_step"] == {"local": [10], "shared": [20, 10]}  # the local 40 was newer


def test_after_restoring_an_older_step_the_newer_snapshots_are_gone(cases: dict[str, Any]) -> None:
    """Step 30 is another history once 20 was restored: a later restore must not pick it up."""
    assert cases["after_older_restore"] == {"local": [20, 10], "shared": [20, 10]}


FULL_TIER = """
    import json, os, sys
    from tfelastic.trainer import snapshots
    from tfelastic.trainer.environment import TrainerEnvironment
    from tfelastic.trainer.tiered import TieredCheckpoint
    import tensorflow as tf

    local_root, shared = sys.argv[1], os.path.abspath("shared/fit")
    raced = None
    if sys.argv[2:] == ["copy-ends-while-making-room"]:
        import threading
        copy_snapshot, prune = snapshots.copy_snapshot, snapshots.prune
        making_room = threading.Event()
        raced = False

        def held_copy(*args):
            making_room.wait(60)  # the copy of step 1 is under way until step 3 makes room
            return copy_snapshot(*args)

        def prune_while_the_copy_ends(store, keep, protect=()):
            global raced
            prune(store, keep, protect)
            if keep == 1 and protect:  # making room (a seal keeps 2), and the copy held step 1: let it end now
                raced = True
                making_room.set()
                writer._persister.wait_idle()

        snapshots.copy_snapshot, snapshots.prune = held_copy, prune_while_the_copy_ends
    value = tf.Variable(tf.zeros([1 << 20]))  # a 4 MiB snapshot
    checkpoint = tf.train.Checkpoint(value=value)
    env = TrainerEnvironment(progress_socket="agent.sock", local_checkpoint_dir=local_root)
    writer = TieredCheckpoint(checkpoint, shared, is_chief=True, env=env, persist_seconds=3600)
    for step in (1, 2, 3, 4):
        value.assign(tf.fill([1 << 20], float(step)))
        writer.save(step)
    writer.close()
    value.assign(tf.zeros([1 << 20]))
    restored = TieredCheckpoint(checkpoint, shared, is_chief=True, env=env).restore()
    print(json.dumps({"local": snapshots.complete_steps(os.path.join(local_root, "fit")),
                      "shared": snapshots.complete_steps(shared), "restored": [restored.step, restored.tier],
                      "value": float(value.numpy()[0]), "raced": raced}))
"""


@pytest.mark.parametrize(("tier_mib", "local", "shared", "warned", "case"), [
    (10, [4, 3], [4, 1], False, ""),  # room for two: the older ones make room (the chief copied 1 first, 4 at the end)
    # The same, when the copy that holds step 1 ends just after the prune that had to keep it: it is waited for
    # and step 1 pruned (a race the suite once lost: the tier was left with room to spare).
    (10, [4, 3], [4, 1], False, "copy-ends-while-making-room"),
    (6, [1], [4, 3, 2], True, ""),  # room for one: the snapshots after it go to the shared tier
    (2, [], [4, 3, 2], True, ""),  # not even one: its write fails, and the next goes to the shared tier
], ids=["room-for-two", "room-for-two-copy-ends-while-making-room", "room-for-one", "room-for-none"])
def test_a_local_tier_without_room_hands_the_snapshots_to_the_shared_tier(
        tmp_path: Path, tier_mib: int, local: list[int], shared: list[int], warned: bool, case: str) -> None:
    """The local tier is bounded by its file system (a /dev/shm of a few GiB on a node with a large model):
    never a crashed trainer for want of room there, and never a snapshot lost at the end."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    tier = tmp_path / "shm"
    tier.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={tier_mib}m", "tfelastic-test-tier", str(tier)], check=True)
    try:
        script = [sys.executable, "-c", textwrap.dedent(FULL_TIER), str(tier), *([case] if case else [])]
        result = subprocess.run(script, cwd=tmp_path, env=worker_env(), capture_output=True, text=True, timeout=120)
    finally:
        subprocess.run(["umount", "-l", str(tier)], check=False)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert (report["local"], report["shared"]) == (local, shared)
    assert report["restored"][0] == 4 and report["value"] == 4.0
    assert report["raced"] is (True if case else None)  # the copy did end while room was being made
    assert ("has no room for a snapshot" in result.stderr) is warned, result.stderr[-4000:]


DAMAGED_TENSORFLOW_SNAPSHOT = """
    import json, os, sys
    from tfelastic.trainer import snapshots
    from tfelastic.trainer.environment import TrainerEnvironment
    from tfelastic.trainer.tiered import TieredCheckpoint
    import tensorflow as tf
    import tf_keras as keras

    local_root, shared = os.path.abspath("local"), os.path.abspath("shared/fit")
    local = os.path.join(local_root, "fit")
    model = keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(4)])
    optimizers = {"adam": keras.optimizers.Adam, "legacy-adam": keras.optimizers.legacy.Adam}
    model.compile(optimizers[sys.argv[2]](0.1), "mse")
    checkpoint = tf.train.Checkpoint(model=model)

    def state():  # the model's variables and the optimizer's (its step and slots), by name without the scope
        return {v.name.removeprefix("Adam/"): v.numpy().tolist() for v in model.variables + model.optimizer.variables()}

    if sys.argv[1] == "write":
        model.fit(tf.random.normal([8, 8], seed=1), tf.random.normal([8, 4], seed=2), batch_size=4, verbose=0)
        tier = TieredCheckpoint(checkpoint, shared, is_chief=True, persist_seconds=0, env=TrainerEnvironment(
            progress_socket="agent.sock", local_checkpoint_dir=local_root))
        tier.save(1)  # a process's first snapshot: TensorFlow's format
        tier.close()
        snapshot = snapshots.snapshot_dir(local, 1)
        data = os.path.join(snapshot, next(n for n in os.listdir(snapshot) if n.startswith("ckpt.data")))
        with open(data, "r+b") as f:  # 64 bytes flipped: the manifest cannot tell, TensorFlow's checksum can
            flipped = bytes(b ^ 0xFF for b in f.read(64))
            f.seek(0)
            f.write(flipped)
        print(json.dumps({"state": state(), "files": sorted(os.listdir(snapshot))}))
    else:
        # A new trainer process, as after a crash: the checkpoint has no save counter yet, and the optimizer's
        # slots are created after the restore (TensorFlow restores them then, from what the restore left).
        env = TrainerEnvironment(progress_socket="agent.sock", local_checkpoint_dir=local_root, restore_step=1)
        try:
            result = TieredCheckpoint(checkpoint, shared, is_chief=True, env=env).restore()
            create_slots = getattr(model.optimizer, "build", None) or model.optimizer._create_all_weights  # legacy
            create_slots(model.trainable_variables)
        except Exception as e:
            print(json.dumps({"error": f"{type(e).__name__}: {str(e)[:300]}"}))
            sys.exit(0)
        print(json.dumps({"restored": [result.step, result.tier, os.path.relpath(result.path)],
                          "skipped": [os.path.relpath(p) for p, _ in result.skipped], "state": state(),
                          "local": snapshots.complete_steps(local),
                          "set_aside": [n[:25] for n in os.listdir(local) if n.startswith("damaged-")]}))
"""


@pytest.mark.parametrize("optimizer", ["adam", "legacy-adam"])  # their slots are restored in different ways
def test_a_damaged_local_snapshot_in_tensorflows_format_falls_back_to_the_shared_copy_in_the_same_restore(
        tmp_path: Path, optimizer: str) -> None:
    """TensorFlow keeps, from a restore that failed, a restore for each object that did not exist yet (the save
    counter, an optimizer's slots) and runs it when the object is created, reading the snapshot that was set
    aside: the shared copy must restore, and every variable hold its saved value."""
    def run(phase: str) -> dict[str, Any]:
        result = subprocess.run([sys.executable, "-c", textwrap.dedent(DAMAGED_TENSORFLOW_SNAPSHOT), phase,
                                 optimizer],
                                cwd=tmp_path, env=worker_env(), capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr[-4000:]
        report: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
        return report

    written = run("write")
    assert written["files"] == ["MANIFEST.json", "ckpt.data-00000-of-00001", "ckpt.index"]
    restored = run("restore")
    assert "error" not in restored, restored["error"]
    assert restored["restored"] == [1, "shared", "shared/fit/step-000000000001"]
    assert restored["skipped"] == ["local/fit/step-000000000001"]
    assert restored["state"] == written["state"]
    assert (restored["local"], restored["set_aside"]) == ([], ["damaged-step-000000000001"])
