"""Flash snapshots: a checkpoint's variables copied, in the training thread, into a data file mapped into memory
and reused from snapshot to snapshot (the fast tier's cheap write: docs/trainer.md says why), and their restore.

A snapshot directory holds ``flash.bin`` (each variable's bytes at a 64-byte aligned offset), ``flash.json`` (per
variable: its path in the object graph, TensorFlow's key, dtype, shape, offset, size and a checksum, the sum of
its 64-bit words modulo 2**64) and ``objects.pb`` (TensorFlow's object graph).

Invariants: only a checkpoint whose saved state is plain fixed-size variables in host memory is written this
way; the mapping to TensorFlow's keys is taken from, and checked against, TensorFlow's snapshot of the same
checkpoint, so :func:`restore` restores exactly what that one would (variables not created yet through
TensorFlow's deferred restore); a checksum that does not match raises :class:`FlashDamagedError`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
from google.protobuf import message
from tfelastic.trainer import snapshots
from tfelastic.trainer._tf import tf, trackable_object_graph_pb2
from tfelastic.trainer.scratch import process_temp_dir

log = logging.getLogger(__name__)

DATA, LAYOUT, OBJECTS = snapshots.FLASH_DATA, snapshots.FLASH_LAYOUT, "objects.pb"
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"  # TensorFlow's key for the object graph in a checkpoint
# tf.train.Checkpoint's count of its save() calls, which its asynchronous writer adds: not training state.
SAVE_COUNTER_KEY = "save_counter/.ATTRIBUTES/VARIABLE_VALUE"
_VALUE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
_ALIGN = 64
_CHUNK = 1 << 20  # copied and summed while still in the CPU's cache
_PIECE = 16 << 20  # a copy thread's unit of work: large variables split, small ones grouped, so that the threads
# finish together and thousands of small variables do not cost a task each
# One thread does not use the memory bandwidth a host has (measured here: 406 MB in 0.040 s with one, 0.021 s
# with two); training waits for the copy, so the CPUs it may use are free. Bandwidth saturates after a few.
COPY_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # a new file's pages faulted in at once, not one by one


class FlashDamagedError(ValueError):
    """A flash snapshot's data does not match its checksums, or is shorter than its layout says."""


@dataclass(frozen=True)
class Entry:
    path: str  # in the checkpoint's object graph, e.g. model/layer_with_weights-0/kernel
    key: str  # TensorFlow's checkpoint key
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    checksum: int = 0

    @property
    def padded(self) -> int:
        return -(-self.nbytes // 8) * 8


def checkpoint_variables(checkpoint: Any) -> dict[str, tf.Variable] | None:
    """The variables ``checkpoint`` saves, by path (the shortest, in TensorFlow's breadth-first order); None when
    it also saves something else, or a variable whose bytes cannot be copied as they are."""
    view = tf.train.TrackableView(checkpoint)
    seen, queue, found = {id(checkpoint)}, [("", checkpoint)], {}
    while queue:
        path, parent = queue.pop(0)
        for name, child in view.children(parent).items():
            if id(child) in seen:
                continue
            seen.add(id(child))
            child_path = f"{path}/{name}" if path else name
            if isinstance(child, tf.Variable):
                if child.dtype in (tf.string, tf.resource, tf.variant):
                    return None
                found[child_path] = child
            elif _saves_tensors(child):
                return None
            else:
                queue.append((child_path, child))
    return found


def _saves_tensors(trackable: Any) -> bool:
    """Whether a trackable that is not a variable has state of its own in a checkpoint (an iterator, a hash
    table): those override one of Trackable's two ways to name it."""
    base = tf.__internal__.tracking.Trackable
    kind = type(trackable)
    return getattr(kind, "_serialize_to_tensors", None) is not getattr(base, "_serialize_to_tensors", None) or \
        getattr(kind, "_gather_saveables_for_checkpoint", None) is not \
        getattr(base, "_gather_saveables_for_checkpoint", None)


def host_device(device: str) -> bool:
    """Whether a TensorFlow device name is the host's (an empty one is: the default device on a CPU host)."""
    return not device or tf.DeviceSpec.from_string(device).device_type in (None, "CPU")


def tensorflow_key(path: str) -> str:
    """TensorFlow's checkpoint key of a variable at ``path`` (its names escaped as TensorFlow escapes them)."""
    return "/".join(name.replace(".", "..").replace("/", ".S") for name in path.split("/")) + _VALUE_SUFFIX


class FlashWriter:
    """Writes flash snapshots of ``checkpoint``; built by :meth:`from_tensorflow_snapshot`."""

    def __init__(self, variables: dict[str, tf.Variable], object_graph: bytes, mapped_files: int = 2) -> None:
        self._variables = variables
        self._object_graph = object_graph
        self._maps: dict[tuple[int, int], mmap.mmap] = {}  # data files by (device, inode), mapped once each
        self._mapped_files = mapped_files
        self._layout: list[Entry] = []
        offset = 0
        for path, variable in variables.items():
            nbytes = int(np.prod(variable.shape, dtype=np.int64)) * _numpy_dtype(variable.dtype.name).itemsize
            self._layout.append(Entry(path, tensorflow_key(path), variable.dtype.name, tuple(variable.shape), offset,
                                      nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        self.size = offset
        self._tasks = _copy_tasks(self._layout)

    @classmethod
    def from_tensorflow_snapshot(cls, checkpoint: Any, snapshot: str, mapped_files: int = 2) -> FlashWriter | None:
        """A writer for ``checkpoint``, whose snapshot ``snapshot`` TensorFlow wrote; None (and why, logged) when
        its state is not all plain variables or their keys do not match that snapshot's."""
        variables = checkpoint_variables(checkpoint)
        if variables is None or any(not v.shape.is_fully_defined() for v in variables.values()):
            log.info("the checkpoint saves more than variables of fixed shape: its snapshots keep TensorFlow's "
                     "writer")
            return None
        if not all(host_device(v.device) for v in variables.values()):  # a distributed one's: its primary's
            # TensorFlow's writer copies them into host buffers it keeps, and writes while the GPUs train.
            log.info("the checkpoint's variables are not all in host memory: its snapshots keep TensorFlow's "
                     "writer")
            return None
        try:
            reader = tf.train.load_checkpoint(snapshots.checkpoint_prefix(snapshot))
            object_graph = bytes(reader.get_tensor(OBJECT_GRAPH_KEY))
        except (tf.errors.OpError, OSError, ValueError) as e:
            log.warning("could not read the reference snapshot %s (%s): its snapshots keep TensorFlow's writer",
                        snapshot, e)
            return None
        written = set(reader.get_variable_to_shape_map()) - {OBJECT_GRAPH_KEY, SAVE_COUNTER_KEY}
        ours = {tensorflow_key(path) for path in variables} - {SAVE_COUNTER_KEY}
        if ours != written:
            log.info("the checkpoint's variables do not map one to one onto TensorFlow's keys (missing %s, "
                     "unexpected %s): its snapshots keep TensorFlow's writer",
                     sorted(written - ours)[:5], sorted(ours - written)[:5])
            return None
        return cls(variables, object_graph, mapped_files)

    def matches(self, checkpoint: Any) -> bool:
        """Whether ``checkpoint`` still saves exactly the variables this writer copies (a variable created since,
        an optimizer's slots for a layer unfrozen, would otherwise be left out)."""
        variables = checkpoint_variables(checkpoint)
        return variables is not None and variables.keys() == self._variables.keys() and \
            all(variables[path] is variable for path, variable in self._variables.items())

    def write(self, building: str, recycled: str | None = None, *, keep_mapped: bool = False) -> None:
        """Writes a snapshot of the variables' values now into ``building``; ``recycled``: a data file of an
        older snapshot, no longer needed, whose memory the new one takes over. ``keep_mapped``: the file comes
        back (the local tier's turns): its mapping is kept for then, so that the copy is a plain memory copy."""
        with open(os.path.join(building, OBJECTS), "wb") as out:  # before any variable is read (see _allocate)
            out.write(self._object_graph)
        data = os.path.join(building, DATA)
        if recycled is not None:
            os.rename(recycled, data)
        fd = os.open(data, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            self._allocate(fd)
            entries = self._copy(fd, keep_mapped) if self.size else []
        finally:
            os.close(fd)
        with open(os.path.join(building, LAYOUT), "w", encoding="utf-8") as out:
            json.dump({"entries": [asdict(e) for e in entries]}, out)

    def release(self) -> None:
        """Unmaps the data files (a removed file's memory is freed once no mapping holds it)."""
        for mapped in self._maps.values():
            _close(mapped)
        self._maps.clear()

    def _allocate(self, fd: int) -> None:
        """Gives the file its size with every page allocated: a mapped page the file system cannot supply would
        kill the process (SIGBUS); allocated now, a full file system is an OSError (ENOSPC) the tier handles,
        before any variable is read (reads may be all-reduces: a retry must not repeat them on one worker)."""
        if os.fstat(fd).st_size != self.size:
            os.ftruncate(fd, self.size)
            os.posix_fallocate(fd, 0, self.size)
        elif os.fstat(fd).st_blocks * 512 < self.size:  # sparse: a snapshot whose write was cut short
            os.posix_fallocate(fd, 0, self.size)

    def _copy(self, fd: int, keep_mapped: bool) -> list[Entry]:
        mapped = self._mapping(fd) if keep_mapped else mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED | _POPULATE)
        target = np.frombuffer(mapped, dtype=np.uint8)
        try:
            return self._copy_all(target)
        finally:
            del target  # a map closes only once no array refers to it
            if not keep_mapped:
                _close(mapped)

    def _mapping(self, fd: int) -> mmap.mmap:
        status = os.fstat(fd)
        key = (status.st_dev, status.st_ino)
        if key not in self._maps:
            while len(self._maps) >= self._mapped_files:
                _close(self._maps.pop(next(iter(self._maps))))  # the oldest: its file is gone, or comes back later
            self._maps[key] = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED | _POPULATE)
        return self._maps[key]

    def _copy_all(self, target: np.ndarray) -> list[Entry]:
        """Copies every variable into ``target``, the tasks spread over :data:`COPY_THREADS` threads; the values
        are read in this thread (a read may be a collective), and referred to until every piece is copied: the
        next step updates the variables in place."""
        values = [_bytes_of(self._variables[entry.path].read_value()) for entry in self._layout]

        def copy_task(task: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
            sums = []
            for index, start, end in task:
                offset, nbytes = self._layout[index].offset, self._layout[index].nbytes
                sums.append((index, _copy_summing(values[index][start:min(end, nbytes)],
                                                  target[offset + start:offset + end])))
            return sums

        if COPY_THREADS == 1 or len(self._tasks) == 1:
            done = [copy_task(task) for task in self._tasks]
        else:
            with ThreadPoolExecutor(min(COPY_THREADS, len(self._tasks)), thread_name_prefix="tfelastic-flash") as pool:
                done = list(pool.map(copy_task, self._tasks))
        checksums = [0] * len(self._layout)
        for index, total in (piece for task in done for piece in task):
            checksums[index] = (checksums[index] + total) % 2**64
        return [replace(entry, checksum=checksum) for entry, checksum in zip(self._layout, checksums, strict=True)]


def _copy_tasks(layout: list[Entry]) -> list[list[tuple[int, int, int]]]:
    """The copy's pieces (entry index, start, end: byte offsets within the entry's padded region), at most
    :data:`_PIECE` bytes each, grouped into tasks of about that many bytes."""
    tasks: list[list[tuple[int, int, int]]] = [[]]
    size = 0
    for index, entry in enumerate(layout):
        for start in range(0, max(entry.padded, 1), _PIECE):
            end = min(start + _PIECE, entry.padded)
            if size and size + (end - start) > _PIECE:
                tasks.append([])
                size = 0
            tasks[-1].append((index, start, end))
            size += end - start
    return tasks


def _bytes_of(value: Any) -> np.ndarray:
    """A variable's value as flat bytes (no copy for a value in host memory)."""
    return np.ascontiguousarray(np.asarray(value)).reshape(-1).view(np.uint8)


def _close(mapped: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # an array of a failed copy still refers to it: freed with it
        mapped.close()


def _copy_summing(source: np.ndarray, region: np.ndarray) -> int:
    """Copies the bytes ``source`` into ``region`` (zero padding the rest: ``region`` is at most 7 bytes longer)
    and returns the sum of ``region``'s 64-bit words, modulo 2**64."""
    region[source.size:] = 0
    total = 0
    for start in range(0, region.size, _CHUNK):
        end = min(start + _CHUNK, region.size)
        np.copyto(region[start:min(end, source.size)], source[start:end])
        total += int(np.add.reduce(region[start:end].view(np.uint64), dtype=np.uint64))  # still in the cache
    return total % 2**64


def is_flash(snapshot: str) -> bool:
    return os.path.exists(os.path.join(snapshot, LAYOUT))


def data_file(snapshot: str) -> str:
    return os.path.join(snapshot, DATA)


def restore(checkpoint: Any, snapshot: str) -> None:
    """Restores ``checkpoint`` from a flash snapshot (see the module docstring). Raises
    :class:`FlashDamagedError` when its data is damaged, ValueError when it does not match the model."""
    entries = _layout(snapshot)
    # Read into memory of our own, not mapped: an assigned variable may keep the array as its buffer.
    data = np.fromfile(data_file(snapshot), dtype=np.uint8)
    values = {e.path: _checked(e, data, snapshot) for e in entries}
    variables = checkpoint_variables(checkpoint) or {}
    for entry in entries:
        if entry.path in variables:
            _assign(variables[entry.path], entry, values[entry.path], snapshot)
    if any(e.path not in variables for e in entries):
        _restore_deferred(checkpoint, entries, values, _read_bytes(os.path.join(snapshot, OBJECTS)))


def _layout(snapshot: str) -> list[Entry]:
    try:
        with open(os.path.join(snapshot, LAYOUT), encoding="utf-8") as f:
            return [Entry(**{**e, "shape": tuple(e["shape"])}) for e in json.load(f)["entries"]]
    except (ValueError, KeyError, TypeError) as e:  # the manifest's sizes match, the bytes do not
        raise FlashDamagedError(f"{snapshot}: {LAYOUT} does not read back ({e}); the snapshot is damaged") from e


def _numpy_dtype(name: str) -> np.dtype[Any]:
    return np.dtype(tf.as_dtype(name).as_numpy_dtype)  # type: ignore[no-any-return]


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _checked(entry: Entry, data: np.ndarray, snapshot: str) -> np.ndarray:
    end = entry.offset + entry.padded
    if end > data.size:
        raise FlashDamagedError(f"{snapshot}: {DATA} is {data.size} bytes, but {entry.path} ends at byte {end}; "
                                "the snapshot is damaged")
    region = data[entry.offset:end]
    total = int(np.add.reduce(region.view(np.uint64), dtype=np.uint64)) % 2**64
    if total != entry.checksum:
        raise FlashDamagedError(f"{snapshot}: the checksum of {entry.path} does not match its data "
                                f"({total} != {entry.checksum}); the snapshot is damaged")
    try:
        return region[:entry.nbytes].view(_numpy_dtype(entry.dtype)).reshape(entry.shape)
    except (TypeError, ValueError) as e:  # a layout that parses but does not describe the data
        raise FlashDamagedError(f"{snapshot}: {entry.path} ({entry.dtype} {entry.shape}) does not fit its "
                                f"{entry.nbytes} bytes ({e}); the snapshot is damaged") from e


def _assign(variable: tf.Variable, entry: Entry, value: np.ndarray, snapshot: str) -> None:
    if tuple(variable.shape) != entry.shape or variable.dtype.name != entry.dtype:
        raise ValueError(f"the model no longer matches the snapshot {snapshot}: {entry.path} is "
                         f"{variable.dtype.name} {tuple(variable.shape)} now, {entry.dtype} {entry.shape} in the "
                         "snapshot. Restore with the model that saved it, or move the backup directory (and the "
                         "local tier's) away to start from scratch")
    variable.assign(value)


def _restore_deferred(checkpoint: Any, entries: list[Entry], values: dict[str, np.ndarray],
                      object_graph: bytes) -> None:
    """Writes the snapshot as a TensorFlow checkpoint and restores that, so that TensorFlow restores variables
    created later as they appear. TensorFlow reads the files when it does: they stay until the process ends (a
    killed process's go when the next one makes such a directory: :mod:`tfelastic.trainer.scratch`). The graph's
    attributes the snapshot does not hold (the save counter) are left out, so that none is looked for."""
    try:
        graph = trackable_object_graph_pb2.TrackableObjectGraph.FromString(object_graph)
    except message.DecodeError as e:
        raise FlashDamagedError(f"{OBJECTS} does not parse ({e}); the snapshot is damaged") from e
    held = {e.key for e in entries}
    for node in graph.nodes:
        kept = [a for a in node.attributes if a.checkpoint_key in held]
        del node.attributes[:]
        node.attributes.extend(kept)
    scratch = process_temp_dir("flash-restore")
    prefix = os.path.join(scratch, snapshots.CHECKPOINT_PREFIX)
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=[e.key for e in entries] + [OBJECT_GRAPH_KEY],
                      shape_and_slices=[""] * (len(entries) + 1),
                      tensors=[values[e.path] for e in entries] + [tf.constant(graph.SerializeToString())])
    checkpoint.restore(prefix).expect_partial()
