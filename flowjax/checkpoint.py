"""Checkpoints of a run: server state, per-client states, round, metrics so far (orbax).

Nothing else is needed to resume exactly: client sampling and every PRNG key derive from
(seed, round, client id), so the round number *is* the sampler position and the PRNG
state. Orbax writes each checkpoint into a temporary folder and renames it when complete,
so a crash during a write leaves the previous checkpoint the newest usable one. Ctrl-C
(SIGINT) during a save is held until the save, and the deletion of the checkpoint it
replaces, are complete: an interrupted run never leaves a half-deleted ``checkpoints/N``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
from typing import Any, Iterator

import jax
import numpy as np
import orbax.checkpoint as ocp

from flowjax.core.durable import fsync_tree

PyTree = Any


# Held while a checkpoint is written: Ctrl-C, and the SIGTERM a scheduler sends first.
_HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Holds Ctrl-C and SIGTERM until the block is done, then delivers the first one
    received to its own handler (Ctrl-C: ``KeyboardInterrupt``).

    Only the main thread can set signal handlers; elsewhere the block runs as it is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = {signum: signal.signal(signum, lambda signum, frame: received.append(signum))
                for signum in _HELD_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received:
        signal.raise_signal(received[0])


class Checkpointer:
    """Saves and restores ``(server state, client store rows, metadata)`` by round.

    The checkpoint of step ``r`` holds the state after ``r`` completed rounds.
    """

    def __init__(self, directory: str, max_to_keep: int = 2, read_only: bool = False):
        """``read_only``: for a check that must leave the folder as it is (no folder
        created, no unfinished save cleaned up, nothing saved)."""
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=not read_only,
                                               cleanup_tmp_directories=not read_only,
                                               read_only=read_only)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_round(self) -> int | None:
        return self._manager.latest_step()

    def rounds(self) -> list[int]:
        """The rounds of the complete checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def save(self, rounds_done: int, state: PyTree, client_rows: dict[str, Any] | None,
             meta: dict[str, Any]) -> None:
        """Writes a checkpoint; returns once it is complete and durable on disk."""
        items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
        if client_rows is not None:
            items["clients"] = ocp.args.StandardSave(_rows_tree(client_rows))
        # Orbax deletes the checkpoint beyond max_to_keep file by file in its finalize
        # thread; Ctrl-C then would leave that folder half-deleted.
        with _interrupts_held():
            if not self._manager.save(rounds_done, args=ocp.args.Composite(**items)):
                # Orbax skips a round at or before its newest; a disk store told it exists
                # would then drop the undo log that restores the newest one.
                raise RuntimeError(f"checkpoint {self.directory}/{rounds_done} was not written "
                                   f"(newest: {self._manager.latest_step()}); expected a "
                                   f"round after the newest")
            self._manager.wait_until_finished()
            # Orbax renames the finished folder without syncing it; after a power loss
            # it could then stand complete-looking but empty, while the disk store
            # (told next that this checkpoint exists) drops what restores the previous one.
            fsync_tree(os.path.join(self.directory, str(rounds_done)))

    def meta(self, rounds_done: int) -> dict[str, Any]:
        """The metadata saved with a checkpoint ({} if it cannot be read)."""
        try:
            restored = self._manager.restore(
                rounds_done, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        except Exception:  # what restore() would name, when the run reads it
            return {}
        return dict(restored["meta"] or {})

    def restore(self, rounds_done: int, target_state: PyTree,
                stateful: bool) -> tuple[PyTree, dict[str, Any] | None, dict[str, Any]]:
        """``(state, client rows or None, meta)`` of a checkpoint.

        Raises:
          ValueError: the checkpoint cannot be read or does not fit the target state.
        """
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target_state)
        items = {"state": ocp.args.StandardRestore(abstract), "meta": ocp.args.JsonRestore()}
        if stateful:
            items["clients"] = ocp.args.StandardRestore()
        try:
            restored = self._manager.restore(rounds_done, args=ocp.args.Composite(**items))
        except Exception as error:  # orbax raises many types; the user needs one line
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            what = (f"checkpoint {self.directory}/{rounds_done} cannot be restored "
                    f"({type(error).__name__}: {first_line[:200]})")
            if _not_the_checkpoints_fault(error):
                raise CheckpointUnreadable(
                    f"{what}; the checkpoint may be intact: fix that and run the same "
                    f"command again (--overwrite would delete the run)") from None
            raise ValueError(f"{what}; it is corrupt or from a different model/config: use "
                             f"another --workdir or --overwrite") from None
        rows = _rows_from_tree(restored["clients"]) if stateful else None
        return _placed_like(restored["state"], target_state), rows, dict(restored["meta"])

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def checkpoint_meta(directory: str, rounds_done: int) -> dict[str, Any]:
    """The metadata saved with checkpoint ``rounds_done`` in ``directory`` ({} if it cannot
    be read), read without changing the folder."""
    checkpointer = Checkpointer(directory, read_only=True)
    try:
        return checkpointer.meta(rounds_done)
    finally:
        checkpointer.close()


class CheckpointUnreadable(ValueError):
    """A checkpoint that could not be read for a cause outside it (permissions, memory,
    the disk): not to be called corrupt, nor deleted."""


# The statuses tensorstore (which reads the arrays' data) puts first in its errors for a
# cause outside the files: absl's PERMISSION_DENIED, RESOURCE_EXHAUSTED, UNAVAILABLE.
_TENSORSTORE_NOT_THE_FILES = ("PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "UNAVAILABLE")


def _not_the_checkpoints_fault(error: BaseException) -> bool:
    """Whether reading failed for a cause outside the checkpoint's files: no permission,
    no memory, an I/O error or too many open files (a missing file is the checkpoint's)."""
    return (isinstance(error, (PermissionError, MemoryError))
            or (isinstance(error, OSError)
                and error.errno in (errno.EIO, errno.ENOMEM, errno.EMFILE, errno.ENFILE))
            or (isinstance(error, ValueError)
                and str(error).lstrip().startswith(_TENSORSTORE_NOT_THE_FILES)))


def _placed_like(restored: PyTree, target: PyTree) -> PyTree:
    """``restored`` placed as ``target`` is: orbax commits every array to its device, and
    jit lowers a committed argument to another program than an uncommitted one, so a
    leaf the fresh state left uncommitted (one device, JAX's default) comes back
    uncommitted too, and a resumed run compiles the program the uninterrupted one did."""
    return jax.tree.map(lambda r, t: r if getattr(t, "committed", True)
                        else jax.device_put(np.asarray(r)), restored, target)


def _rows_tree(rows: dict[str, Any]) -> dict[str, np.ndarray]:
    """The store's rows as a flat dict of arrays (orbax keys must be strings)."""
    tree = {"ids": np.asarray(rows["ids"])}
    if "token" in rows:  # a disk-backed store's chain (core/client_state_disk.py)
        tree["token"] = np.asarray(rows["token"])
    for i, leaf in enumerate(rows["leaves"]):
        tree[f"leaf_{i:05d}"] = np.asarray(leaf)
    return tree


def _rows_from_tree(tree: dict[str, Any]) -> dict[str, Any]:
    leaves = [np.asarray(tree[k]) for k in sorted(k for k in tree if k.startswith("leaf_"))]
    rows = {"ids": np.asarray(tree["ids"]), "leaves": leaves}
    if "token" in tree:
        rows["token"] = np.asarray(tree["token"])
    return rows
