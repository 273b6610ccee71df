"""The fast tier's layout (trainer/snapshots.py): what counts as a complete snapshot, sealing, copying between
tiers, pruning, and the steps an agent reports. Real files in a temporary directory; no TensorFlow."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tfelastic.trainer import snapshots


def build(store: Path, step: int, data: bytes = b"x" * 100) -> Path:
    """A snapshot of ``step`` as a writer makes it: files in a temporary directory, then sealed."""
    building = Path(snapshots.temporary_dir(str(store), step))
    building.mkdir(parents=True)
    (building / "ckpt.index").write_bytes(b"index")
    (building / "ckpt.data-00000-of-00001").write_bytes(data)
    return Path(snapshots.seal(str(building), str(store), step))


def test_a_sealed_snapshot_is_complete_and_named_by_its_step(tmp_path: Path) -> None:
    snapshot = build(tmp_path, 120)
    assert snapshot == tmp_path / "step-000000000120"
    manifest = json.loads((snapshot / snapshots.MANIFEST).read_text())
    assert manifest == {"step": 120, "files": {"ckpt.data-00000-of-00001": 100, "ckpt.index": 5}}
    assert snapshots.is_complete(str(snapshot))
    assert snapshots.complete_steps(str(tmp_path)) == [120]
    assert snapshots.checkpoint_prefix(str(snapshot)) == str(snapshot / "ckpt")
    assert snapshots.snapshot_size(str(snapshot)) == 105  # what the local tier's room is measured by
    assert snapshots.snapshot_size(str(tmp_path / "step-000000000999")) == 0


@pytest.mark.parametrize("damage", ["truncate", "remove_data", "remove_manifest", "bad_manifest", "wrong_step"])
def test_a_damaged_snapshot_is_not_complete(tmp_path: Path, damage: str) -> None:
    build(tmp_path, 10)
    snapshot = build(tmp_path, 20)
    data, manifest = snapshot / "ckpt.data-00000-of-00001", snapshot / snapshots.MANIFEST
    if damage == "truncate":
        os.truncate(data, 50)
    elif damage == "remove_data":
        data.unlink()
    elif damage == "remove_manifest":
        manifest.unlink()
    elif damage == "bad_manifest":
        manifest.write_text("{not json")
    else:
        manifest.write_text(json.dumps({"step": 30, "files": {"ckpt.index": 5}}))
    assert snapshots.complete_steps(str(tmp_path)) == [10]


def test_a_directory_being_built_does_not_count_and_is_removed_only_when_asked(tmp_path: Path) -> None:
    build(tmp_path, 10)
    building = Path(snapshots.temporary_dir(str(tmp_path), 20))
    building.mkdir()
    (building / "ckpt.index").write_bytes(b"index")
    assert snapshots.complete_steps(str(tmp_path)) == [10]
    snapshots.prune(str(tmp_path), keep=1)
    assert building.exists()  # it may be a snapshot being written right now
    snapshots.remove_temporaries(str(tmp_path))
    assert not building.exists() and snapshots.complete_steps(str(tmp_path)) == [10]


def test_seal_refuses_a_directory_without_an_index(tmp_path: Path) -> None:
    building = tmp_path / "b"
    building.mkdir()
    (building / "ckpt.data-00000-of-00001").write_bytes(b"x")
    with pytest.raises(snapshots.NothingWritten, match="holds neither a checkpoint index nor a flash layout"):
        snapshots.seal(str(building), str(tmp_path), 5)


def test_a_second_writer_of_the_same_state_keeps_the_first_ones_snapshot(tmp_path: Path) -> None:
    """Ranks 0 and 1 both save the survivors' step: the second seal leaves the first complete snapshot alone
    (replacing it would leave no complete copy while it runs) and removes its own copy."""
    first = build(tmp_path, 37)  # its index holds b"index"
    second = Path(snapshots.temporary_dir(str(tmp_path), 37))
    second.mkdir()
    (second / "ckpt.index").write_bytes(b"other")
    assert snapshots.seal(str(second), str(tmp_path), 37, replace=False) == str(first)
    assert not second.exists() and (first / "ckpt.index").read_bytes() == b"index"
    assert snapshots.complete_steps(str(tmp_path)) == [37]


def test_prune_keeps_the_newest_complete_ones(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        build(tmp_path, step)
    os.truncate(tmp_path / "step-000000000040" / "ckpt.index", 1)
    snapshots.prune(str(tmp_path), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000000020", "step-000000000030"]


def test_copy_to_another_tier_is_complete_and_refuses_an_incomplete_source(tmp_path: Path) -> None:
    local, shared = tmp_path / "local", tmp_path / "shared"
    snapshot = build(local, 50, data=os.urandom(4096))
    copy = Path(snapshots.copy_snapshot(str(snapshot), str(shared)))
    assert copy == shared / "step-000000000050" and snapshots.complete_steps(str(shared)) == [50]
    assert (copy / "ckpt.data-00000-of-00001").read_bytes() == (snapshot / "ckpt.data-00000-of-00001").read_bytes()
    os.truncate(snapshot / "ckpt.index", 1)
    with pytest.raises(snapshots.SnapshotError, match="is not a complete snapshot"):
        snapshots.copy_snapshot(str(snapshot), str(tmp_path / "other"))
    assert not (tmp_path / "other").exists() or not list((tmp_path / "other").iterdir())


def test_restorable_steps_span_both_tiers_and_every_store_newest_first(tmp_path: Path) -> None:
    local, shared = tmp_path / "local", tmp_path / "shared"
    build(local / "fit", 40)
    build(local / "fit", 50)
    build(shared / "fit", 30)
    build(shared / "fit", 40)
    build(shared / "loop", 7)
    (shared / "not-a-store.txt").write_text("")
    assert snapshots.restorable_steps([str(local), str(shared), str(tmp_path / "missing")]) == [50, 40, 30, 7]
    assert snapshots.restorable_steps([str(local), str(shared)], limit=2) == [50, 40]


def test_the_local_tier_has_one_directory_per_job_and_node(tmp_path: Path) -> None:
    root = str(tmp_path)
    assert snapshots.local_store_root(root, "mnist", "gpu-01") == os.path.join(root, "mnist", "gpu-01")
    assert snapshots.local_store_root(root, "../x", "a/b") == os.path.join(root, ".._x", "a_b")
    assert snapshots.local_store_root(root, "..", "") == os.path.join(root, "_", "_")


def test_remove_newer_drops_another_historys_snapshots(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        build(tmp_path, step)
    assert snapshots.remove_newer(str(tmp_path), 10) == [20, 30]
    assert snapshots.complete_steps(str(tmp_path)) == [10]
    assert snapshots.remove_newer(str(tmp_path), None) == [10]
    assert snapshots.remove_newer(str(tmp_path / "missing"), None) == []


def test_prune_keeps_a_protected_snapshot_being_copied(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        build(tmp_path, step)
    snapshots.prune(str(tmp_path), keep=1, protect=(10,))
    assert snapshots.complete_steps(str(tmp_path)) == [30, 10]


def test_a_set_aside_snapshot_is_kept_under_another_name_that_no_scan_counts(tmp_path: Path) -> None:
    build(tmp_path, 10)
    snapshot = build(tmp_path, 20)
    moved = snapshots.set_aside(str(snapshot))
    assert moved is not None and Path(moved).name.startswith("damaged-step-000000000020-")
    assert snapshots.complete_steps(str(tmp_path)) == [10]
    snapshots.prune(str(tmp_path), keep=1)
    snapshots.remove_temporaries(str(tmp_path))
    assert Path(moved).is_dir()  # for an operator to look at
    assert snapshots.set_aside(str(snapshot)) is None  # gone already: nothing to rename


def test_nothing_is_removed_that_the_storage_failed_to_describe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    for step in (10, 20, 30):
        build(tmp_path, step)
    real_getsize = os.path.getsize

    def flaky(path: str) -> int:  # a network file system's transient error on one snapshot
        if "step-000000000010" in str(path):
            raise OSError(5, "Input/output error")
        return real_getsize(path)

    monkeypatch.setattr(os.path, "getsize", flaky)
    assert snapshots.complete_steps(str(tmp_path)) == [30, 20]  # not restorable while it cannot be read
    snapshots.prune(str(tmp_path), keep=1)  # 20 goes (complete, older than the one kept); 10 stays
    assert snapshots.complete_steps(str(tmp_path)) == [30]
    assert snapshots.remove_newer(str(tmp_path), None) == [30]
    monkeypatch.undo()
    assert snapshots.complete_steps(str(tmp_path)) == [10]
