"""The data of the run figures: learning curves, instance breakdown, routing.

Reads run folders as ``launch/train.py``, ``launch/compare.py`` and ``launch/reproduce.py``
write them (``config.json``, ``metrics.jsonl``, ``results.json``) and computes,
as plain arrays and dataclasses, the data of

* ``learning_curves_<dataset>.png``: Acc_g and Acc_p per evaluation round, one line per
  method (the mean over seeds, with a +-std band), one row of panels per population;
* ``breakdown_<dataset>.png``: the paper's Figure 3, one stacked bar per method (both
  correct / global only / personalized only / neither, mean over seeds);
* ``routing_q0_<dataset>_<method>.png``: the paper's routing analysis, one panel per
  instance group with a box per routed layer, for methods that route (Flow and its
  variants), over the instances of every evaluated client and seed;
* ``routing_q0_one_client_<dataset>_<method>.png``: the same for one client, as the
  paper's Appendix E draws it: the client with the highest loss difference between its
  global and personalized models (``evaluation.metrics.routing_client``), the highest
  over the seeds.

A run without ``results.json`` (still training, or killed) contributes its learning
curve up to its last evaluation, but no bar and no box: those need the final evaluation.

``workdir_plots`` names every figure the runs support and holds its data; ``plot_draw``
draws them. This module needs no matplotlib.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from flowjax import run_folder
from flowjax.algorithms import lacks_model
from flowjax.paper.stats import seed_stats
from flowjax.evaluation.metrics import GROUPS

PRIMARY = "train_clients"
CURVE_METRICS = ("acc_g", "acc_p")
# Box whiskers at these percentiles (a histogram has no individual outliers to show).
BOX_PERCENTILES = (5, 25, 50, 75, 95)
_SEED_DIR = re.compile(r"^seed_(\d+)$")


# ---------------------------------------------------------------- run files


@dataclasses.dataclass(frozen=True)
class Run:
    """One run folder's data.

    Attributes:
      path: the folder.
      dataset: ``results.json``'s or ``config.json``'s dataset ("unknown" if neither).
      method: the method or variant name the run is plotted under.
      seed: ``config.json``'s seed (else a ``seed_<n>`` folder name; None if neither).
      evals: the ``kind == "eval"`` records of ``metrics.jsonl``, in file order.
      results: ``results.json`` (None while the run has not finished).
    """

    path: str
    dataset: str
    method: str
    seed: int | None
    evals: tuple[dict[str, Any], ...]
    results: dict[str, Any] | None


class RunFileError(ValueError):
    """A run file that cannot be read (one-line message naming it)."""


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        return run_folder.read_json(path, "fix or delete it")
    except (OSError, ValueError) as error:
        raise RunFileError(" ".join(str(error).split())) from None


def read_eval_records(run_dir: str) -> list[dict[str, Any]]:
    """The evaluation records of a run's ``metrics.jsonl`` ([] when it does not exist).

    A last line that does not parse is skipped: a run being written (or killed mid-line)
    ends that way; a bad line elsewhere is an error.
    """
    try:
        return [r for r in run_folder.read_metrics(run_dir) if r.get("kind") == "eval"]
    except (OSError, ValueError) as error:
        raise RunFileError(" ".join(str(error).split())) from None


def find_run_dirs(workdir: str) -> list[str]:
    """Folders under ``workdir`` (itself included) holding ``results.json`` or
    ``metrics.jsonl``, sorted; checkpoint and plot folders are not searched."""
    found = []
    for folder, subfolders, files in os.walk(workdir):
        subfolders[:] = sorted(d for d in subfolders
                               if d not in run_folder.NOT_RUNS)
        if run_folder.is_run(folder):
            found.append(folder)
    return sorted(found)


def _group_dir(workdir: str, run_dir: str) -> tuple[str, int | None]:
    """The run's path relative to ``workdir`` without a trailing ``seed_<n>`` folder,
    and that seed."""
    parts = [p for p in os.path.relpath(run_dir, workdir).split(os.sep) if p != "."]
    seed = None
    if parts and _SEED_DIR.match(parts[-1]):
        seed = int(_SEED_DIR.match(parts[-1]).group(1))
        parts = parts[:-1]
    return "/".join(parts), seed


def _read_run(workdir: str, run_dir: str) -> dict[str, Any]:
    """A run's fields (``Run``'s, plus its ``group`` folder and ``config_dataset``)."""
    config = _read_json(run_folder.path(run_dir, run_folder.CONFIG)) or {}
    results = _read_json(run_folder.path(run_dir, run_folder.RESULTS))
    group, folder_seed = _group_dir(workdir, run_dir)
    if group:
        method = group.split("/")[-1]
    elif folder_seed is not None:  # --workdir=<grid>/<dataset>/<variant>
        method = os.path.basename(os.path.abspath(workdir))
    else:
        method = str((results or {}).get("algorithm") or config.get("algorithm") or "run")
    config_dataset = str(config.get("dataset") or "unknown")
    return dict(path=run_dir, group=group, method=method, results=results,
                config_dataset=config_dataset,
                dataset=str((results or {}).get("dataset") or config_dataset),
                seed=config.get("seed", folder_seed),
                evals=tuple(read_eval_records(run_dir)))


def _settle_datasets(loaded: list[dict[str, Any]]) -> None:
    """Gives unfinished runs the dataset name their finished siblings report.

    ``results.json`` names the task as built (``cifar10_dirichlet_0.1``), ``config.json``
    only the loader (``cifar10_dirichlet``); an unfinished run takes the name a finished
    run with the same config dataset in the same folder reports, so both plot together.
    """
    def key(run):
        return os.path.dirname(run["group"]), run["config_dataset"]

    names = {key(run): run["dataset"] for run in loaded if run["results"] is not None}
    for run in loaded:
        if run["results"] is None:
            run["dataset"] = names.get(key(run), run["dataset"])


def _disambiguate(loaded: list[dict[str, Any]]) -> None:
    """Names runs by their whole folder where two folders share (dataset, method, seed)."""
    folders: dict[tuple[str, str, Any], set[str]] = {}
    for run in loaded:
        folders.setdefault((run["dataset"], run["method"], run["seed"]), set()).add(run["group"])
    for run in loaded:
        if len(folders[(run["dataset"], run["method"], run["seed"])]) > 1:
            run["method"] = run["group"] or run["method"]


def load_runs(workdir: str) -> list[Run]:
    """Every run under ``workdir``, named as its layout implies.

    The method is the folder holding the run (``<workdir>/<method>/`` of a comparison,
    ``<dataset>/<variant>/seed_<n>/`` of a reproduction grid, ``workdir`` itself when it
    holds ``seed_<n>/`` folders); a run at ``workdir`` itself is named by its algorithm.
    When two folders would get the same (dataset, method, seed), each is named by its
    whole path under ``workdir`` instead.

    Raises:
      RunFileError: a run file is not valid JSON.
    """
    loaded = [_read_run(workdir, run_dir) for run_dir in find_run_dirs(workdir)]
    _settle_datasets(loaded)
    _disambiguate(loaded)
    fields = {f.name for f in dataclasses.fields(Run)}
    return [Run(**{k: v for k, v in run.items() if k in fields}) for run in loaded]


def select_methods(runs: Sequence[Run], methods: Sequence[str]) -> list[Run]:
    """The runs of ``methods`` (all runs when empty), e.g. one table's rows of a workdir
    that other tables' runs share.

    Raises:
      ValueError: a name that no run has (one line, with the names that exist).
    """
    if not methods:
        return list(runs)
    present = sorted({run.method for run in runs})
    unknown = [m for m in methods if m not in present]
    if unknown:
        raise ValueError(f"no run of method {', '.join(unknown)}; the runs' methods are "
                         f"{', '.join(present)}")
    return [run for run in runs if run.method in methods]


def by_dataset(runs: Iterable[Run]) -> dict[str, list[Run]]:
    """Runs grouped by dataset, datasets sorted."""
    grouped: dict[str, list[Run]] = {}
    for run in runs:
        grouped.setdefault(run.dataset, []).append(run)
    return {name: grouped[name] for name in sorted(grouped)}


def _methods_in_order(runs: Sequence[Run]) -> list[str]:
    return list(dict.fromkeys(run.method for run in runs))


def _populations_in_order(names: Iterable[str]) -> list[str]:
    names = set(names)
    return [p for p in (PRIMARY,) if p in names] + sorted(names - {PRIMARY})


# ---------------------------------------------------------------- aggregation


@dataclasses.dataclass(frozen=True)
class Band:
    """A metric across seeds per round: mean, sample standard deviation (ddof=1, as in the
    reproduce tables; 0 where one seed evaluated) and how many seeds evaluated that round."""

    rounds: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    seeds: np.ndarray


def seed_band(series: Sequence[Mapping[int, float]]) -> Band:
    """Mean and std over seeds per round; a round counts the seeds that evaluated it (an
    unfinished seed stops contributing after its last evaluation)."""
    rounds = sorted(set().union(*[set(s) for s in series])) if series else []
    stats = [seed_stats({i: s[r] for i, s in enumerate(series) if r in s}, range(len(series)))
             for r in rounds]
    return Band(rounds=np.asarray(rounds, dtype=int),
                mean=np.asarray([st.mean for st in stats], dtype=float),
                std=np.asarray([st.std or 0.0 for st in stats], dtype=float),
                seeds=np.asarray([st.n for st in stats], dtype=int))


def _without_global_model(run: Run) -> bool:
    """Whether the run's method learns no global model (Local: its Acc_g and the
    breakdown score the untrained starting model, the tables' "-")."""
    algorithm = (run.results or {}).get("algorithm") or run.method
    return lacks_model(algorithm, "acc_g")


def curve_bands(runs: Sequence[Run]) -> dict[str, dict[str, dict[str, Band]]]:
    """``{population: {metric: {method: Band}}}`` of the runs' evaluation records.

    A round evaluated twice in one file (a rerun appended to it) counts its last record.
    A method without a global model has no Acc_g curve. (FedAvg's Acc_p curve, its
    global model's accuracy, is drawn: the reference a personalized curve is read
    against.)
    """
    per_run: dict[tuple[str, str], list[dict[str, dict[int, float]]]] = {}
    for run in runs:
        series: dict[str, dict[str, dict[int, float]]] = {}
        for record in run.evals:
            population = record.get("population", PRIMARY)
            for metric in CURVE_METRICS:
                if metric == "acc_g" and _without_global_model(run):
                    continue
                if record.get(metric) is not None:
                    series.setdefault(population, {}).setdefault(metric, {})[
                        int(record["round"])] = float(record[metric])
        for population, metrics in series.items():
            per_run.setdefault((population, run.method), []).append(metrics)
    out: dict[str, dict[str, dict[str, Band]]] = {}
    methods = _methods_in_order(runs)
    for population in _populations_in_order(p for p, _ in per_run):
        out[population] = {}
        for metric in CURVE_METRICS:
            out[population][metric] = {}
            for method in methods:
                series = [s[metric] for s in per_run.get((population, method), ())
                          if metric in s]
                if series:  # none: the method lacks the metric (Local's Acc_g)
                    out[population][metric][method] = seed_band(series)
    return out


def mean_breakdowns(runs: Sequence[Run]) -> dict[str, dict[str, dict[str, float]]]:
    """``{population: {method: {group: mean fraction over seeds}}}`` of finished runs.

    A run's fractions are means over its clients (``breakdown_client_mean``), as the
    paper's Figure 3 averages them and as Acc_g and Acc_p are: both correct + global only
    is then the tables' Acc_g. Results written before that field existed give their
    instance-pooled ``breakdown``. A method without a global model has no bar: its
    "global" is the untrained starting model.
    """
    collected: dict[str, dict[str, list[Mapping[str, float]]]] = {}
    for run in runs:
        if _without_global_model(run):
            continue
        for population, summary in ((run.results or {}).get("populations") or {}).items():
            breakdown = summary.get("breakdown_client_mean") or summary.get("breakdown")
            if breakdown:
                collected.setdefault(population, {}).setdefault(run.method, []).append(
                    breakdown)
    return {population: {method: {g: float(np.mean([b.get(g, 0.0) for b in seeds]))
                                  for g in GROUPS}
                         for method, seeds in collected[population].items()}
            for population in _populations_in_order(collected)}


def _has_layers(per_group: Mapping[str, Sequence[Any]] | None) -> bool:
    return bool(per_group) and any(len(layers) > 0 for layers in per_group.values())


def routes(run: Run) -> bool:
    """Whether a finished run has per-layer q0 data (Flow-like methods)."""
    populations = (run.results or {}).get("populations") or {}
    return any(_has_layers(s.get("q0_by_group")) or _has_layers(s.get("q0_histogram"))
               for s in populations.values())


@dataclasses.dataclass(frozen=True)
class Routing:
    """One population's routing data of a method, pooled over seeds.

    Attributes:
      histograms: ``{group: [L, bins]}`` weighted instance counts per q0 bin on [0, 1].
      means: ``{group: [L]}`` exact mean q0 (NaN where a group has no instances).
      seeds: how many seeds' runs were pooled (those with ``q0_histogram``).
    """

    histograms: dict[str, np.ndarray]
    means: dict[str, np.ndarray]
    seeds: int = 1


def pooled_routing(runs: Sequence[Run]) -> dict[str, Routing]:
    """``{population: Routing}`` of one method's finished seeds.

    Seeds are pooled (histogram counts added, means weighted by each seed's instances),
    so the boxes describe every evaluated instance of every seed. Runs written before
    ``q0_histogram`` existed are skipped.
    """
    out = {}
    populations = _populations_in_order(
        p for run in runs for p in ((run.results or {}).get("populations") or {}))
    for population in populations:
        summaries = [run.results["populations"][population] for run in runs
                     if population in ((run.results or {}).get("populations") or {})]
        summaries = [s for s in summaries if _has_layers(s.get("q0_histogram"))]
        if not summaries:
            continue
        histograms, means = {}, {}
        for group in GROUPS:
            counts = [np.asarray(s["q0_histogram"][group], dtype=float) for s in summaries]
            seed_means = [np.asarray([np.nan if m is None else m for m in
                                      s.get("q0_by_group", {}).get(group, [])], dtype=float)
                          for s in summaries]
            histograms[group] = np.sum(counts, axis=0)
            means[group] = _pooled_mean(counts, seed_means)
        out[population] = Routing(histograms=histograms, means=means, seeds=len(summaries))
    return out


def _pooled_seeds(routing: Mapping[str, Routing]) -> str:
    """`` (N seeds pooled)`` for a title; per population where they differ (a seed whose
    runs lack one population's histograms)."""
    counts = {population: r.seeds for population, r in routing.items()}
    if len(set(counts.values())) > 1:
        return " (seeds pooled: " + ", ".join(f"{p} {n}" for p, n in counts.items()) + ")"
    seeds = next(iter(counts.values()))
    return f" ({seeds} seeds pooled)" if seeds > 1 else ""


@dataclasses.dataclass(frozen=True)
class ClientRouting:
    """One client's routing data (``routing_client`` of a results.json population).

    Attributes:
      routing: its histograms and exact means, as ``pooled_routing`` gives a population's.
      client_id: the client.
      seed: the run's seed (None if unknown).
      loss_g, loss_p: its mean test loss under the global and the personalized model.
    """

    routing: Routing
    client_id: str
    seed: int | None
    loss_g: float
    loss_p: float


def one_client_routing(runs: Sequence[Run]) -> dict[str, ClientRouting]:
    """``{population: ClientRouting}``: per population, the ``routing_client`` of one
    method's finished seeds with the highest ``loss_g - loss_p`` (the first on a tie).
    Runs written before ``routing_client`` existed are skipped."""
    out: dict[str, ClientRouting] = {}
    best: dict[str, float] = {}
    for run in runs:
        for population, summary in ((run.results or {}).get("populations") or {}).items():
            client = summary.get("routing_client")
            if not client:
                continue
            gap = client["loss_g"] - client["loss_p"]
            if population in best and gap <= best[population]:
                continue
            best[population] = gap
            means = {group: np.asarray([np.nan if m is None else m for m in layers], float)
                     for group, layers in client["q0_by_group"].items()}
            histograms = {group: np.asarray(h, float)
                          for group, h in client["q0_histogram"].items()}
            out[population] = ClientRouting(
                Routing(histograms=histograms, means=means), str(client["client_id"]),
                run.seed, float(client["loss_g"]), float(client["loss_p"]))
    return {p: out[p] for p in _populations_in_order(out)}


def _pooled_mean(counts: Sequence[np.ndarray], means: Sequence[np.ndarray]) -> np.ndarray:
    """Per-layer mean of several seeds' means, weighted by their instance counts."""
    layers = counts[0].shape[0]
    totals = np.zeros(layers)
    weights = np.zeros(layers)
    for count, mean in zip(counts, means):
        if mean.shape != (layers,):
            return np.full(layers, np.nan)  # no exact means stored: the boxes use bins
        weight = count.sum(axis=1)
        used = weight > 0
        totals[used] += weight[used] * mean[used]
        weights[used] += weight[used]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(weights > 0, totals / np.where(weights > 0, weights, 1), np.nan)


# ---------------------------------------------------------------- box statistics


def histogram_quantile(counts: Sequence[float], q: float, low: float = 0.0,
                       high: float = 1.0) -> float:
    """The ``q``-quantile (0..1) of values binned into equal-width bins on [low, high].

    Values are taken as spread uniformly within their bin, so the cumulative distribution
    is piecewise linear and the quantile is interpolated within the bin it falls in.

    Raises:
      ValueError: the histogram holds no mass.
    """
    counts = np.asarray(counts, dtype=float)
    total = counts.sum()
    if not total > 0:
        raise ValueError("an empty histogram has no quantiles")
    width = (high - low) / len(counts)
    filled = np.flatnonzero(counts > 0)
    target = q * total
    if target <= 0:
        return low + filled[0] * width
    cumulative = np.cumsum(counts)
    # The first bin whose cumulative count reaches the target holds it; it is never an
    # empty bin since the cumulative count rises there. Rounding can push the target
    # past the total, hence the clip to the last filled bin.
    index = min(int(np.searchsorted(cumulative, target, side="left")), int(filled[-1]))
    before = cumulative[index] - counts[index]
    fraction = min(max((target - before) / counts[index], 0.0), 1.0)
    return low + (index + fraction) * width


def histogram_box_stats(counts: Sequence[float], mean: float | None = None,
                        label: str = "") -> dict[str, Any]:
    """``Axes.bxp`` statistics of a [0, 1] histogram: quartiles, median, whiskers at the
    5th and 95th percentiles, and the mean (``mean`` if given and finite, else the
    bin-centre mean).

    Raises:
      ValueError: the histogram holds no mass.
    """
    counts = np.asarray(counts, dtype=float)
    whislo, q1, med, q3, whishi = (histogram_quantile(counts, p / 100) for p in BOX_PERCENTILES)
    if mean is None or not np.isfinite(mean):
        centres = (np.arange(len(counts)) + 0.5) / len(counts)
        mean = float(np.sum(centres * counts) / counts.sum())
    return {"label": label, "whislo": whislo, "q1": q1, "med": med, "q3": q3,
            "whishi": whishi, "mean": float(mean), "fliers": []}


# ---------------------------------------------------------------- all figures of a workdir


def run_notes(runs: Sequence[Run]) -> list[str]:
    """One line per run that some figure leaves out, saying why; and one line when every
    run evaluated at a single round, so the learning curves are single points."""
    notes = []
    for run in runs:
        if run.results is None:
            notes.append(f"{run.path}: no results.json (unfinished); learning curve only")
        elif routes(run) and not pooled_routing([run]):
            notes.append(f"{run.path}: results.json has no q0_histogram (written by an "
                         f"older flowjax); no routing boxes")
    if runs and all(len({record["round"] for record in run.evals}) <= 1 for run in runs):
        notes.append("every run evaluated at one round only (config.eval.every=0: after the "
                     "last), so the learning curves are one point per method; "
                     "--config.eval.every=N evaluates every N rounds and changes no number "
                     "of training")
    return notes


def file_stem(text: str) -> str:
    """``text`` made safe as part of a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "run"


@dataclasses.dataclass(frozen=True)
class Plot:
    """One figure's data.

    Attributes:
      kind: ``learning_curves`` (data as ``curve_bands`` returns), ``breakdown``
        (``mean_breakdowns``) or ``routing`` (``pooled_routing``).
      title: the figure's title.
      data: the figure's data.
    """

    kind: str
    title: str
    data: Mapping[str, Any]


def workdir_plots(runs: Sequence[Run]) -> dict[str, Plot]:
    """``{file name: Plot}`` of every figure the runs support, per dataset.

    Learning curves need evaluation records; the breakdown and routing figures need
    finished runs (``results.json``), routing only for methods with q0 histograms.
    """
    plots: dict[str, Plot] = {}
    for dataset, dataset_runs in by_dataset(runs).items():
        stem = file_stem(dataset)
        bands = curve_bands(dataset_runs)
        if bands:
            plots[f"learning_curves_{stem}.png"] = Plot(
                "learning_curves", f"{dataset}: accuracy during training", bands)
        breakdowns = mean_breakdowns(dataset_runs)
        if breakdowns:
            plots[f"breakdown_{stem}.png"] = Plot(
                "breakdown", f"{dataset}: test instances by correct model", breakdowns)
        for method in _methods_in_order(dataset_runs):
            finished = [r for r in dataset_runs if r.method == method and routes(r)]
            routing = pooled_routing(finished)
            if routing:
                plots[f"routing_q0_{stem}_{file_stem(method)}.png"] = Plot(
                    "routing", f"{dataset} / {method}: q0 per layer by instance group"
                               + _pooled_seeds(routing), routing)
            clients = one_client_routing(finished)
            if clients:
                named = "; ".join(
                    f"{population}: client {c.client_id}"
                    + (f", seed {c.seed}" if c.seed is not None else "")
                    + f", test loss {c.loss_g:.3g} global vs {c.loss_p:.3g} personalized"
                    for population, c in clients.items())
                plots[f"routing_q0_one_client_{stem}_{file_stem(method)}.png"] = Plot(
                    "routing", f"{dataset} / {method}: q0 per layer by instance group, the "
                               f"client with the largest loss gap\n({named})",
                    {population: c.routing for population, c in clients.items()})
    return plots
