"""How the fast tier (:mod:`tfelastic.trainer.tiered`) writes one snapshot into a directory: TensorFlow's
asynchronous checkpoint, or a flash snapshot (:mod:`tfelastic.trainer.flash`) once the first of TensorFlow's
snapshots shows that the checkpoint's state allows it."""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from tfelastic.trainer import flash, snapshots
from tfelastic.trainer._tf import tf

log = logging.getLogger(__name__)


class SnapshotWriter:
    """Writes ``checkpoint``'s snapshots; ``mapped_files``: how many flash data files take turns (the local
    tier's snapshots kept)."""

    def __init__(self, checkpoint: Any, mapped_files: int = 2) -> None:
        self.checkpoint = checkpoint
        self._mapped_files = mapped_files
        self._options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)
        self._flash: flash.FlashWriter | None = None
        self._reference: str | None = None  # the first snapshot TensorFlow wrote, until the choice
        self._chosen = False
        self.last_was_flash = False

    @property
    def flash(self) -> bool:
        """Whether the next snapshot that need not be portable is a flash snapshot."""
        return self._flash is not None

    def choose(self, scratch: str | None) -> None:
        """Flash snapshots from now on, when the reference snapshot shows the checkpoint allows them; a reference
        in ``scratch`` (a worker that keeps no snapshot) is removed then."""
        if self._flash is not None and not self._flash.matches(self.checkpoint):
            log.info("the checkpoint's variables changed: the next snapshot is TensorFlow's, and the writer is "
                     "chosen again from it")
            self._flash.release()
            self._flash, self._chosen = None, False
        reference, self._reference = self._reference, None
        if reference is None:
            return
        self._chosen = True
        try:
            self._flash = flash.FlashWriter.from_tensorflow_snapshot(self.checkpoint, reference, self._mapped_files)
        finally:
            if scratch and reference.startswith(scratch + os.sep):
                shutil.rmtree(reference, ignore_errors=True)

    def write(self, building: str, portable: bool, recycled: str | None = None, keep_mapped: bool = False) -> None:
        """A flash snapshot, synchronously (``recycled``, ``keep_mapped``: see :meth:`FlashWriter.write`),
        unless ``portable`` or not chosen; else TensorFlow's asynchronous write, finished in TensorFlow's
        thread."""
        self.last_was_flash = self.flash and not portable
        if self._flash is None or portable:
            self.checkpoint.write(snapshots.checkpoint_prefix(building), options=self._options)
        else:
            self._flash.write(building, recycled, keep_mapped=keep_mapped)

    def write_now(self, building: str) -> None:
        """A snapshot written before returning and without creating any variable: a flash snapshot, else
        TensorFlow's synchronous write (its asynchronous one makes host copies of the variables, which under a
        distribution strategy are created with a broadcast among the workers)."""
        flash_now = self._flash is not None and self._flash.matches(self.checkpoint)  # no variable added since
        self.last_was_flash = flash_now
        if self._flash is not None and flash_now:
            self._flash.write(building)
        else:
            self.checkpoint.write(snapshots.checkpoint_prefix(building))

    def complete(self, snapshot: str) -> bool:
        """A snapshot is complete at ``snapshot`` (sealed, or a scratch one written); whether it is kept as the
        reference for the choice (the first of TensorFlow's), which then removes it if it is scratch."""
        if self._chosen or self._reference is not None or flash.is_flash(snapshot) or \
                not os.path.exists(snapshots.checkpoint_prefix(snapshot) + ".index"):
            return False
        self._reference = snapshot
        return True

    def release(self) -> None:
        """Unmaps the flash snapshots' data files (their memory is freed once removed)."""
        if self._flash is not None:
            self._flash.release()
