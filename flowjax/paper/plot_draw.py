"""Drawing of the run figures: matplotlib only, from the plain data of ``plot_data``.

``learning_curves_figure``, ``breakdown_figure`` and ``routing_figure`` take the arrays and
dataclasses that ``plot_data`` computes and return ``matplotlib.figure.Figure`` objects
without touching pyplot's global state, so callers decide where to save them;
``workdir_figures`` draws every ``plot_data.workdir_plots`` entry. Only this module of
flowjax imports matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from flowjax.evaluation.metrics import GROUPS
from flowjax.paper.plot_data import (CURVE_METRICS, Band, Plot, Routing, Run,
                                     histogram_box_stats, workdir_plots)

METRIC_TITLES = {"acc_g": "Acc_g", "acc_p": "Acc_p"}
# The paper's Figure 3 colours (both correct green, global only yellow, personalized only
# blue); "neither" is not drawn in the paper, grey keeps it quiet.
GROUP_COLORS = {"both_correct": "#06d6a0", "global_only": "#ffd166",
                "personalized_only": "#118ab2", "neither": "#d9d9d9"}


def _title(figure: Figure, text: str | None) -> None:
    if text:
        figure.suptitle(text)


def learning_curves_figure(bands: Mapping[str, Mapping[str, Mapping[str, Band]]],
                           title: str | None = None) -> Figure:
    """Acc_g and Acc_p against the round, one row of panels per population.

    Args:
      bands: ``{population: {metric: {method: Band}}}`` as ``curve_bands`` returns, with
        metrics among ``CURVE_METRICS``.
      title: the figure's title.

    Returns:
      A figure with ``len(bands) x len(CURVE_METRICS)`` panels titled
      ``"<Acc_g|Acc_p> (<population>)"``, one line per method (the mean over seeds) and a
      shaded +-std band where two or more seeds evaluated a round.
    """
    populations = list(bands)
    figure = Figure(figsize=(6 * len(CURVE_METRICS), 3.6 * len(populations)),
                    layout="constrained")
    axes = figure.subplots(len(populations), len(CURVE_METRICS), squeeze=False)
    # One colour per method in every panel, also where a panel lacks a method (Local's
    # Acc_g): the colour cycle of each axes would shift the methods after it.
    methods = list(dict.fromkeys(m for curves in bands.values() for per_method in
                                 curves.values() for m in per_method))
    for row, population in enumerate(populations):
        for col, metric in enumerate(CURVE_METRICS):
            ax = axes[row][col]
            for method, band in bands[population].get(metric, {}).items():
                (line,) = ax.plot(band.rounds, 100 * band.mean, label=method,
                                  color=f"C{methods.index(method) % 10}",
                                  marker="o" if len(band.rounds) < 12 else None, markersize=3)
                spread = band.seeds > 1
                if np.any(spread):
                    ax.fill_between(band.rounds, 100 * (band.mean - band.std),
                                    100 * (band.mean + band.std), where=spread,
                                    color=line.get_color(), alpha=0.2, linewidth=0)
            ax.set_title(f"{METRIC_TITLES[metric]} ({population})")
            ax.set_xlabel("round")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel("accuracy (%)")
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize="small")
    _title(figure, title)
    return figure


def breakdown_figure(breakdowns: Mapping[str, Mapping[str, Mapping[str, float]]],
                     title: str | None = None) -> Figure:
    """The paper's Figure 3: per method, the test instances by which model gets them right.

    Args:
      breakdowns: ``{population: {method: {group: fraction}}}`` as ``mean_breakdowns``
        returns (groups as in ``GROUPS``, fractions summing to 1).
      title: the figure's title.

    Returns:
      A figure with one panel per population titled ``"instance breakdown (<population>)"``,
      holding one stacked bar per method, segments in ``GROUPS`` order, labelled in %.
    """
    populations = list(breakdowns)
    widest = max((len(m) for m in breakdowns.values()), default=1)
    width = max(4.0, 1.0 + 0.9 * widest) * len(populations)
    if title:  # a figure of one or two bars was narrower than its title, which got clipped
        width = max(width, 1.0 + 0.11 * len(title))
    figure = Figure(figsize=(width, 4.8), layout="constrained")
    axes = figure.subplots(1, len(populations), squeeze=False)[0]
    for ax, population in zip(axes, populations):
        methods = list(breakdowns[population])
        positions = np.arange(len(methods))
        bottom = np.zeros(len(methods))
        for group in GROUPS:
            heights = np.asarray([100 * breakdowns[population][m][group] for m in methods])
            bars = ax.bar(positions, heights, 0.6, bottom=bottom, color=GROUP_COLORS[group],
                          label=group.replace("_", " "), edgecolor="white", linewidth=0.5)
            # Label segments tall enough to hold the text.
            ax.bar_label(bars, labels=[f"{h:.1f}" if h >= 4 else "" for h in heights],
                         label_type="center", fontsize="x-small")
            bottom += heights
        ax.set_xticks(positions, methods, rotation=30, ha="right")
        ax.set_xlim(-0.7, len(methods) - 0.3)
        ax.set_ylim(0, 100)
        ax.set_ylabel("% of test instances")
        ax.set_title(f"instance breakdown ({population})")
    if populations:
        axes[-1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    _title(figure, title)
    return figure


def routing_figure(routing: Mapping[str, Routing], title: str | None = None) -> Figure:
    """The paper's routing analysis: the distribution of q0 (the probability of the
    global route) per routed layer, for each instance group.

    Args:
      routing: ``{population: Routing}`` as ``pooled_routing`` returns.
      title: the figure's title.

    Returns:
      A figure with one row per population and one panel per group (``GROUPS`` order),
      titled ``"<group> (<population>)"``; each panel holds one box per layer (median,
      quartiles, 5th-95th percentile whiskers, mean marked). A group without instances
      gets an empty panel saying so.
    """
    populations = list(routing)
    layers = max((h.shape[0] for r in routing.values() for h in r.histograms.values()),
                 default=1)
    figure = Figure(figsize=(max(3.2, 0.45 * layers + 1.5) * len(GROUPS),
                             3.6 * len(populations)), layout="constrained")
    axes = figure.subplots(len(populations), len(GROUPS), squeeze=False, sharey=True)
    for row, population in enumerate(populations):
        data = routing[population]
        for col, group in enumerate(GROUPS):
            ax = axes[row][col]
            counts = data.histograms[group]
            ax.set_title(f"{group} ({population})")
            ax.set_ylim(-0.02, 1.02)
            ax.set_xlabel("layer")
            if col == 0:
                ax.set_ylabel("q0 (global route)")
            if not counts.size or not counts.sum() > 0:
                ax.text(0.5, 0.5, "no instances in this group", ha="center", va="center",
                        transform=ax.transAxes, fontsize="small", color="grey")
                ax.set_xticks([])
                continue
            stats = [histogram_box_stats(layer, data.means[group][j], label=str(j + 1))
                     for j, layer in enumerate(counts) if layer.sum() > 0]
            positions = [j + 1 for j, layer in enumerate(counts) if layer.sum() > 0]
            ax.bxp(stats, positions=positions, showmeans=True, showfliers=False,
                   patch_artist=True,
                   boxprops={"facecolor": GROUP_COLORS[group], "alpha": 0.8},
                   meanprops={"marker": "^", "markerfacecolor": "black",
                              "markeredgecolor": "black", "markersize": 4})
            ax.grid(axis="y", alpha=0.3)
    _title(figure, title)
    return figure


_DRAWERS = {"learning_curves": learning_curves_figure, "breakdown": breakdown_figure,
            "routing": routing_figure}


def draw(plot: Plot) -> Figure:
    """The figure of one ``plot_data.Plot``."""
    return _DRAWERS[plot.kind](plot.data, title=plot.title)


def workdir_figures(runs: Sequence[Run]) -> dict[str, Figure]:
    """``{file name: figure}`` of every figure the runs support (``plot_data.workdir_plots``)."""
    return {name: draw(plot) for name, plot in workdir_plots(runs).items()}
