"""Seed statistics of a paper table's runs: each finished seed's value, their mean and std.

A cell's ``results.json`` (``flowjax.runner``) reports, per evaluated population, the
fractions ``acc_g``, ``acc_p``, ``acc_p_soft``, ``clients_benefiting`` (clients with
``Acc_p > Acc_g`` strictly), ``clients_tied`` (``Acc_p == Acc_g``) and ``clients_hurt``.
For each (dataset, variant, population, metric) this module takes the value of every
finished seed and reports their mean and their *sample* standard deviation (ddof=1,
undefined for one seed). The paper gives "variance across 3 runs" (seeds 0, 44, 56) in
accuracy points and prints it as the ± of its means without naming the estimator; with
three seeds the sample standard deviation is the usual "mean ± std across runs".

A seed whose run has not finished is left out and the entry says so (``[n=2 of 3]``),
never averaged as if complete. Ties are their own column: a tied client is neither
benefiting nor hurt. ``flowjax.paper.tables`` lays these statistics out as the paper's
tables.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Iterable, Mapping, Sequence

from flowjax.paper.plan import Cell, cell_name

Results = Mapping[Cell, Mapping[str, Any]]
POPULATION_ORDER = ("train_clients", "held_out_clients")


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


def load_results(root: str, cells: Iterable[Cell]) -> dict[Cell, dict[str, Any]]:
    """``results.json`` of every finished cell under ``root`` (unfinished ones are absent)."""
    found = {}
    for cell in cells:
        path = os.path.join(cell.path(root), "results.json")
        if os.path.exists(path):
            with open(path) as handle:
                found[cell] = json.load(handle)
    return found


def summed_wall_time(root: str, cells: Iterable[Cell]) -> tuple[float, int]:
    """Total ``wall_time_s`` of the cells' ``run.json`` files and how many there were."""
    total, count = 0.0, 0
    for cell in cells:
        path = os.path.join(cell.path(root), "run.json")
        if os.path.exists(path):
            with open(path) as handle:
                total += float(json.load(handle)["wall_time_s"])
            count += 1
    return total, count


def metric_by_seed(results: Results, dataset: str, variant: str, population: str,
                   field: str) -> dict[int, float]:
    """``{seed: value}`` of ``field`` for ``variant`` (any name; its cell is looked up)."""
    name = cell_name(variant)
    values = {}
    for cell, result in results.items():
        if cell.dataset == dataset and cell.variant == name:
            summary = result.get("populations", {}).get(population, {})
            if summary.get(field) is not None:
                values[cell.seed] = float(summary[field])
    return values


def finished_seeds(results: Results, dataset: str, variant: str, population: str
                   ) -> set[int]:
    """Seeds of ``variant`` whose finished results evaluated ``population``."""
    name = cell_name(variant)
    return {cell.seed for cell, result in results.items()
            if cell.dataset == dataset and cell.variant == name
            and population in result.get("populations", {})}


def paired_differences(plus: Mapping[int, float], minus: Mapping[int, float]
                       ) -> dict[int, float]:
    """``plus - minus`` per seed, for the seeds both have (same seed, same clients)."""
    return {seed: plus[seed] - minus[seed] for seed in plus if seed in minus}


def populations_of(results: Results) -> list[str]:
    """Evaluated populations found in ``results``, training clients first."""
    found = {p for result in results.values() for p in result.get("populations", {})}
    ordered = [p for p in POPULATION_ORDER if p in found]
    return ordered + sorted(found - set(ordered)) or ["train_clients"]
