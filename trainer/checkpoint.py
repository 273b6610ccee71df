"""Checkpoints on shared storage that only the chief writes, and a restore that survives a torn checkpoint.

Every worker calls :meth:`ChiefCheckpointManager.save` at the same step, because saving may run collectives
(reading a sync-on-read variable, such as a BatchNormalization moving mean, all-reduces it). The chief writes
``DIR/ckpt-STEP``; another worker writes to ``DIR/workertemp_TASK`` and deletes it right after (TensorFlow's
multi-worker guide pattern), so the shared directory only ever holds the chief's checkpoints.

A kill in the middle of a save: TensorFlow writes the data and index files first and the ``checkpoint`` state
file last (an atomic rename), so the state still names the previous checkpoint. Storage can still leave a
newest checkpoint that does not restore (a truncated or missing data file on a flaky network filesystem, a full
disk): :meth:`ChiefCheckpointManager.restore` tries the checkpoints newest first and restores the newest one that
actually restores, logging the ones it skipped. Keep ``max_to_keep >= 2`` so that there is one to fall back to.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

from tfelastic.trainer._tf import tf

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "ckpt"
_NUMBERED = re.compile(rf"^{CHECKPOINT_NAME}-(\d+)\.index$")


class NoRestorableCheckpointError(RuntimeError):
    """Checkpoints exist but none of them restores; starting over silently would throw the job's work away."""


@dataclass
class RestoreResult:
    path: str | None  # None: there was no checkpoint, the state is as initialised
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, why) of newer ones that did not restore


class ChiefCheckpointManager:
    """A ``tf.train.CheckpointManager`` on ``directory`` for the chief, on a temporary path for the others."""

    def __init__(self, checkpoint: Any, directory: str, *, is_chief: bool, task_id: int = 0,
                 max_to_keep: int = 3) -> None:
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep={max_to_keep} must be at least 1 (2 or more leaves one to fall back to)")
        self.checkpoint = checkpoint
        self.directory = directory
        self.is_chief = is_chief
        self.write_directory = directory if is_chief else os.path.join(directory, f"workertemp_{task_id}")
        if not is_chief:
            _remove(self.write_directory)  # left by a kill in the middle of a save
        self._manager = tf.train.CheckpointManager(checkpoint, self.write_directory,
                                                   max_to_keep=max_to_keep if is_chief else 1,
                                                   checkpoint_name=CHECKPOINT_NAME)

    @classmethod
    def for_strategy(cls, checkpoint: Any, directory: str, strategy: Any, max_to_keep: int = 3
                     ) -> ChiefCheckpointManager:
        resolver = getattr(strategy, "cluster_resolver", None)
        task_id = int(getattr(resolver, "task_id", None) or 0)
        return cls(checkpoint, directory, is_chief=bool(strategy.extended.should_checkpoint), task_id=task_id,
                   max_to_keep=max_to_keep)

    def save(self, step: int) -> str | None:
        """Every worker calls this at the same step. Returns the chief's checkpoint path (None elsewhere)."""
        path = self._manager.save(checkpoint_number=step)
        if not self.is_chief:
            _remove(self.write_directory)
            return None
        return str(path)

    def path_for(self, step: int) -> str:
        """The chief's checkpoint prefix for ``step``, in the shared directory."""
        return os.path.join(self.directory, f"{CHECKPOINT_NAME}-{step}")

    def candidates(self) -> list[str]:
        """Checkpoint prefixes in ``directory``, newest first: those the state file lists and any other
        ``ckpt-N`` with an index file (a state file lost or damaged must not hide them)."""
        numbered: dict[int, str] = {}
        for path in self._listed() + self._on_disk():
            match = re.search(rf"{CHECKPOINT_NAME}-(\d+)$", path)
            if match:
                numbered.setdefault(int(match.group(1)), os.path.join(self.directory, os.path.basename(path)))
        return [numbered[n] for n in sorted(numbered, reverse=True)]

    def restore(self) -> RestoreResult:
        """Restores the newest checkpoint that restores. Raises :class:`NoRestorableCheckpointError` when there
        are checkpoints and none restores."""
        result = RestoreResult(None)
        for path in self.candidates():
            try:
                self.checkpoint.restore(path).expect_partial()
            except Exception as e:  # a torn file surfaces as OpError, ValueError, or IndexError ("Read less bytes")
                reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log.warning("checkpoint %s does not restore (%s); trying the previous one", path, reason)
                result.skipped.append((path, reason))
                continue
            result.path = path
            return result
        if result.skipped:
            raise NoRestorableCheckpointError(
                f"none of the {len(result.skipped)} checkpoints in {self.directory} restores: "
                + "; ".join(f"{p}: {why}" for p, why in result.skipped)
                + ". Fix the storage, or move the directory away to start from scratch")
        return result

    def _listed(self) -> list[str]:
        try:
            state = tf.train.get_checkpoint_state(self.directory)
        except (tf.errors.OpError, ValueError) as e:  # a damaged state file: fall back to the files on disk
            log.warning("checkpoint state file in %s is unreadable (%s)", self.directory, e)
            return []
        return list(state.all_model_checkpoint_paths) if state else []

    def _on_disk(self) -> list[str]:
        if not tf.io.gfile.isdir(self.directory):
            return []
        names = tf.io.gfile.listdir(self.directory)
        return [os.path.join(self.directory, n[: -len(".index")]) for n in names if _NUMBERED.match(n)]


def _remove(path: str) -> None:
    if tf.io.gfile.exists(path):
        tf.io.gfile.rmtree(path)
