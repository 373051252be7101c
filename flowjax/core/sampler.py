"""Round-indexed client sampling: the same (seed, round) always gives the same clients.

There is no sampler state to save: a run resumed at round r samples exactly what the
uninterrupted run sampled at round r.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from flowjax.core.prng import Purpose, host_rng


@dataclasses.dataclass(frozen=True)
class ClientSampler:
    """Uniform sampling without replacement within a round.

    Example:
      >>> sampler = ClientSampler(num_clients=100, clients_per_round=10, seed=0)
      >>> bool((sampler.sample(3) == sampler.sample(3)).all())
      True
    """

    num_clients: int
    clients_per_round: int
    seed: int

    def __post_init__(self):
        if self.num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {self.num_clients}")
        if not 1 <= self.clients_per_round <= self.num_clients:
            raise ValueError(
                f"clients_per_round must be in [1, {self.num_clients}] (clients available), "
                f"got {self.clients_per_round}")

    def sample(self, round_index: int) -> np.ndarray:
        """Sorted client indices (int64) of round ``round_index``."""
        rng = host_rng(self.seed, int(Purpose.SAMPLE), round_index)
        chosen = rng.choice(self.num_clients, size=self.clients_per_round, replace=False)
        return np.sort(chosen)
