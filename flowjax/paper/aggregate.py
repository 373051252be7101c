"""Seed statistics of a paper table's runs, as markdown and CSV beside the paper's figures.

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
benefiting nor hurt.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
from typing import Any, Iterable, Mapping, Sequence

from flowjax.paper.figures import PaperFigure, paper_delta, paper_figure
from flowjax.paper.plan import (DATASETS, METRIC_TITLES, Cell, Delta, Row, TableSpec,
                                cell_name)

Results = Mapping[Cell, Mapping[str, Any]]
POPULATION_ORDER = ("train_clients", "held_out_clients")
POPULATION_NOTES = {
    "train_clients": "the training clients' test splits, as the paper evaluates",
    "held_out_clients": "clients never sampled in training (not in the paper)",
}
CSV_HEADER = ("table", "dataset", "row", "variant", "population", "metric", "mean_pct",
              "std_pct", "n_seeds", "n_expected", "seeds", "paper_pct", "paper_spread_pct",
              "paper_source")


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


# ---------------------------------------------------------------- one table


@dataclasses.dataclass(frozen=True)
class Entry:
    """One table entry: ours, the paper's, and why ours may be absent.

    Attributes:
      row: the row's label; variant: its method or ablation (``plus - minus`` for a delta).
      metric: the results field read (``acc_p_soft`` for the soft-policy row).
      stats: ours over the seeds; paper: the paper's figure, if it has one.
      status: ``ok``; ``not_applicable`` (the paper's "-": a metric the method lacks);
        ``not_run`` (a cell the paper did not run, left out of the grid).
      delta: a difference the paper states in words, paired per seed.
    """

    table: str
    dataset: str
    row: str
    variant: str
    population: str
    metric: str
    stats: SeedStats
    paper: PaperFigure | None
    status: str = "ok"
    delta: bool = False

    @property
    def label(self) -> str:
        text = f"{self.row} (`{self.variant}`)"
        return f"*{text}*" if self.delta else text


def _row_entries(spec: TableSpec, row: Row, results: Results, datasets: Sequence[str],
                 seeds: Sequence[int], population: str, skipped: set[tuple[str, str]]
                 ) -> list[Entry]:
    entries = []
    for dataset in datasets:
        for metric in spec.metrics:
            field = row.field(metric)
            stats = seed_stats(metric_by_seed(results, dataset, row.variant, population, field),
                               seeds)
            # A metric that the row's finished runs do not report (the client snapshot of a
            # method without one) is absent by definition, not a missing seed.
            unreported = stats.n == 0 and finished_seeds(results, dataset, row.variant,
                                                         population)
            status = ("not_applicable" if (row.variant, metric) in spec.not_applicable
                      or unreported
                      else "not_run" if (row.variant, dataset) in skipped and stats.n == 0
                      else "ok")
            entries.append(Entry(spec.name, dataset, row.label, row.variant, population, field,
                                 stats, paper_figure(dataset, row.variant, field), status))
    return entries


def _delta_entries(spec: TableSpec, delta: Delta, results: Results, datasets: Sequence[str],
                   seeds: Sequence[int], population: str) -> list[Entry]:
    name, entries = f"{delta.plus} - {delta.minus}", []
    for dataset in datasets:
        for metric in spec.metrics:
            if metric not in delta.metrics:
                entries.append(Entry(spec.name, dataset, delta.label, name, population, metric,
                                     SeedStats((), (), len(seeds)), None, "not_applicable",
                                     delta=True))
                continue
            by_seed = paired_differences(
                metric_by_seed(results, dataset, delta.plus, population, metric),
                metric_by_seed(results, dataset, delta.minus, population, metric))
            entries.append(Entry(spec.name, dataset, delta.label, name, population, metric,
                                 seed_stats(by_seed, seeds),
                                 paper_delta(delta.key, dataset, metric), delta=True))
    return entries


def table_entries(spec: TableSpec, results: Results, datasets: Sequence[str],
                  seeds: Sequence[int], methods: Sequence[str] | None = None,
                  skipped: Iterable[tuple[str, str]] = ()) -> dict[str, list[list[Entry]]]:
    """Per population, the table's rows (then its paper-stated differences) of entries.

    Args:
      spec: the table.
      results: finished cells' results.
      datasets: the columns, in order.
      seeds: the seeds asked for.
      methods: the variants to show (default: all the table's rows).
      skipped: ``(variant, dataset)`` cells left out of the grid (shown as not run).
    """
    shown = set(methods) if methods is not None else set(spec.variants)
    skipped = set(skipped)
    table = {}
    for population in populations_of(results):
        lines = [_row_entries(spec, row, results, datasets, seeds, population, skipped)
                 for row in spec.rows if row.variant in shown]
        lines += [_delta_entries(spec, delta, results, datasets, seeds, population)
                  for delta in spec.deltas if {delta.plus, delta.minus} <= shown]
        table[population] = lines
    return table


def _pct(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.4f}"


def _paper_text(paper: PaperFigure | None) -> str:
    if paper is None:
        return "paper —"
    spread = "" if paper.spread is None else f" ± {paper.spread:.2f}"
    return f"paper {paper.value:.2f}{spread}"


def format_entry(entry: Entry) -> str:
    """``ours mean ± std [n=k of N] (paper X ± Y)``, in percent, for the markdown."""
    paper = _paper_text(entry.paper)
    if entry.status == "not_applicable":
        return "—"
    if entry.status == "not_run":
        return f"not run ({paper})"
    stats = entry.stats
    if stats.n == 0:
        return f"missing, 0 of {stats.expected} seeds ({paper})"
    ours = f"{100 * stats.mean:.2f}"
    if stats.std is not None:
        ours += f" ± {100 * stats.std:.2f}"
    if not stats.complete:
        ours += f" [n={stats.n} of {stats.expected}]"
    return f"{ours} ({paper})"


def table_markdown(spec: TableSpec, entries: Mapping[str, list[list[Entry]]],
                   datasets: Sequence[str], seeds: Sequence[int], header: str) -> str:
    """The table in the paper's layout: rows = methods, columns = dataset x metric."""
    seed_text = ", ".join(map(str, seeds))
    lines = [header, "", f"# {spec.title}", "",
             f"Reproduces the paper's {', '.join(spec.tex_labels)}. Each entry: ours, the "
             f"mean ± sample standard deviation (ddof=1) over seeds {seed_text}, in percent; "
             "`[n=k of N]` marks seeds whose run has not finished (left out, not imputed); "
             "then the paper's figure ± its spread across its 3 seeds. `—`: no number; "
             "`not run`: a cell the paper did not run either. Accuracies average each "
             "client's accuracy over clients (the paper's Acc_g, Acc_p); `% Acc_p > Acc_g` "
             "counts clients strictly improved, tied clients are `% ties`."]
    columns = [f"{DATASETS[d].title} {METRIC_TITLES[m]}" for d in datasets for m in spec.metrics]
    for population, rows in entries.items():
        lines += ["", f"## {population}: {POPULATION_NOTES.get(population, population)}", "",
                  "| " + " | ".join(["method", *columns]) + " |",
                  "|" + "---|" * (len(columns) + 1)]
        for row in rows:
            lines.append("| " + " | ".join([row[0].label, *map(format_entry, row)]) + " |")
    return "\n".join(lines) + "\n"


def table_csv(entries: Mapping[str, list[list[Entry]]]) -> str:
    """One line per (table, dataset, row, population, metric); numbers in percent."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_HEADER)
    for rows in entries.values():
        for row in rows:
            for e in row:
                if e.status == "not_applicable":
                    continue
                paper = e.paper
                writer.writerow([
                    e.table, e.dataset, e.row, e.variant, e.population, e.metric,
                    _pct(e.stats.mean), _pct(e.stats.std), e.stats.n, e.stats.expected,
                    " ".join(map(str, e.stats.seeds)),
                    "" if paper is None else f"{paper.value:.2f}",
                    "" if paper is None or paper.spread is None else f"{paper.spread:.2f}",
                    "" if paper is None else paper.source])
    return out.getvalue()
