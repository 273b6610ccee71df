"""The tfelastic.trainer library with real TensorFlow processes: torn checkpoints, the graceful stop (SIGTERM ->
save at an agreed step -> exit 42) on 1 and 2 workers, TensorBoard on the chief only, the export, the progress
model.fit reports, and the Keras-3 guard. Every TensorFlow run is a subprocess: signal handlers and
TF_USE_LEGACY_KERAS stay out of pytest."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from tfelastic.trainer.snapshots import MANIFEST, snapshot_name

from tests.cluster import TF_DEADLINE
from tests.workers import WorkerSet, example, run_alone, wait_for_file, worker_env

pytestmark = [pytest.mark.integration, pytest.mark.tensorflow]

CHECKPOINTED_AND_STOPPED = 42


def python(tmp: Path, code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=180, cwd=tmp, env=worker_env(env))


TORN = """
    import json, os, sys
    from tfelastic.trainer.checkpoint import ChiefCheckpointManager, NoRestorableCheckpointError
    import tensorflow as tf

    directory = sys.argv[1] if len(sys.argv) > 1 else "ckpt"
    weights, bias = tf.Variable(tf.zeros([4096])), tf.Variable(tf.zeros([4096]))
    checkpoint = tf.train.Checkpoint(weights=weights, bias=bias)
    chief = ChiefCheckpointManager(checkpoint, directory, is_chief=True, max_to_keep=3)
    for step in (10, 20, 30):
        weights.assign(tf.fill([4096], float(step)))
        bias.assign(tf.fill([4096], float(step)))
        chief.save(step)

    def restore():
        weights.assign(tf.zeros([4096]))
        bias.assign(tf.zeros([4096]))
        try:
            result = ChiefCheckpointManager(checkpoint, directory, is_chief=True).restore()
        except NoRestorableCheckpointError as e:
            return {"error": str(e)}
        return {"weights": float(weights[-1]), "bias": float(bias[-1]),
                "path": result.path and os.path.basename(result.path),
                "skipped": [os.path.basename(p) for p, _ in result.skipped]}

    def data(step):
        return os.path.join(directory, f"ckpt-{step}.data-00000-of-00001")

    report = {"intact": restore()}
    with open(data(30), "r+b") as f:  # the tail: the object graph (first) reads, the last variable does not
        f.truncate(os.path.getsize(data(30)) - 64)
    report["tail_truncated"] = restore()
    os.remove(data(20))
    report["data_missing"] = restore()
    os.remove(os.path.join(directory, "checkpoint"))
    report["state_file_lost"] = restore()
    with open(data(10), "r+b") as f:
        f.truncate(16)
    report["all_torn"] = restore()

    worker = ChiefCheckpointManager(checkpoint, "shared", is_chief=False, task_id=1)
    report["worker_save"] = worker.save(40)
    report["shared_after_worker_save"] = sorted(os.listdir("shared")) if os.path.isdir("shared") else []
    print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def torn(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("torn")
    result = python(tmp, TORN)
    assert result.returncode == 0, result.stdout + result.stderr
    report: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return report


def test_intact_checkpoints_restore_the_newest(torn: dict[str, Any]) -> None:
    assert torn["intact"] == {"weights": 30.0, "bias": 30.0, "path": "ckpt-30", "skipped": []}


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous(torn: dict[str, Any]) -> None:
    # Every variable comes from ckpt-20, also those that ckpt-30's partial read had already filled.
    assert torn["tail_truncated"] == {"weights": 20.0, "bias": 20.0, "path": "ckpt-20", "skipped": ["ckpt-30"]}


def test_a_missing_data_file_falls_back_further(torn: dict[str, Any]) -> None:
    assert torn["data_missing"] == {"weights": 10.0, "bias": 10.0, "path": "ckpt-10",
                                    "skipped": ["ckpt-30", "ckpt-20"]}


def test_checkpoints_are_found_without_the_state_file(torn: dict[str, Any]) -> None:
    assert torn["state_file_lost"]["path"] == "ckpt-10"


def test_when_no_checkpoint_restores_the_error_lists_them_all(torn: dict[str, Any]) -> None:
    error = torn["all_torn"]["error"]
    assert "none of the 3 checkpoints in ckpt restores" in error
    assert all(f"ckpt-{n}" in error for n in (10, 20, 30)) and "move the directory away" in error


def test_a_non_chief_save_leaves_nothing_on_shared_storage(torn: dict[str, Any]) -> None:
    assert torn["worker_save"] is None
    assert torn["shared_after_worker_save"] == []


def test_workers_that_restored_different_steps_are_stopped(tmp_path: Path) -> None:
    code = textwrap.dedent("""
        from tfelastic.trainer.loop import agree_across_workers, make_all_reduce
        from tfelastic.trainer.strategy import make_strategy
        strategy = make_strategy()
        all_reduce = make_all_reduce(strategy)
        agree_across_workers(strategy, 70, "restored step", all_reduce)
        print("same step: agreed", flush=True)
        try:
            agree_across_workers(strategy, 70 + 10 * strategy.cluster_resolver.task_id, "restored step", all_reduce)
        except RuntimeError as e:
            print(f"different steps: {e}")
    """)
    workers = WorkerSet(tmp_path, [sys.executable, "-c", code]).start()
    assert workers.wait(120) == [0, 0], workers.logs()
    for worker in workers.workers:
        assert "same step: agreed" in worker.output()
        assert "different steps: workers disagree on the restored step" in worker.output(), worker.output()
        assert "the mean over the 2 replicas is 75" in worker.output()


# ---------------------------------------------------------------------------------------------- graceful stop

LOOP = ["--steps", "400", "--save-every", "20", "--step-seconds", "0.02", "--train-examples", "2048"]


def test_sigterm_stops_two_custom_loop_workers_at_one_saved_step_and_the_next_run_resumes_there(
        tmp_path: Path) -> None:
    backup = tmp_path / "backup"
    first = WorkerSet(tmp_path, example("custom_loop", *LOOP, "--backup-dir", str(backup))).start("-1")
    wait_for_file(backup / "step-000000000020" / MANIFEST, TF_DEADLINE, first)
    first.signal(signal.SIGTERM)
    assert first.wait() == [CHECKPOINTED_AND_STOPPED] * 2, first.logs()
    stopped = first.summaries()
    assert all(s["preempted"] for s in stopped)
    step = stopped[0]["final_step"]
    assert [s["final_step"] for s in stopped] == [step, step] and 20 <= step < 400
    assert (backup / snapshot_name(step) / MANIFEST).exists()  # the chief saved where both stopped
    assert not list(backup.glob(".partial-*")) and not list(backup.glob("workertemp_*"))  # the other worker's
    # save went to a scratch directory (no local tier without an agent)

    second = WorkerSet(tmp_path, example("custom_loop", *LOOP[:4], "--backup-dir", str(backup))).start("-2")
    assert second.wait() == [0, 0], second.logs()
    resumed = second.summaries()
    assert [s["initial_step"] for s in resumed] == [step, step]
    assert [s["final_step"] for s in resumed] == [400, 400]


def test_sigterm_stops_two_keras_fit_workers_at_one_saved_step_and_the_next_run_resumes_there(
        tmp_path: Path) -> None:
    backup = tmp_path / "backup"
    fit = ["--epochs", "4", "--steps-per-epoch", "100", "--save-every", "20", "--train-examples", "2048",
           "--backup-dir", str(backup)]
    first = WorkerSet(tmp_path, example("keras_fit", *fit, "--step-seconds", "0.02")).start("-1")
    wait_for_file(backup / "step-000000000020" / MANIFEST, TF_DEADLINE, first)
    first.signal(signal.SIGTERM)
    assert first.wait() == [CHECKPOINTED_AND_STOPPED] * 2, first.logs()
    stopped = first.summaries()
    step = stopped[0]["final_step"]
    assert all(s["preempted"] for s in stopped) and [s["final_step"] for s in stopped] == [step, step]

    second = WorkerSet(tmp_path, example("keras_fit", *fit)).start("-2")
    assert second.wait() == [0, 0], second.logs()
    assert [(s["initial_step"], s["final_step"]) for s in second.summaries()] == [(step, 400)] * 2


def test_sigterm_stops_a_single_worker_and_its_restore_is_exact(tmp_path: Path) -> None:
    alone = ["--steps", "120", "--save-every", "50", "--train-examples", "2048"]
    code, output, uninterrupted = run_alone(tmp_path, example("custom_loop", *alone, "--backup-dir", "a"))
    assert code == 0 and uninterrupted, output

    run = WorkerSet(tmp_path, example("custom_loop", *alone, "--backup-dir", "b", "--step-seconds", "0.05"), 0)
    run.start()  # alone: no TF_CONFIG at all
    wait_for_file(tmp_path / "b" / "step-000000000050" / MANIFEST, TF_DEADLINE, run)
    run.signal(signal.SIGTERM)
    assert run.wait() == [CHECKPOINTED_AND_STOPPED], run.logs()
    step = run.summaries()[0]["final_step"]
    assert 50 <= step < 120

    code, output, resumed = run_alone(tmp_path, example("custom_loop", *alone, "--backup-dir", "b"))
    assert code == 0 and resumed, output
    assert (resumed["initial_step"], resumed["final_step"]) == (step, 120)
    assert resumed["weights_digest"] == uninterrupted["weights_digest"]  # same data, same order, same weights


# ------------------------------------------------------------------------------------- TensorBoard and export

def test_tensorboard_is_written_by_the_chief_only_and_the_export_loads_without_a_strategy(tmp_path: Path) -> None:
    fit = ["--epochs", "2", "--steps-per-epoch", "30", "--save-every", "20", "--train-examples", "1024",
           "--test-examples", "512", "--backup-dir", "backup", "--tensorboard-dir", "tb", "--export-dir",
           str(tmp_path / "model.keras")]
    workers = WorkerSet(tmp_path, example("keras_fit", *fit)).start()
    assert workers.wait() == [0, 0], workers.logs()
    chief, other = workers.summaries()
    events = [p.name for p in (tmp_path / "tb").rglob("events.out.tfevents.*")]
    assert events, "the chief wrote no TensorBoard events"
    writers = {name.split(".")[-3] for name in events}  # events.out.tfevents.TIME.HOST.PID.N.v2
    assert writers == {str(chief["pid"])}, (events, chief["pid"], other["pid"])
    assert not list(tmp_path.rglob("workertemp_*"))
    assert chief["exported"] == str(tmp_path / "model.keras") and other["exported"] is None

    evaluate = f"""
        import json, sys
        sys.path.insert(0, {str(workers.command[1].rsplit("/", 1)[0])!r})
        import mnist_like
        import numpy as np
        import tensorflow as tf
        from tfelastic.trainer.export import load_model
        assert not tf.distribute.has_strategy()
        model = load_model({str(tmp_path / "model.keras")!r})
        data = mnist_like.generate(1024, 512, seed=1)
        logits = model(data.x_test, training=False)
        print(json.dumps({{"accuracy": float(np.mean(np.argmax(logits, axis=1) == data.y_test))}}))
    """
    result = python(tmp_path, evaluate)
    assert result.returncode == 0, result.stdout + result.stderr
    accuracy = json.loads(result.stdout.splitlines()[-1])["accuracy"]
    assert accuracy == pytest.approx(chief["accuracy"], abs=2 / 512)  # the trained model, not a fresh one
    assert accuracy > 0.3


def test_fit_callbacks_bundle_order_tensorboard_rank_and_epoch_saves(tmp_path: Path) -> None:
    result = python(tmp_path, """
        import json
        from tfelastic.trainer.callbacks import fit_callbacks
        from tfelastic.trainer.environment import TrainerEnvironment
        def names(**kwargs):
            return [type(c).__name__ for c in fit_callbacks("backup", tensorboard_dir="tb", **kwargs)]
        worker = TrainerEnvironment(rank=1, world_size=2, task_type="worker", task_index=1)
        report = {"chief": names(), "worker": names(env=worker), "epoch": names(save_every="epoch",
                                                                                graceful_stop=False),
                  "synchronous": names(fast_tier=False, env=worker)}
        for kwargs in ({"save_every": "epoch"}, {"delete_checkpoint": True}):
            try:
                fit_callbacks("backup", **kwargs)
            except ValueError as e:
                report.setdefault("refused", []).append(str(e))
        print(json.dumps(report))
    """)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["chief"] == ["SavePhaseCallback", "FastBackupAndRestore", "ProgressCallback",
                               "GracefulStopCallback", "TensorBoard"]
    assert report["worker"] == ["SavePhaseCallback", "FastBackupAndRestore", "ProgressCallback",
                                "GracefulStopCallback"]
    assert report["epoch"] == ["SavePhaseCallback", "BackupAndRestore", "ProgressCallback", "TensorBoard"]
    assert report["synchronous"] == ["SavePhaseCallback", "BackupAndRestore", "ProgressCallback",
                                     "GracefulStopCallback"]
    refused = report["refused"]
    assert "save_every='epoch' with graceful_stop=True would lose the rest of an epoch" in refused[0]
    assert "delete_checkpoint=True needs fast_tier=False" in refused[1]


FIT_REPORTING = """
        import json, os, socket, sys, threading
        from tfelastic.trainer.progress import SOCKET_ENV, decode
        agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        agent.bind(os.path.abspath("progress.sock"))
        agent.settimeout(0.05)
        os.environ[SOCKET_ENV] = os.path.abspath("progress.sock")
        received, fit_over = [], threading.Event()

        def listen():  # while fit runs, as the agent does: the socket queues few datagrams (max_dgram_qlen)
            while True:
                try:
                    received.append(agent.recv(4096))
                except TimeoutError:
                    if fit_over.is_set():
                        return

        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        from tfelastic.trainer.callbacks import fit_callbacks  # first: it sets TF_USE_LEGACY_KERAS
        import numpy as np
        import tensorflow as tf
        model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(4, activation="relu"),
                                     tf.keras.layers.Dense(1)])  # built: BackupAndRestore can restore it
        model.compile(optimizer="sgd", loss="mse")
        x, y = np.random.default_rng(0).normal(size=(2, 800, 8)).astype("float32")
        history = model.fit(x, y[:, :1], batch_size=16, epochs=2, verbose=0,
                            callbacks=fit_callbacks("backup", save_every=20, global_batch_size=16,
                                                    fast_tier=sys.argv[1] == "fast"))
        fit_over.set()
        listener.join()
        reports = []
        for message in map(decode, received):
            reports.append({"step": message.step, "examples": message.examples, "loss": message.loss,
                            "ckpt": message.checkpoint_step, "done": message.done, "phase": message.phase.value,
                            "stall": message.stall, "restored": message.restored_tier,
                            "restored_step": message.restored_step})
        losses = history.history.get("loss", [None])  # none when it resumed at the end
        print(json.dumps({"reports": reports, "last_loss": losses[-1]}))
"""


def test_fit_on_the_fast_tier_reports_each_snapshot_its_stall_and_the_restore(tmp_path: Path) -> None:
    """The default fit_callbacks: saves are announced, each snapshot is reported once complete, with the time it
    held training up; the restore is reported with its tier."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(FIT_REPORTING), "fast"], cwd=tmp_path,
                            env=worker_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    reports = json.loads(result.stdout.splitlines()[-1])["reports"]
    assert [r["restored"] for r in reports if r["restored"]] == ["none"], reports
    assert [r["step"] for r in reports if r["phase"] == "save"] == [20, 40, 60, 80, 100, 100], reports
    snapshots_reported = [r for r in reports if r["ckpt"] is not None]
    assert sorted({r["ckpt"] for r in snapshots_reported}) == [20, 40, 60, 80, 100], reports
    stalls = [(r["step"], r["stall"]) for r in reports if r["stall"] is not None]  # one report per save
    assert [step for step, _ in stalls] == [20, 40, 60, 80, 100] and all(0 <= t < 30 for _, t in stalls), reports
    assert all(r["step"] >= r["ckpt"] for r in snapshots_reported), reports  # reported once complete, not before
    assert reports[-1]["done"] and reports[-1]["ckpt"] == 100, reports
    # Without an agent there is no local tier: the chief writes the shared one itself, the 3 newest.
    assert sorted(p.name for p in (tmp_path / "backup").iterdir()) == [snapshot_name(s) for s in (60, 80, 100)]


def test_fit_reports_step_examples_loss_and_each_saved_checkpoint_to_the_agent(tmp_path: Path) -> None:
    """What the agent reads from a model.fit with tf_keras's BackupAndRestore (``fast_tier=False``), received on
    a real progress socket."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(FIT_REPORTING), "synchronous"], cwd=tmp_path,
                            env=worker_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    outcome = json.loads(result.stdout.splitlines()[-1])
    reports = outcome["reports"]
    assert reports[0]["step"] == 0 and not reports[0]["done"] and reports[0]["phase"] == "setup", reports[0]
    # Each save is announced before it is made (the agent's learned hang detection allows it its own time), and
    # each epoch's end (the next epoch's input pipeline) is a setup phase.
    for i, r in enumerate(reports):
        if r["ckpt"] is not None:
            assert reports[i - 1]["phase"] == "save" and reports[i - 1]["step"] == r["ckpt"], reports[i - 1:i + 1]
    # Step 100: BackupAndRestore's own save, then GracefulStopCallback's final one.
    assert [r["step"] for r in reports if r["phase"] == "save"] == [20, 40, 60, 80, 100, 100], reports
    # The end of each epoch (validation, epoch-end savers, the next epoch's input) is announced at its last
    # batch: step 50; at step 100 the save announced there covers it.
    # The restore (none: a fresh directory) and the start of training, then the first epoch's end.
    assert [r["step"] for r in reports if r["phase"] == "setup"] == [0, 0, 50], reports
    assert [(r["restored"], r["restored_step"]) for r in reports if r["restored"]] == [("none", None)], reports
    assert all(r["examples"] == 16 * r["step"] for r in reports if r["examples"] is not None), reports
    # BackupAndRestore saves every 20 of the 100 steps, and the final state is saved at the end of fit.
    assert sorted({r["ckpt"] for r in reports if r["ckpt"] is not None}) == [20, 40, 60, 80, 100], reports
    assert [r["step"] for r in reports if r["ckpt"] is not None and r["ckpt"] != r["step"]] == [], reports
    # The end of fit, then its final save: both say training is done, so the agent does not take the silent work
    # after fit (evaluation, export) for a hang.
    assert [r for r in reports if r["done"]] == [
        {"step": 100, "examples": 1600, "loss": pytest.approx(outcome["last_loss"], rel=1e-5), "ckpt": None,
         "done": True, "phase": "train", "stall": None, "restored": None, "restored_step": None},
        {"step": 100, "examples": None, "loss": None, "ckpt": 100, "done": True, "phase": "train", "stall": None,
         "restored": None, "restored_step": None}], reports
    assert reports[-1]["done"], reports


def test_fit_reports_the_step_tf_keras_backup_and_restore_resumed_from(tmp_path: Path) -> None:
    """The agent's resume point (steps redone, the goodput ledger) is the step restored, reported before the
    first step: not the first step's report, one step later."""
    for _ in range(2):  # the second fit restores the first one's final save, at step 100
        (tmp_path / "progress.sock").unlink(missing_ok=True)  # the first one's agent socket
        result = subprocess.run([sys.executable, "-c", textwrap.dedent(FIT_REPORTING), "synchronous"],
                                cwd=tmp_path, env=worker_env(), capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stdout + result.stderr
    reports = json.loads(result.stdout.splitlines()[-1])["reports"]
    assert [(r["restored"], r["restored_step"], r["phase"]) for r in reports if r["restored"]] == [
        ("shared", 100, "setup")], reports
    assert reports[0]["restored"] == "shared", reports  # its first report, before any step of this fit


# ---------------------------------------------------------------------------------------------- Keras-3 guard

def test_tensorflow_imported_before_the_variable_is_refused_with_the_fix(tmp_path: Path) -> None:
    result = python(tmp_path, """
        import os
        os.environ.pop("TF_USE_LEGACY_KERAS", None)
        import tensorflow as tf
        from tfelastic.trainer.strategy import make_strategy  # the library refuses as soon as it is imported
        make_strategy()
    """)
    assert result.returncode != 0
    assert "KerasVersionError: tf.keras is Keras 3 in this process (TensorFlow was imported with " \
           "TF_USE_LEGACY_KERAS unset)" in result.stderr, result.stderr
    assert "Set TF_USE_LEGACY_KERAS=1 before TensorFlow is imported" in result.stderr
    assert "pip install tf-keras" in result.stderr


def test_a_variable_that_selects_keras_3_and_a_keras_3_model_are_refused(tmp_path: Path) -> None:
    result = python(tmp_path, """
        try:
            import tfelastic.trainer.strategy
        except Exception as e:
            print(f"{type(e).__name__}: {e}")
        import keras
        from tfelastic.trainer.tfkeras import check_model
        try:
            check_model(keras.Sequential([keras.layers.Input((2,)), keras.layers.Dense(1)]))
        except Exception as e:
            print(f"{type(e).__name__}: {e}")
    """, env={"TF_USE_LEGACY_KERAS": "0"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("KerasVersionError: TF_USE_LEGACY_KERAS='0' makes tf.keras Keras 3"), lines
    assert lines[1].startswith("KerasVersionError: the model is a Keras 3 model (keras."), lines


LOSS_SCALE = """
    import json, os, socket, sys
    from tfelastic.trainer.progress import SOCKET_ENV, decode
    path = os.path.abspath(f"progress-{os.getpid()}.sock")
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    agent.bind(path)
    os.environ[SOCKET_ENV] = path
    from tfelastic.trainer.callbacks import ProgressCallback  # first: it sets TF_USE_LEGACY_KERAS
    from tfelastic.trainer.strategy import make_strategy
    import numpy as np
    import tensorflow as tf
    strategy = make_strategy()
    with strategy.scope():  # predicts 0 and never learns: the mean squared error of targets 1 is 1, exactly
        model = tf.keras.Sequential([tf.keras.layers.Dense(1, kernel_initializer="zeros", use_bias=False)])
        model.compile(optimizer=tf.keras.optimizers.SGD(learning_rate=0.0), loss="mse")
    x, y = np.ones((256, 4), "float32"), np.ones((256, 1), "float32")
    history = model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[ProgressCallback()])
    agent.setblocking(False)
    losses = []
    while True:
        try:
            message = decode(agent.recv(4096))
        except BlockingIOError:
            break
        if message.loss is not None:
            losses.append(message.loss)
    print(json.dumps({"example": "loss-scale", "losses": losses, "keras": history.history["loss"][-1]}))
"""


def test_the_loss_reported_on_two_workers_is_the_mean_not_the_sum(tmp_path: Path) -> None:
    """tf_keras sums each replica's per-batch loss across MultiWorkerMirroredStrategy (its "auto" reduction);
    the agent must see the loss Keras reports for the epoch, whatever the world size."""
    script = tmp_path / "loss_scale.py"
    script.write_text(textwrap.dedent(LOSS_SCALE))
    workers = WorkerSet(tmp_path, [sys.executable, str(script)], size=2).start()
    assert workers.wait() == [0, 0], workers.logs()
    for summary in workers.summaries():
        assert summary["keras"] == pytest.approx(1.0)
        assert summary["losses"] and all(loss == pytest.approx(1.0) for loss in summary["losses"]), summary


def test_a_job_saved_by_backup_and_restore_resumes_on_the_fast_tier(tmp_path: Path) -> None:
    """Upgrading in the middle of a job: fit_callbacks(fast_tier=False) saved tf_keras checkpoints; the fast tier
    finds no snapshot, restores the newest of those, and carries on in snapshots."""
    run = """
        import sys
        from tfelastic.trainer.callbacks import fit_callbacks
        import numpy as np, tf_keras as keras
        model = keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(0.01), "mse")
        x = np.random.default_rng(0).normal(size=(320, 8)).astype("float32")
        callbacks = fit_callbacks("backup", save_every=7, fast_tier=sys.argv[1] == "fast")
        model.fit(x, x.sum(1, keepdims=True), batch_size=32, epochs=int(sys.argv[2]), verbose=0, callbacks=callbacks)
        restored = getattr(callbacks[1], "restored", None)
        print(restored and restored.step, int(model.optimizer.iterations.numpy()))
    """
    for variant, epochs, expected in (("synchronous", "2", "None 20"), ("fast", "3", "20 30")):
        result = subprocess.run([sys.executable, "-c", textwrap.dedent(run), variant, epochs], cwd=tmp_path,
                                env=worker_env(), capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.splitlines()[-1] == expected
    assert snapshot_name(30) in {p.name for p in (tmp_path / "backup").iterdir()}


STEP_MARKS = """
    import json, os, socket, sys
    from tfelastic.trainer import progress
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    agent.bind(os.path.abspath(f"progress-{os.getpid()}.sock"))
    mark = os.path.abspath("step")
    progress.reset_step_mark(mark)
    os.environ.update({progress.SOCKET_ENV: agent.getsockname(), progress.STEP_FILE_ENV: mark,
                       progress.GENERATION_ENV: "2"})
    from tfelastic.trainer.callbacks import ProgressCallback  # first: it sets TF_USE_LEGACY_KERAS
    import numpy as np, tf_keras as keras

    class Check(keras.callbacks.Callback):
        seen = []
        def on_train_batch_end(self, batch, logs=None):  # after ProgressCallback's: its mark against the truth
            self.seen.append((progress.read_step_mark(mark, 2), int(self.model.optimizer.iterations.numpy())))

    model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse", steps_per_execution=int(sys.argv[1]))
    x = np.ones((64, 4), "float32")
    model.fit(x, x[:, :1], batch_size=4, epochs=3, verbose=0, callbacks=[ProgressCallback(), Check()])
    print(json.dumps(Check.seen))
"""


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_progress_callback_marks_every_batchs_step_in_the_step_file(tmp_path: Path, steps_per_execution: int) -> None:
    """Most batches send no report (at most one every 0.1 s): their steps are counted, not read, and must be the
    optimizer's, across epochs and with several steps per call."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(STEP_MARKS), str(steps_per_execution)],
                            cwd=tmp_path, env=worker_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    assert len(seen) == 3 * -(-16 // steps_per_execution) and seen[-1] == [48, 48], seen
    assert all(marked == step for marked, step in seen), seen
