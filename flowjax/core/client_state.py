"""Per-client state of stateful methods, kept on the host as stacked arrays.

Only clients that have trained own a row; every other client reads the template (the
state a client has before its first round). Memory is therefore proportional to the
clients actually visited, never to the population and never one object per client.
Rows grow by doubling, so a round's scatter is amortized O(cohort).

The rows live in host memory, so a run's need grows with the clients that train:
``memory_forecast`` says at the start how far (paper-scale Stack Overflow: about 19,427
clients of APFL's 15.45 MiB each, 293 GiB). ``client_state_disk.DiskClientStateStore``
keeps them in files of the run folder instead (``config.client_states="disk"``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any, Sequence

import jax
import numpy as np

PyTree = Any


class ClientStateStore:
    """Rows of per-client state keyed by client index.

    Example:
      >>> store = ClientStateStore({"v": np.zeros(3, np.float32)})
      >>> store.scatter(np.array([7]), {"v": np.ones((1, 3), np.float32)})
      >>> store.gather(np.array([7, 2]))["v"].tolist()
      [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    """

    # Whether a run may resume from a checkpoint older than the newest one: these rows
    # travel inside each checkpoint, so every kept checkpoint restores them.
    restores_older_checkpoints = True

    def __init__(self, template: PyTree):
        self.template = jax.tree.map(np.asarray, template)
        self._leaves, self._treedef = jax.tree.flatten(self.template)
        self._rows: dict[int, int] = {}
        self._arrays = [np.zeros((0,) + leaf.shape, leaf.dtype) for leaf in self._leaves]

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def nbytes(self) -> int:
        return sum(a[: len(self._rows)].nbytes for a in self._arrays)

    def gather(self, client_ids: Sequence[int]) -> PyTree:
        """Stacked states of ``client_ids`` (the template for unseen or padding ids < 0)."""
        client_ids = np.asarray(client_ids)
        out = []
        for leaf, array in zip(self._leaves, self._arrays):
            stacked = np.broadcast_to(leaf, (len(client_ids),) + leaf.shape).copy()
            for slot, client in enumerate(client_ids):
                row = self._rows.get(int(client))
                if row is not None:
                    stacked[slot] = array[row]
            out.append(stacked)
        return jax.tree.unflatten(self._treedef, out)

    def scatter(self, client_ids: Sequence[int], states: PyTree) -> None:
        """Stores the stacked ``states`` of ``client_ids``; padding ids (< 0) are dropped."""
        leaves = [np.asarray(x) for x in jax.tree.leaves(states)]
        if len(leaves) != len(self._leaves):
            raise ValueError(f"state has {len(leaves)} leaves, the store holds {len(self._leaves)}")
        for slot, client in enumerate(np.asarray(client_ids)):
            client = int(client)
            if client < 0:
                continue
            row = self._rows.get(client)
            if row is None:
                row = self._rows[client] = len(self._rows)
                self._grow(row + 1)
            for array, leaf in zip(self._arrays, leaves):
                array[row] = leaf[slot]

    def _grow(self, needed: int) -> None:
        capacity = len(self._arrays[0]) if self._arrays else 0
        if needed <= capacity:
            return
        capacity = max(needed, 2 * capacity, 8)
        grown = []
        for array in self._arrays:
            bigger = np.zeros((capacity,) + array.shape[1:], array.dtype)
            bigger[: len(array)] = array
            grown.append(bigger)
        self._arrays = grown

    def state_dict(self) -> dict[str, Any]:
        """Arrays for a checkpoint: the visited ids and their rows, in row order.

        The rows are views of the store, valid until its next ``scatter``: a checkpoint
        writes them before the next round, and a copy would double the host memory the
        client states take while it does (``launch/client_state_memory.py``: with 600 MB
        of rows the process peaked at 2.57 GB with a copy, 1.97 GB without).
        """
        ids = self._ids()
        return {"ids": ids, "leaves": [a[: len(ids)] for a in self._arrays]}

    def _ids(self) -> np.ndarray:
        """The stored clients' ids in row order."""
        ids = np.empty(len(self._rows), np.int64)
        for client, row in self._rows.items():
            ids[row] = client
        return ids

    def committed(self, rounds_done: int) -> None:
        """Called once the checkpoint of ``rounds_done`` holding ``state_dict`` is complete
        on disk (nothing to do for rows kept in memory)."""

    def load_state_dict(self, saved: dict[str, Any], rounds_done: int) -> None:
        """Replaces the rows by ``saved`` (what ``state_dict`` returned), from the
        checkpoint of ``rounds_done``.

        Raises:
          ValueError: ``saved`` does not hold one row per id of every leaf of the
            template, in its shape and dtype (state of another method or version).
        """
        ids, arrays = self._checked_rows(saved)
        self._rows = {int(c): r for r, c in enumerate(ids)}
        self._arrays = [array.copy() for array in arrays]

    def _checked_rows(self, saved: dict[str, Any]) -> tuple[np.ndarray, list[np.ndarray]]:
        """``saved``'s ids and leaves, checked against the template (``load_state_dict``)."""
        ids = np.asarray(saved["ids"])
        arrays = [np.asarray(a) for a in saved["leaves"]]
        if not arrays and self._leaves:
            raise ValueError("its client states are not in it but in the run folder's "
                             "client_states/ (a run with client_states='disk'); expected "
                             "--config.client_states=disk to resume it")
        if len(arrays) != len(self._leaves):
            raise ValueError(f"client states of {len(arrays)} leaves; expected "
                             f"{len(self._leaves)}, the leaves of this method's client state")
        for index, (array, leaf) in enumerate(zip(arrays, self._leaves)):
            if array.shape != (len(ids),) + leaf.shape or array.dtype != leaf.dtype:
                raise ValueError(f"client state leaf {index} is {array.dtype} "
                                 f"{array.shape}; expected {leaf.dtype} "
                                 f"{(len(ids),) + leaf.shape} (one row per stored client)")
        return ids, arrays


def expected_clients(population: int, per_round: int, rounds: int) -> float:
    """Expected number of distinct clients drawn at least once in ``rounds`` rounds of
    ``per_round`` clients drawn uniformly without replacement from ``population``: a
    round misses a given client with probability ``1 - per_round / population``."""
    return population * (1.0 - (1.0 - per_round / population) ** rounds)


@dataclasses.dataclass(frozen=True)
class MemoryForecast:
    """The space a run's client states are expected to take by its last round.

    Attributes:
      per_client_bytes: one client's state.
      clients: the expected number of clients that train (``expected_clients``).
      population: the training clients.
      available_bytes: what the rows may take: this host's physical memory, or the free
        space of the disk that holds them (None where the OS does not say).
      disk: the folder of a disk-backed store; None for rows in host memory.
    """

    per_client_bytes: int
    clients: float
    population: int
    available_bytes: int | None
    disk: str | None = None

    @property
    def total_bytes(self) -> float:
        return self.per_client_bytes * self.clients

    @property
    def exceeds_available(self) -> bool:
        return self.available_bytes is not None and self.total_bytes > self.available_bytes

    def line(self) -> str:
        """One line for the run's log."""
        medium = "host memory" if self.disk is None else f"disk in {self.disk}"
        if self.available_bytes is None:
            available = ""
        elif self.disk is None:
            available = f"; this host has {self.available_bytes / 2**30:,.1f} GiB"
        else:
            available = f"; {self.available_bytes / 2**30:,.1f} GiB free there"
        growing = ("more while the store grows and a checkpoint is written" if self.disk is None
                   else "and the undo log's copies of the rows overwritten since the last "
                        "checkpoint")
        return (f"client states: {self.per_client_bytes / 2**20:,.2f} MiB per client that "
                f"trains, about {self.clients:,.0f} of the {self.population:,} training "
                f"clients by the last round, so about {self.total_bytes / 2**30:,.2f} GiB of "
                f"{medium} ({growing}){available}")


def host_memory_bytes() -> int | None:
    """This host's physical memory, or None where ``os.sysconf`` does not report it."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def free_disk_bytes(folder: str) -> int | None:
    """Free space of the disk holding ``folder`` (or its nearest existing parent)."""
    folder = os.path.abspath(folder)
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def memory_forecast(template: PyTree, population: int, per_round: int, rounds: int,
                    available_bytes: int | None = None,
                    disk: str | None = None) -> MemoryForecast:
    """What the rows of ``template``-shaped states (arrays or ``jax.ShapeDtypeStruct``)
    are expected to take after ``rounds`` rounds of ``per_round`` clients, in host memory
    or (``disk``: the store's folder) on disk."""
    per_client = sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
                     for leaf in jax.tree.leaves(template))
    return MemoryForecast(per_client, expected_clients(population, per_round, rounds),
                          population, available_bytes, disk)
