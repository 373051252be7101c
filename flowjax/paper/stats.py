"""Mean and sample standard deviation of one metric over the seeds that finished.

The paper gives "variance across 3 runs" (seeds 0, 44, 56) in accuracy points and prints
it as the ± of its means without naming the estimator; with three seeds the sample
standard deviation (ddof=1, undefined for one seed) is the usual "mean ± std across runs".
A seed whose run has not finished is left out and counted as missing (``[n=2 of 3]`` in
the tables), never averaged as if complete. Plain Python, shared by the tables and the
plots (which need no experiment plan).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class SeedStats:
    """One metric over the seeds that finished, out of the seeds asked for.

    Attributes:
      seeds: the seeds with a value, in the order asked for.
      values: their values (fractions, as results.json holds them).
      expected: how many seeds were asked for.
    """

    seeds: tuple[int, ...]
    values: tuple[float, ...]
    expected: int

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float | None:
        return math.fsum(self.values) / self.n if self.values else None

    @property
    def std(self) -> float | None:
        """Sample standard deviation (ddof=1); None for fewer than two seeds."""
        if self.n < 2:
            return None
        mean = self.mean
        return math.sqrt(math.fsum((v - mean) ** 2 for v in self.values) / (self.n - 1))

    @property
    def complete(self) -> bool:
        return self.n == self.expected


def seed_stats(by_seed: Mapping[int, float], seeds: Sequence[int]) -> SeedStats:
    """Statistics of ``by_seed`` over ``seeds`` (seeds without a value are missing).

    Example:
      >>> seed_stats({0: 0.5, 44: 0.7}, [0, 44, 56]).mean
      0.6
    """
    present = [s for s in seeds if s in by_seed]
    return SeedStats(tuple(present), tuple(float(by_seed[s]) for s in present), len(seeds))
