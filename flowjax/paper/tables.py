"""The paper's tables from seed statistics: entries beside the paper's figures, as
markdown and CSV.

One entry per (table, dataset, row, population, metric): ours (``stats.SeedStats``
over the seeds asked for), the paper's figure and its spread (``figures``), and why ours
may be absent (the paper's "-", a cell the paper did not run, or seeds not finished).
"""

from __future__ import annotations

import csv
import dataclasses
import io
from typing import Iterable, Mapping, Sequence

from flowjax.paper.aggregate import (DEGRADED, DIVERGED, Results, finished_seeds,
                                     metric_by_seed, paired_differences, populations_of)
from flowjax.paper.figures import (AUTHORS_ACC_P_ROWS, PaperFigure, paper_delta,
                                   paper_figure)
from flowjax.paper.plan import (DATASETS, METRIC_TITLES, PAPER_DATASETS, Cell, Delta, Row,
                                TableSpec, cell_name, lacks_model)
from flowjax.paper.stats import SeedStats, seed_stats

# The population the paper's figures are of: other populations' rows get none beside them.
PAPER_POPULATION = "train_clients"
POPULATION_NOTES = {
    "train_clients": "the training clients' test splits, as the paper evaluates",
    "held_out_clients": "clients never sampled in training (not in the paper)",
}
CSV_HEADER = ("table", "dataset", "row", "variant", "population", "metric", "mean_pct",
              "std_pct", "n_seeds", "n_expected", "seeds", "paper_pct", "paper_spread_pct",
              "paper_source", "status")
# Tables written before the status column (committed ones among them) still read.
_CSV_HEADERS = (CSV_HEADER, CSV_HEADER[:-1])


@dataclasses.dataclass(frozen=True)
class Entry:
    """One table entry: ours, the paper's, and why ours may be absent.

    Attributes:
      row: the row's label; variant: its method or ablation (``plus - minus`` for a delta).
      metric: the results field read (``acc_p_soft`` for the soft-policy row).
      stats: ours over the seeds; paper: the paper's figure, if it has one.
      status: ``ok``; ``not_applicable`` (the paper's "-": a metric the method lacks);
        ``not_run`` (a cell the paper did not run, left out of the grid); ``stale``
        (some finished runs predate the metric's present meaning; ``stats`` leaves them
        out); ``unreported`` (finished runs lack a metric the paper has a figure for:
        older code); ``diverged`` (a seed's run stopped at a divergence: left out);
        ``degraded`` (a seed's run went on past non-finite clients, which it dropped from
        training or counted wrong: kept in the mean).
      delta: a difference the paper states in words, paired per seed.
      stale_seeds: how many of the seeds' finished runs are stale.
      diverged_seeds, degraded_seeds: the seeds of those two statuses.
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
    stale_seeds: int = 0
    diverged_seeds: tuple[int, ...] = ()
    degraded_seeds: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        text = f"{self.row} (`{self.variant}`)"
        return f"*{text}*" if self.delta else text


# Rows whose runs report a field only since a later commit (the marker) that also changed
# others: a finished seed without the marker predates it, and its values of those fields
# are stale, absent or counted otherwise (HypCluster's client_snapshot counted flowjax's
# Acc_p against the copy before it reported their Acc_p model).
_MARKER = "acc_p_client_snapshot"
_MARKED = ("acc_p_client_snapshot", "clients_benefiting_snapshot")


def _stale_seeds(results: Results, dataset: str, variant: str, population: str, field: str,
                 finished: set[int]) -> set[int]:
    """The ``finished`` seeds of ``variant`` whose ``field`` predates its marker."""
    if variant not in AUTHORS_ACC_P_ROWS or field not in _MARKED:
        return set()
    return finished - set(metric_by_seed(results, dataset, variant, population, _MARKER))


def _flagged_seeds(results: Results, flags: Mapping[Cell, str], dataset: str, variant: str,
                   population: str, seeds: Sequence[int]) -> tuple[tuple[int, ...],
                                                                   tuple[int, ...]]:
    """The ``seeds`` of ``variant`` that diverged, and those that went past non-finite
    clients (``flags``, or this population's ``clients_nonfinite`` in the results)."""
    name = cell_name(variant)
    flagged = {cell.seed: flag for cell, flag in flags.items()
               if cell.dataset == dataset and cell.variant == name}
    for cell, result in results.items():
        summary = result.get("populations", {}).get(population, {})
        if cell.dataset == dataset and cell.variant == name and summary.get("clients_nonfinite"):
            flagged[cell.seed] = DEGRADED
    return tuple(tuple(s for s in seeds if flagged.get(s) == flag) for flag in (DIVERGED,
                                                                               DEGRADED))


def _row_entries(spec: TableSpec, row: Row, results: Results, datasets: Sequence[str],
                 seeds: Sequence[int], population: str, skipped: set[tuple[str, str]],
                 flags: Mapping[Cell, str]) -> list[Entry]:
    entries = []
    for dataset in datasets:
        finished = finished_seeds(results, dataset, row.variant, population)
        diverged, degraded = _flagged_seeds(results, flags, dataset, row.variant, population,
                                            seeds)
        for metric in spec.metrics:
            field = row.field(metric)
            stale = _stale_seeds(results, dataset, row.variant, population, field,
                                 finished) & set(seeds)
            by_seed = metric_by_seed(results, dataset, row.variant, population, field)
            stats = seed_stats({s: v for s, v in by_seed.items() if s not in stale}, seeds)
            paper = (paper_figure(dataset, row.variant, field)
                     if population == PAPER_POPULATION else None)
            # A metric that the row's finished runs do not report (the client snapshot of a
            # method without one) is absent by definition, not a missing seed; unless the
            # paper has a figure for it, which runs of this code report.
            unreported = stats.n == 0 and finished
            if lacks_model(row.variant, metric):
                status = "not_applicable"
            elif stale:
                status = "stale"
            elif unreported:
                status = "not_applicable" if paper is None else "unreported"
            elif (row.variant, dataset) in skipped and stats.n == 0:
                status = "not_run"
            elif diverged:
                status = "diverged"
            elif degraded and stats.n:
                status = "degraded"
            else:
                status = "ok"
            entries.append(Entry(spec.name, dataset, row.label, row.variant, population, field,
                                 stats, paper, status, stale_seeds=len(stale),
                                 diverged_seeds=diverged,
                                 degraded_seeds=tuple(s for s in degraded
                                                      if s in stats.seeds)))
    return entries


def _delta_entries(spec: TableSpec, delta: Delta, results: Results, datasets: Sequence[str],
                   seeds: Sequence[int], population: str,
                   flags: Mapping[Cell, str]) -> list[Entry]:
    name, entries = f"{delta.plus} - {delta.minus}", []
    for dataset in datasets:
        # A seed whose run of either side diverged has no difference (left out); one that
        # went on past non-finite clients on either side is kept, and said, as in the rows.
        flagged = [_flagged_seeds(results, flags, dataset, variant, population, seeds)
                   for variant in (delta.plus, delta.minus)]
        diverged, degraded = (tuple(s for s in seeds if any(s in f[i] for f in flagged))
                              for i in (0, 1))
        for metric in spec.metrics:
            if metric not in delta.metrics:
                entries.append(Entry(spec.name, dataset, delta.label, name, population, metric,
                                     SeedStats((), (), len(seeds)), None, "not_applicable",
                                     delta=True))
                continue
            by_seed = paired_differences(
                metric_by_seed(results, dataset, delta.plus, population, metric),
                metric_by_seed(results, dataset, delta.minus, population, metric))
            paper = (paper_delta(delta.key, dataset, metric)
                     if population == PAPER_POPULATION else None)
            stats = seed_stats(by_seed, seeds)
            kept_degraded = tuple(s for s in degraded if s in stats.seeds)
            status = "diverged" if diverged else "degraded" if kept_degraded else "ok"
            entries.append(Entry(spec.name, dataset, delta.label, name, population, metric,
                                 stats, paper, status, delta=True, diverged_seeds=diverged,
                                 degraded_seeds=kept_degraded))
    return entries


def table_entries(spec: TableSpec, results: Results, datasets: Sequence[str],
                  seeds: Sequence[int], methods: Sequence[str] | None = None,
                  skipped: Iterable[tuple[str, str]] = (),
                  flags: Mapping[Cell, str] | None = None) -> dict[str, list[list[Entry]]]:
    """Per population, the table's rows (then its paper-stated differences) of entries.

    Args:
      spec: the table.
      results: finished cells' results.
      datasets: the columns, in order.
      seeds: the seeds asked for.
      methods: the variants to show (default: all the table's rows).
      skipped: ``(variant, dataset)`` cells left out of the grid (shown as not run).
      flags: ``aggregate.cell_flags`` of the grid's cells (diverged, degraded).
    """
    shown = set(methods) if methods is not None else set(spec.variants)
    skipped = set(skipped)
    table = {}
    for population in populations_of(results):
        lines = [_row_entries(spec, row, results, datasets, seeds, population, skipped,
                              flags or {})
                 for row in spec.rows if row.variant in shown]
        lines += [_delta_entries(spec, delta, results, datasets, seeds, population,
                                 flags or {})
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
    if entry.status == "stale":
        kept = (f"; the other {stats.n}: {_ours(stats)}" if stats.n else "")
        return (f"stale, {entry.stale_seeds} of {stats.expected} seeds (their runs predate "
                f"this figure; delete their cell folders to rerun them){kept} ({paper})")
    if entry.status == "unreported":
        return (f"unreported: its finished runs lack this field (older code; delete their "
                f"cell folders to rerun them) ({paper})")
    notes = []
    if entry.diverged_seeds:
        notes.append(f"{_seeds_text(entry.diverged_seeds)} diverged")
    if entry.degraded_seeds:
        notes.append(f"{_seeds_text(entry.degraded_seeds)} went on past non-finite clients")
    if stats.n == 0:
        return f"missing, 0 of {stats.expected} seeds{_notes(notes)} ({paper})"
    return f"{_ours(stats, notes)} ({paper})"


def _seeds_text(seeds: Sequence[int]) -> str:
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(map(str, seeds))


def _notes(notes: Sequence[str]) -> str:
    return f"; {'; '.join(notes)}" if notes else ""


def _ours(stats: SeedStats, notes: Sequence[str] = ()) -> str:
    """``mean ± std [n=k of N; notes]`` in percent."""
    ours = f"{100 * stats.mean:.2f}"
    if stats.std is not None:
        ours += f" ± {100 * stats.std:.2f}"
    if not stats.complete or notes:
        count = [] if stats.complete else [f"n={stats.n} of {stats.expected}"]
        ours += f" [{'; '.join([*count, *notes])}]"
    return ours


def _what_it_reproduces(spec: TableSpec, datasets: Sequence[str], scale: str,
                        departures: Mapping[str, Sequence[str]]) -> str:
    """The sentence naming the paper's tables behind these columns: a column of a dataset
    the paper has no figures for (Fashion-MNIST), a grid at a smaller scale than the
    paper's runs, or one whose overrides change the paper's setup, follows the layout
    only."""
    labels = ", ".join(spec.tex_labels)
    absent = [DATASETS[d].title for d in datasets if d not in PAPER_DATASETS]
    changed = "; ".join(f"{DATASETS[d].title}: {', '.join(departures[d])}"
                        for d in datasets if departures.get(d))
    overridden = (f" Its --override flags change the setup ({changed})." if changed else "")
    if len(absent) == len(datasets):
        return (f"Laid out as the paper's {labels}; the paper has no {', '.join(absent)} "
                f"figures, so it reproduces none of them.{overridden}")
    if scale != "paper":
        return (f"Laid out as the paper's {labels} at --scale={scale}, smaller than the "
                "paper's runs (fewer clients, rounds or examples), so it reproduces none of "
                f"them: the paper's figures stand beside ours for orientation only."
                f"{overridden}")
    if changed:
        return (f"Laid out as the paper's {labels}, with --override flags that change the "
                f"paper's setup ({changed}), so it reproduces none of them: the paper's "
                "figures stand beside ours for orientation only.")
    if absent:
        return (f"Reproduces the paper's {labels}, except for the {', '.join(absent)} "
                "columns, which the paper has no figures for.")
    return f"Reproduces the paper's {labels}."


def table_markdown(spec: TableSpec, entries: Mapping[str, list[list[Entry]]],
                   datasets: Sequence[str], seeds: Sequence[int], header: str,
                   scale: str = "paper",
                   departures: Mapping[str, Sequence[str]] | None = None) -> str:
    """The table in the paper's layout: rows = methods, columns = dataset x metric;
    ``scale``: the grid's ``--scale``, ``departures``: per dataset, the fields in which
    its runs depart from that scale's setup (only ``paper`` without departures reproduces
    the paper's figures)."""
    seed_text = ", ".join(map(str, seeds))
    lines = [header, "", f"# {spec.title}", "",
             f"{_what_it_reproduces(spec, datasets, scale, departures or {})} Each entry: ours, the "
             f"mean ± sample standard deviation (ddof=1) over seeds {seed_text}, in percent; "
             "`[n=k of N]`: only k seeds have a finished run (the others are not finished "
             "or were not run, as in rows run on fewer seeds; left out, not imputed); "
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


def csv_status(entry: Entry) -> str:
    """The CSV's ``status``: the entry's, with ``missing`` for an entry no seed has
    finished (the markdown's ``missing, 0 of N seeds``) and ``partial`` for one that some
    have (``[n=k of N]``), so that an empty or short mean says why."""
    if entry.status != "ok" or entry.stats.complete:
        return entry.status
    return "missing" if entry.stats.n == 0 else "partial"


def table_csv(entries: Mapping[str, list[list[Entry]]]) -> str:
    """One line per (table, dataset, row, population, metric); numbers in percent.

    ``status`` (``csv_status``): ``ok`` (every seed asked for finished), ``partial``
    (``n_seeds`` of ``n_expected``: the others not finished or not run), ``missing``
    (none finished), ``not_run`` (a cell the paper did not run either), ``stale`` (the
    mean leaves out seeds whose runs predate the figure), ``unreported`` (finished runs
    lack a field the paper has a figure for), ``diverged`` (the mean leaves out seeds
    that stopped at a divergence) or ``degraded`` (it keeps seeds that went on past
    non-finite clients). The paper's "-" (a metric the method lacks) has no line."""
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
                    "" if paper is None else paper.source, csv_status(e)])
    return out.getvalue()


def shown_outside(csv_text: str, datasets: Sequence[str], variants: Sequence[str],
                  seeds: Sequence[int], skipped: Iterable[tuple[str, str]] = ()) -> list[str]:
    """The results (``dataset/variant seed N``) that the table ``csv_text`` shows outside
    a grid of ``datasets`` x ``variants`` x ``seeds`` less the ``(variant, dataset)``
    cells it leaves out (``skipped``, shown as not run): what a table of that grid would
    lose by replacing it. A difference ``plus - minus`` is inside when both are.

    Raises:
      ValueError: ``csv_text`` is not a ``table_csv``.
    """
    reader = csv.DictReader(io.StringIO(csv_text))
    if tuple(reader.fieldnames or ()) not in _CSV_HEADERS:
        raise ValueError(f"its header is not {','.join(CSV_HEADER[:3])},...")
    inside_variants, inside_seeds = set(variants), {str(seed) for seed in seeds}
    skipped = set(skipped)
    outside = []
    for row in reader:
        parts = set(row["variant"].split(" - "))
        left_out = any((part, row["dataset"]) in skipped for part in parts)
        for seed in row["seeds"].split():
            if (row["dataset"] not in datasets or not parts <= inside_variants or left_out
                    or seed not in inside_seeds):
                outside.append(f"{row['dataset']}/{row['variant']} seed {seed}")
    return list(dict.fromkeys(outside))
