"""Cohorts: the sampled clients' examples stacked and padded to fixed shapes.

A cohort is ``[clients, steps, batch, ...]`` plus an example mask. Every cohort of a run
has the same shape (clients per round, and examples per client fixed once from the
whole population and the cap), so the round function compiles once. Padded examples are
masked and padded steps are skipped, so padding never changes a result.
"""

from __future__ import annotations

import math
from typing import Sequence

import flax.struct
import jax
import numpy as np

from flowjax.data.federated import FederatedData


@flax.struct.dataclass
class ClientExamples:
    """One client's examples (or a stack of clients along a leading axis).

    Attributes:
      x: features ``[steps, batch, ...]``.
      y: labels ``[steps, batch, ...]``.
      mask: bool ``[steps, batch]``; False for padding.
      num_examples: int32 scalar, the number of real examples (they come first).
      client_id: int32 scalar, the client's global index (-1 for a padding client).
    """

    x: jax.Array
    y: jax.Array
    mask: jax.Array
    num_examples: jax.Array
    client_id: jax.Array

    def flat(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(x [N, ...], y [N, ...], mask [N])`` with ``N = steps * batch``."""
        def merge(a):
            return a.reshape((-1,) + a.shape[2:])
        return merge(self.x), merge(self.y), merge(self.mask)


def examples_per_client(sizes: np.ndarray, batch_size: int, cap: int | None = None) -> int:
    """The padded per-client example count: the largest (capped) client, in whole batches."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if cap is not None and cap < 1:
        raise ValueError(f"max examples per client must be >= 1 or None, got {cap}")
    largest = int(np.max(sizes)) if len(sizes) else 1
    if cap is not None:
        largest = min(largest, cap)
    return max(1, math.ceil(max(largest, 1) / batch_size)) * batch_size


def assemble_cohort(data: FederatedData, split: str, client_indices: Sequence[int], *,
                    num_clients: int, padded_examples: int, batch_size: int,
                    max_examples: int | None = None) -> ClientExamples:
    """Stacks clients into a numpy ``ClientExamples`` of ``num_clients`` clients.

    Each client keeps its first ``max_examples`` examples (the cap; all when None), and
    at most ``padded_examples``. The padded size is the cap rounded up to whole batches
    (``examples_per_client``), so it is the cap itself, not the padded size, that limits
    a client: a cap of 1,000 at batch 16 keeps 1,000 examples, in 63 batches. Missing
    clients (when fewer than ``num_clients`` are given) are padding clients with no
    examples and id -1; they weigh 0 in every mean.
    """
    if padded_examples % batch_size:
        raise ValueError(f"padded_examples={padded_examples} is not a multiple of "
                         f"batch_size={batch_size}")
    if len(client_indices) > num_clients:
        raise ValueError(f"{len(client_indices)} clients do not fit a cohort of {num_clients}")
    spec = data.example_spec
    steps = padded_examples // batch_size
    arrays = {name: np.zeros((num_clients, padded_examples) + tuple(shape), dtype)
              for name, (shape, dtype) in spec.items()}
    counts = np.zeros((num_clients,), np.int32)
    ids = np.full((num_clients,), -1, np.int32)
    for slot, index in enumerate(client_indices):
        rows = data.client(int(index), split)
        n = min(len(rows["y"]), padded_examples,
                max_examples if max_examples is not None else padded_examples)
        for name in spec:
            arrays[name][slot, :n] = rows[name][:n]
        counts[slot] = n
        ids[slot] = index
    mask = np.arange(padded_examples)[None, :] < counts[:, None]

    def to_steps(a):
        return a.reshape((num_clients, steps, batch_size) + a.shape[2:])

    return ClientExamples(x=to_steps(arrays["x"]), y=to_steps(arrays["y"]),
                          mask=to_steps(mask), num_examples=counts, client_id=ids)


def padding_efficiency(cohort: ClientExamples) -> float:
    """Useful examples / executed example slots of a cohort."""
    return float(np.sum(cohort.num_examples)) / float(np.prod(cohort.mask.shape))


def client_at(stacked: ClientExamples, slot: int) -> ClientExamples:
    """The client in slot ``slot`` of a stacked cohort."""
    return jax.tree.map(lambda a: a[slot], stacked)
