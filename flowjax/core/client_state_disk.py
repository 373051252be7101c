"""Per-client state in memory-mapped files of the run folder, with exact resume.

For runs whose client states outgrow host memory (paper-scale Stack Overflow: 293 GiB
for APFL, ``client_state.memory_forecast``). Each leaf of the state is one file of
rows, ``leaf_NNNNN.rows`` (raw bytes, row-major, the template's dtype), mapped with
``np.memmap``; the operating system pages rows in and out, so host memory holds the
rows a round touches, not all of them. Files grow by doubling as sparse files: growing
reads and zero-fills nothing. The blocks of the rows a round adds are reserved
(``posix_fallocate``) before they are written, so a full disk raises ``OSError`` with no
row changed, not SIGBUS at a write through the map.

A checkpoint cannot copy hundreds of GiB every few rounds, so it holds only the stored
clients' ids; the rows stay in the files, which the next rounds keep overwriting. To
resume exactly from that checkpoint anyway, the first overwrite of a row after it
appends the row's checkpointed bytes to ``undo.log`` and makes the log durable
(``fsync``) *before* the row changes. A resume writes those bytes back: the files then
hold the checkpoint's rows, whatever rounds ran after it. Rows added after the
checkpoint need no copy (the checkpoint's ids do not name them). The log starts empty
at each checkpoint, so it holds at most one copy of each row overwritten since.

Each chain of attempts that writes the files has a token: a store that starts over
(no resume) writes a new log with a new token, durably, before its first row, and every
checkpoint of the chain records it. A multi-host run's checkpoint records process 0's
rows, so every process's store must start its chain with the same token
(``distributed.shared_token``). A checkpoint whose token is not the log's belongs to
rows that a later attempt started over on (an attempt with ``checkpoint_every=0`` in the
same folder, say): it is refused, since its rows are gone.

The order that makes every crash recoverable:
  0. a fresh store's first ``scatter``: the log of round -1 with the chain's new token;
  1. ``state_dict``: the rows are flushed to disk (``msync`` and ``fsync``);
  2. the checkpoint of round L is written (orbax: complete, or absent) and synced
     (``Checkpointer.save``: orbax syncs neither its files nor its rename);
  3. ``committed(L)``: a new, empty log for round L replaces the old one (atomically).
A crash before 2 completes leaves the previous checkpoint P newest and the log of P
(applied; before the first checkpoint there is none, and the run starts over). A crash
between 2 and 3 leaves checkpoint L newest and the log of P: no row
changed since 1, so the files already hold round L's rows (nothing applied). A crash
while a log record is appended leaves a torn last record, whose row was not yet
overwritten: records are checksummed and reading stops at the first bad one.
"""

from __future__ import annotations

import errno
import os
import struct
import uuid
import zlib
from typing import Any, BinaryIO, Iterator, Sequence

import numpy as np

from flowjax.core.client_state import ClientStateStore, PyTree
from flowjax.core.durable import fsync_path

UNDO_LOG = "undo.log"
# The log's header: magic, the chain's token, then the round and row count of the
# checkpoint it restores (round -1: none yet).
_MAGIC = b"FJUNDO02"
_HEADER = struct.Struct("<8s16sqq")
UNDO_HEADER_BYTES = _HEADER.size
# Each record: row index, CRC-32 of index and bytes, padding; then the row's bytes.
_RECORD = struct.Struct("<qII")
# posix_fallocate's errors of a filesystem that cannot reserve blocks (not a full one).
_NOT_SUPPORTED = {errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS}


def leaf_file(directory: str, index: int) -> str:
    """The rows file of the state's leaf ``index``."""
    return os.path.join(directory, f"leaf_{index:05d}.rows")


class DiskClientStateStore(ClientStateStore):
    """A ``ClientStateStore`` whose rows live in files of ``directory``.

    Opening a folder that holds rows reads none of them: the store is empty until
    ``load_state_dict`` (a resume) or ``scatter`` (a fresh run, which overwrites them).

    Example:
      >>> store = DiskClientStateStore({"v": np.zeros(3, np.float32)}, "/tmp/states")
      >>> store.scatter(np.array([7]), {"v": np.ones((1, 3), np.float32)})
      >>> store.gather(np.array([7, 2]))["v"].tolist()
      [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    """

    # The files hold one round's rows and the undo log takes them back to the newest
    # checkpoint's round only.
    restores_older_checkpoints = False

    def __init__(self, template: PyTree, directory: str, chain_token: bytes | None = None):
        """``chain_token``: the token of the chain this store starts if it starts one (a
        fresh run, or rows from a memory checkpoint); random if None."""
        super().__init__(template)
        self._chain_token = chain_token if chain_token is not None else uuid.uuid4().bytes
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self._row_bytes = [leaf.nbytes for leaf in self._leaves]
        # (round, rows) of the checkpoint the undo log restores; None until this store
        # starts its chain (first scatter) or resumes one.
        self._base: tuple[int, int] | None = None
        self._token = b""
        self._logged: set[int] = set()
        self._arrays = self._mapped(self._rows_in_files())

    # ------------------------------------------------------------------ files
    def _rows_in_files(self) -> int:
        files = [leaf_file(self.directory, i) for i, size in enumerate(self._row_bytes) if size]
        if not files or not all(os.path.exists(f) for f in files):
            return 0
        return min(os.path.getsize(f) // size
                   for f, size in zip(files, (s for s in self._row_bytes if s)))

    def _mapped(self, capacity: int) -> list[np.ndarray]:
        arrays = []
        for index, (leaf, size) in enumerate(zip(self._leaves, self._row_bytes)):
            shape = (capacity,) + leaf.shape
            if not size or not capacity:  # mmap cannot map zero bytes
                arrays.append(np.zeros(shape, leaf.dtype))
                continue
            file = leaf_file(self.directory, index)
            with open(file, "ab") as handle:  # creates it; a larger file keeps its tail
                if handle.tell() < capacity * size:
                    handle.truncate(capacity * size)  # sparse: no bytes written
            arrays.append(np.memmap(file, leaf.dtype, "r+", shape=shape))
        return arrays

    def _grow(self, needed: int) -> None:
        capacity = len(self._arrays[0]) if self._arrays else 0
        if needed <= capacity:
            return
        self._flush_maps()
        self._arrays = self._mapped(max(needed, 2 * capacity, 8))

    def _flush_maps(self) -> None:
        for array in self._arrays:
            if isinstance(array, np.memmap):
                array.flush()

    def _sync(self) -> None:
        """Every row written so far, durable on disk."""
        self._flush_maps()  # msync: the mapped pages into the files
        for index, size in enumerate(self._row_bytes):
            if size and os.path.exists(leaf_file(self.directory, index)):
                fsync_path(leaf_file(self.directory, index))
        fsync_path(self.directory)  # the files' entries: a first checkpoint's rows exist

    def _reserve(self, start: int, stop: int) -> None:
        """Disk blocks for rows ``start..stop-1`` before any is written.

        A full disk then raises ``OSError`` (ENOSPC) here, with no row changed, instead
        of killing the process with SIGBUS at the first write through the map into a
        sparse file's hole. Where a filesystem lacks ``fallocate``, glibc emulates it by
        writing a byte per block; where the call fails as unsupported (EOPNOTSUPP,
        EINVAL, ENOSYS), or Python lacks it, the files stay sparse as before.
        """
        if stop <= start or not hasattr(os, "posix_fallocate"):
            return
        for index, size in enumerate(self._row_bytes):
            if not size:
                continue
            descriptor = os.open(leaf_file(self.directory, index), os.O_RDWR)
            try:
                os.posix_fallocate(descriptor, start * size, (stop - start) * size)
            except OSError as error:
                if error.errno not in _NOT_SUPPORTED:
                    raise
            finally:
                os.close(descriptor)

    # ------------------------------------------------------------------ rows
    def scatter(self, client_ids: Sequence[int], states: PyTree) -> None:
        """As ``ClientStateStore.scatter``; a row the last checkpoint holds is first
        copied to the undo log (durably) if this is its first overwrite since.

        Raises:
          OSError: the disk has no room for the new clients' rows (nothing written).
        """
        if self._base is None:  # starts over: a new chain, whatever the files held
            self._token = self._chain_token
            self._start_log(-1)
        else:
            self._log_first_overwrites(np.asarray(client_ids))
        new = len({int(c) for c in np.asarray(client_ids) if c >= 0} - self._rows.keys())
        self._grow(len(self._rows) + new)
        self._reserve(len(self._rows), len(self._rows) + new)
        super().scatter(client_ids, states)

    def _log_first_overwrites(self, client_ids: np.ndarray) -> None:
        checkpointed = self._base[1]
        rows = sorted({row for row in (self._rows.get(int(c)) for c in client_ids if c >= 0)
                       if row is not None and row < checkpointed and row not in self._logged})
        if not rows:
            return
        records = []
        for row in rows:
            payload = b"".join(np.ascontiguousarray(a[row]).tobytes() for a in self._arrays)
            records.append(_RECORD.pack(row, _checksum(row, payload), 0) + payload)
        with open(os.path.join(self.directory, UNDO_LOG), "ab") as log:
            log.write(b"".join(records))
            log.flush()
            os.fsync(log.fileno())
        self._logged.update(rows)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The stored ids in row order, for a checkpoint; the rows stay in the files,
        flushed to disk here, before the checkpoint that names them is written."""
        self._sync()
        return {"ids": self._ids(), "leaves": [], "token": np.frombuffer(self._token, np.uint8)}

    def committed(self, rounds_done: int) -> None:
        """Starts the undo log of the checkpoint of ``rounds_done``, now complete."""
        self._start_log(rounds_done)

    def _start_log(self, rounds_done: int) -> None:
        """A new, empty undo log restoring ``rounds_done``'s rows, durably in place."""
        header = _HEADER.pack(_MAGIC, self._token, rounds_done, len(self._rows))
        log = os.path.join(self.directory, UNDO_LOG)
        temporary = log + ".tmp"
        with open(temporary, "wb") as handle:
            handle.write(header)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, log)
        fsync_path(self.directory)  # the rename itself
        self._base = (rounds_done, len(self._rows))
        self._logged = set()

    def load_state_dict(self, saved: dict[str, Any], rounds_done: int) -> None:
        """The rows of the checkpoint of ``rounds_done``: ``saved``'s own (a checkpoint of
        a run that kept them in memory), or the files' after the undo log is applied.

        Raises:
          ValueError: the files do not hold that checkpoint's rows (a missing or
            foreign undo log, a log of a later round, too few rows), or ``saved``'s rows
            do not fit the template.
        """
        if saved["leaves"] or not self._leaves:
            ids, arrays = self._checked_rows(saved)
            self._token = self._chain_token  # rows from a checkpoint: a new chain
            self._grow(len(ids))
            self._reserve(0, len(ids))
            self._rows = {int(c): r for r, c in enumerate(ids)}
            for array, rows in zip(self._arrays, arrays):
                array[: len(ids)] = rows
            self._sync()
        else:
            ids = np.asarray(saved["ids"])
            self._token = np.asarray(saved.get("token", []), np.uint8).tobytes()
            self._restore_files(rounds_done, len(ids))
            self._rows = {int(c): r for r, c in enumerate(ids)}
        self.committed(rounds_done)

    def _restore_files(self, rounds_done: int, count: int) -> None:
        log = os.path.join(self.directory, UNDO_LOG)
        where = f"client states in {self.directory}"
        if not os.path.exists(log):
            raise ValueError(f"{where}: no {UNDO_LOG}, so the rows cannot be matched to "
                             f"round {rounds_done}; expected the folder the run wrote (a "
                             f"multi-host run has one per process: resume with as many "
                             f"processes)")
        with open(log, "rb") as handle:  # streamed: at scale the log holds GiBs of rows
            header = handle.read(_HEADER.size)
            if len(header) < _HEADER.size or header[:8] != _MAGIC:
                raise ValueError(f"{where}: {UNDO_LOG} is not a flowjax undo log; expected the "
                                 f"log the run wrote")
            _, token, base_round, base_rows = _HEADER.unpack(header)
            if token != self._token:
                raise ValueError(f"{where} were rewritten by an attempt that started the run "
                                 f"over after the checkpoint of round {rounds_done} was written "
                                 f"(checkpoint_every=0 in this folder?), so its rows are gone; "
                                 f"expected the rows of that checkpoint's attempts")
            if base_round > rounds_done:
                raise ValueError(f"{where} are of round {base_round}, after the newest "
                                 f"checkpoint's round {rounds_done} (was a checkpoint deleted?); "
                                 f"expected round {rounds_done} or earlier")
            if base_round == rounds_done and base_rows != count:
                raise ValueError(f"{where}: {UNDO_LOG} of round {rounds_done} is for {base_rows} "
                                 f"rows; expected the {count} its checkpoint names")
            # Leaves of no bytes have no file: any count of their rows is there.
            available = self._rows_in_files() if any(self._row_bytes) else count
            if available < count:
                raise ValueError(f"{where}: the files hold {available} rows; expected the "
                                 f"{count} the checkpoint of round {rounds_done} names")
            self._arrays = self._mapped(available)
            # An older log: the files were flushed at rounds_done, unchanged since.
            if base_round == rounds_done:
                for row, payload in _records(handle, sum(self._row_bytes)):
                    offset = 0
                    for array, leaf, size in zip(self._arrays, self._leaves, self._row_bytes):
                        array[row] = np.frombuffer(payload[offset:offset + size],
                                                   leaf.dtype).reshape(leaf.shape)
                        offset += size
                self._sync()


def _records(log: BinaryIO, row_bytes: int) -> Iterator[tuple[int, bytes]]:
    """``(row, bytes)`` of the log's records from its position on, one read each, up to
    the first torn or corrupt one."""
    size = _RECORD.size + row_bytes
    while len(record := log.read(size)) == size:
        row, checksum, _ = _RECORD.unpack_from(record)
        payload = record[_RECORD.size:]
        if checksum != _checksum(row, payload):
            return
        yield row, payload


def _checksum(row: int, payload: bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(struct.pack("<q", row)))
