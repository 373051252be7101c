"""The values of a paper table's runs, seed by seed, read from the cells' results.

A cell's ``results.json`` (``flowjax.runner``) reports, per evaluated population, the
fractions ``acc_g``, ``acc_p``, ``acc_p_soft``, ``clients_benefiting`` (clients with
``Acc_p > Acc_g`` strictly), ``clients_tied`` (``Acc_p == Acc_g``) and ``clients_hurt``.
For each (dataset, variant, population, metric) this module takes the value of every
finished seed (``stats.seed_stats`` turns them into a mean and a sample std). Ties are
their own column: a tied client is neither benefiting nor hurt. ``flowjax.paper.tables``
lays the statistics out as the paper's tables.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from flowjax import run_folder
from flowjax.paper.plan import Cell, cell_name

Results = Mapping[Cell, Mapping[str, Any]]
POPULATION_ORDER = ("train_clients", "held_out_clients")


def load_results(root: str, cells: Iterable[Cell]) -> dict[Cell, dict[str, Any]]:
    """``results.json`` of every finished cell under ``root`` (unfinished ones are absent)."""
    found = {}
    for cell in cells:
        results = run_folder.read_results(cell.path(root), "delete the cell folder to rerun it")
        if results is not None:
            found[cell] = results
    return found


# What a cell's run folder says beyond its results (``cell_flags``).
DIVERGED = "diverged"  # stopped at a non-finite round (on_divergence="stop"): no results
DEGRADED = "degraded"  # finished past non-finite clients (on_divergence="skip_clients")


def cell_flags(root: str, cells: Iterable[Cell]) -> dict[Cell, str]:
    """``DIVERGED`` or ``DEGRADED`` for the cells whose ``metrics.jsonl`` shows a
    divergence (``run_folder.record_diverged``): an unfinished cell stopped there, a
    finished one went on past it; cells without one are absent. A ``metrics.jsonl`` that
    does not parse says nothing here (the cell's own run names it)."""
    flags = {}
    for cell in cells:
        path = cell.path(root)
        try:
            if run_folder.finished(path):
                if run_folder.went_past_a_divergence(path):
                    flags[cell] = DEGRADED
            elif any(map(run_folder.record_diverged, run_folder.read_metrics(path))):
                flags[cell] = DIVERGED
        except ValueError:
            continue
    return flags


def summed_wall_time(root: str, cells: Iterable[Cell]) -> tuple[float, int]:
    """Total ``wall_time_s`` of the cells' ``run.json`` files and how many there were."""
    total, count = 0.0, 0
    for cell in cells:
        info = run_folder.read_run_info(cell.path(root), "delete the cell folder to rerun it")
        if info is not None:
            total += float(info["wall_time_s"])
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
