"""The federated data interface: client ids, sizes, and per-client numpy arrays.

Clients are ragged, so a split is stored as one concatenated array per feature plus
offsets (``client i`` owns rows ``offsets[i]:offsets[i + 1]``). That keeps memory
proportional to the data, never one Python object per client, and gives O(1) access by
client index. Larger-than-memory stores implement the same protocol.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Protocol, Sequence

import numpy as np

from flowjax.core.prng import host_rng

SPLITS = ("train", "test")


class FederatedData(Protocol):
    """What the engine needs from a federated dataset."""

    client_ids: Sequence[str]

    def num_examples(self, split: str) -> np.ndarray:
        """Examples per client, ``int64 [num_clients]``."""

    def client(self, index: int, split: str) -> dict[str, np.ndarray]:
        """Arrays ``{'x': [n, ...], 'y': [n, ...]}`` of one client."""

    @property
    def example_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Per-example shape and dtype of each feature."""


@dataclasses.dataclass(frozen=True)
class RaggedSplit:
    """One split of all clients: concatenated features and row offsets."""

    features: Mapping[str, np.ndarray]
    offsets: np.ndarray  # int64 [num_clients + 1]

    def __post_init__(self):
        offsets = np.asarray(self.offsets)
        if offsets.ndim != 1 or offsets[0] != 0 or np.any(np.diff(offsets) < 0):
            raise ValueError(f"offsets must start at 0 and be non-decreasing, got {offsets[:5]}...")
        for name, array in self.features.items():
            if len(array) != offsets[-1]:
                raise ValueError(
                    f"feature {name!r} has {len(array)} rows, offsets expect {offsets[-1]}")

    @classmethod
    def from_clients(cls, per_client: Sequence[Mapping[str, np.ndarray]],
                     spec: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> "RaggedSplit":
        sizes = [len(next(iter(c.values()))) if c else 0 for c in per_client]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        features = {}
        for name, (shape, dtype) in spec.items():
            parts = [np.asarray(c[name], dtype) for c in per_client if len(c) and len(c[name])]
            features[name] = (np.concatenate(parts) if parts
                              else np.zeros((0,) + tuple(shape), dtype))
        return cls(features, offsets)

    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    def rows(self, index: int) -> dict[str, np.ndarray]:
        lo, hi = self.offsets[index], self.offsets[index + 1]
        return {name: array[lo:hi] for name, array in self.features.items()}


@dataclasses.dataclass(frozen=True)
class ArrayFederatedData:
    """An in-memory federated dataset (the embedded data and converted small datasets).

    Attributes:
      client_ids: one id per client, aligned with the splits' offsets.
      splits: ``{'train': RaggedSplit, 'test': RaggedSplit}``.
    """

    client_ids: tuple[str, ...]
    splits: Mapping[str, RaggedSplit]

    def __post_init__(self):
        for split, ragged in self.splits.items():
            if len(ragged.offsets) != len(self.client_ids) + 1:
                raise ValueError(f"split {split!r} has {len(ragged.offsets) - 1} clients, "
                                 f"expected {len(self.client_ids)}")

    def num_examples(self, split: str) -> np.ndarray:
        return self._split(split).sizes()

    def client(self, index: int, split: str) -> dict[str, np.ndarray]:
        return self._split(split).rows(index)

    @property
    def example_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        any_split = next(iter(self.splits.values()))
        return {name: (a.shape[1:], a.dtype) for name, a in any_split.features.items()}

    def subset(self, indices: Sequence[int]) -> "ArrayFederatedData":
        """The clients at ``indices``, in that order."""
        indices = list(indices)
        splits = {}
        for split, ragged in self.splits.items():
            spec = {n: (a.shape[1:], a.dtype) for n, a in ragged.features.items()}
            splits[split] = RaggedSplit.from_clients([ragged.rows(i) for i in indices], spec)
        return ArrayFederatedData(tuple(self.client_ids[i] for i in indices), splits)

    def _split(self, split: str) -> RaggedSplit:
        if split not in self.splits:
            raise KeyError(f"unknown split {split!r}; expected one of {sorted(self.splits)}")
        return self.splits[split]


@dataclasses.dataclass(frozen=True)
class FederatedTask:
    """A dataset ready to run: training clients and the evaluation populations.

    Attributes:
      train: clients that may be sampled for training (their test splits are evaluated).
      held_out: clients that never train ("newly joined"); may be None.
      name: dataset name for reports.
      token_ids: number of token ids the data was encoded with, where the files say so
        (a converted Stack Overflow store: its words plus 4 special ids); a model must
        have exactly as many (``validation.validate_task``). None: not recorded.
    """

    train: FederatedData
    held_out: FederatedData | None
    name: str
    token_ids: int | None = None


def held_out_mask(num_clients: int, fraction: float | None, seed: int) -> np.ndarray:
    """A seeded boolean mask of the clients held out ("newly joined", never trained): a
    share ``fraction`` of them (None or 0: none), at least one, at least one kept.

    ``host_rng``: the seed's own stream (``default_rng(seed)`` below 2**32); NumPy alone
    would give seed 7 + 3 * 2**32 the words [7, 3], seed 7's round-0 sampling stream.
    """
    fraction = fraction or 0.0
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in [0, 1), got {fraction}")
    held = np.zeros(num_clients, bool)
    if fraction > 0 and num_clients > 1:
        count = min(max(int(round(fraction * num_clients)), 1), num_clients - 1)
        held[host_rng(seed).choice(num_clients, count, replace=False)] = True
    return held
