"""The Flow paper's reported numbers (NeurIPS 2023), transcribed from its LaTeX source.

Every figure is a percentage as printed. Each table below is copied row by row in the
tex's own column order (named next to it), so a row can be checked against the source by
eye; ``None`` is the paper's "-". ``paper_figure`` and ``paper_delta`` look them up by
this project's dataset, variant and metric names.

The paper calls the spread of its three seeds (0, 44, 56) "variance"
(tbl:all-accuracies-variances) but prints it in accuracy points and with "±" beside the
means (Sec. 5.2: "26.64% ± 0.23%" is Flow's Stackoverflow Acc_g and its "variance"
entry), so it is used here as the ± of each figure; the paper does not say which
estimator it used.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class PaperFigure:
    """A number the paper reports.

    Attributes:
      value: the figure, in percent (a difference in points for ``paper_delta``).
      spread: the paper's ± in points, or None where it gives none.
      source: the tex label (or section) it is transcribed from.
    """

    value: float
    spread: float | None
    source: str


_ALL_ACCURACY_COLUMNS = ("stackoverflow", "shakespeare", "emnist", "cifar10_0.1",
                         "cifar100_0.1", "cifar10_0.6", "cifar100_0.6")
_METHODS = {"Local": "local", "FedAvg": "fedavg", "FedAvgFT": "fedavg_ft", "knnPer": "knn_per",
            "PartialFed": "partialfed", "APFL": "apfl", "Ditto": "ditto", "FedRep": "fedrep",
            "LGFedAvg": "lg_fedavg", "HypCluster": "hypcluster", "Flow": "flow"}
NA = None  # the paper's "-"

# tbl:all-accuracies (Appendix; Table 2 tbl:gen-per-acc is its first, second, fourth and
# sixth column pairs). Columns: Stackoverflow, Shakespeare, EMNIST, CIFAR10 (0.1),
# CIFAR100 (0.1), CIFAR10 (0.6), CIFAR100 (0.6); each (Acc_g, Acc_p).
ALL_ACCURACIES = {
    "Local": (NA, 15.93, NA, 18.70, NA, 28.18, NA, 49.78, NA, 36.19, NA, 62.74, NA, 21.31),
    "FedAvg": (23.15, NA, 52.00, NA, 85.10, NA, 60.98, NA, 28.11, NA, 67.50, NA, 30.33, NA),
    "FedAvgFT": (23.83, 24.41, 52.12, 53.68, 89.57, 90.14, 61.23, 73.03, 29.60, 31.02,
                 68.19, 72.21, 31.15, 37.24),
    "knnPer": (23.16, 24.49, 51.87, 53.10, 85.20, 88.28, 59.62, 75.14, 28.08, 33.62, 69.22,
               70.14, 30.66, 34.39),
    "PartialFed": (NA, NA, NA, NA, NA, NA, 62.57, 73.20, 34.79, 40.64, 66.93, 70.38, 37.72,
                   40.18),
    "APFL": (22.96, 25.70, 52.38, 53.64, 88.40, 89.44, 62.87, 72.86, 31.05, 32.56, 69.53,
             72.53, 36.37, 36.74),
    "Ditto": (22.59, 24.36, 52.44, 53.95, 89.08, 91.30, 62.06, 72.06, 28.14, 35.45, 68.12,
              70.31, 35.11, 36.07),
    "FedRep": (18.92, 21.04, 46.71, 50.09, 89.95, 89.77, 64.85, 68.62, 26.10, 33.72, 69.77,
               63.61, 28.42, 31.02),
    "LGFedAvg": (22.61, 24.03, 51.08, 51.43, 87.43, 91.70, 56.63, 73.19, 31.65, 39.63, 67.48,
                 68.94, 35.01, 33.90),
    "HypCluster": (23.75, 22.43, 51.92, 52.74, 89.47, 90.49, 63.64, 71.55, 31.57, 33.04,
                   65.44, 72.40, 34.76, 36.22),
    "Flow": (26.64, 29.49, 55.90, 56.20, 90.88, 94.18, 66.26, 76.47, 34.00, 42.42, 70.88,
             77.11, 39.70, 40.08),
}
# tbl:all-accuracies-variances, same columns. The tex prints two entries with a decimal
# comma, "1,32\%" (FedAvg EMNIST Acc_g) and "1,57\%" (knnPer CIFAR10 (0.1) Acc_p); they
# are 1.32 and 1.57 here.
ALL_ACCURACY_SPREADS = {
    "Local": (NA, 0.25, NA, 0.46, NA, 1.14, NA, 1.56, NA, 0.43, NA, 0.89, NA, 0.25),
    "FedAvg": (0.07, NA, 0.39, NA, 1.32, NA, 1.12, NA, 0.31, NA, 0.82, NA, 0.15, NA),
    "FedAvgFT": (0.09, 0.26, 0.51, 0.59, 1.16, 1.21, 0.99, 0.89, 0.46, 0.62, 1.10, 1.26,
                 0.33, 0.42),
    "knnPer": (0.16, 0.24, 0.36, 0.41, 0.95, 1.02, 1.41, 1.57, 0.34, 0.57, 0.91, 1.06, 0.24,
               0.29),
    "PartialFed": (NA, NA, NA, NA, NA, NA, 1.36, 1.39, 0.29, 0.46, 0.96, 1.97, 0.09,
                   0.19),
    "APFL": (0.19, 0.20, 0.41, 0.53, 1.41, 1.50, 1.24, 1.31, 0.36, 0.72, 0.70, 0.97, 0.42,
             0.59),
    "Ditto": (0.12, 0.15, 0.49, 0.56, 1.12, 1.22, 1.35, 1.41, 0.43, 0.69, 0.84, 0.87, 0.28,
              0.34),
    "FedRep": (0.15, 0.29, 0.50, 0.65, 0.89, 0.94, 0.95, 1.02, 0.59, 0.79, 0.96, 1.14, 0.14,
               0.10),
    "LGFedAvg": (0.08, 0.16, 0.32, 0.56, 1.10, 1.17, 1.21, 1.24, 0.47, 0.51, 0.82, 0.96,
                 0.23, 0.21),
    "HypCluster": (0.20, 0.19, 0.56, 0.73, 0.90, 1.13, 1.43, 1.49, 0.39, 0.47, 0.98, 0.76,
                   0.35, 0.46),
    "Flow": (0.23, 0.28, 0.40, 0.49, 1.16, 1.21, 1.23, 1.25, 0.32, 0.36, 0.78, 0.86, 0.21,
             0.27),
}

# tbl:clients-unharmed (Appendix; Table 3 tbl:clients-unharmed-abridged is its
# Stackoverflow, Shakespeare and CIFAR10 columns). Note the column order: EMNIST second.
CLIENTS_UNHARMED_COLUMNS = ("stackoverflow", "emnist", "shakespeare", "cifar10_0.1",
                            "cifar100_0.1", "cifar10_0.6", "cifar100_0.6")
CLIENTS_UNHARMED = {
    "FedAvgFT": (79.26, 81.48, 79.00, 97.18, 91.74, 99.33, 88.54),
    "knnPer": (82.73, 89.97, 68.87, 90.00, 94.71, 90.00, 96.37),
    "PartialFed": (NA, NA, NA, 88.30, 90.32, 84.80, 98.64),
    "APFL": (69.66, 93.39, 79.22, 87.48, 86.18, 90.63, 92.03),
    "Ditto": (74.59, 79.26, 73.74, 90.52, 91.45, 89.61, 97.45),
    "FedRep": (91.53, 82.20, 79.78, 92.30, 78.81, 84.64, 99.54),
    "LGFedAvg": (83.47, 66.16, 88.43, 88.41, 86.39, 89.59, 91.73),
    "HypCluster": (80.46, 80.70, 74.84, 95.11, 93.70, 98.18, 99.73),
    "Flow": (92.74, 96.70, 89.77, 98.33, 97.29, 99.62, 99.75),
}

# tab:soft-versus-hard-policy-ablation, Flow's Acc_p as (mean, ±). Columns: Stackoverflow,
# Shakespeare, EMNIST (first tabular), CIFAR10 (0.1), CIFAR100 (0.1), CIFAR10 (0.6),
# CIFAR100 (0.6) (second tabular).
SOFT_HARD_COLUMNS = _ALL_ACCURACY_COLUMNS
SOFT_POLICY = ((29.57, 0.22), (57.01, 0.53), (94.97, 1.06), (77.24, 1.30), (42.75, 0.30),
               (77.02, 0.90), (39.74, 0.13))
HARD_POLICY = ((29.49, 0.28), (56.20, 0.49), (94.18, 1.21), (76.47, 1.25), (42.42, 0.36),
               (77.11, 0.86), (40.08, 0.27))

# sec:ablation (Sec. 5.2), Stackoverflow only, in the text as "mean% ± spread%".
ABLATION_TEXT = {
    ("stackoverflow", "flow_gamma_0", "acc_g"): (24.16, 0.34),  # "without regularization"
    ("stackoverflow", "flow_gamma_0", "acc_p"): (27.59, 0.36),
    ("stackoverflow", "pi_flow", "acc_p"): (26.31, 0.19),
    ("stackoverflow", "pc_flow", "acc_p"): (24.41, 0.26),
}

# Differences the appendix states in words, per dataset, in points; the text lists them
# in the order Stackoverflow, Shakespeare, EMNIST, CIFAR10 0.1, CIFAR10 0.6, CIFAR100 0.1,
# CIFAR100 0.6 (a third order).
DELTA_COLUMNS = ("stackoverflow", "shakespeare", "emnist", "cifar10_0.1", "cifar10_0.6",
                 "cifar100_0.1", "cifar100_0.6")
DELTAS = {
    # "Ablation Study: Regularization": "an improvement of ... for the generalized
    # accuracy" and "... for the personalized accuracy" (with minus without gamma). Its
    # Stackoverflow Acc_g gain, 2.18, is not the main text's 26.64 - 24.16 = 2.48.
    ("regularization", "acc_g"): (2.18, 1.86, 3.98, 2.55, 4.36, 0.91, 3.46),
    ("regularization", "acc_p"): (1.92, 2.02, 3.01, 0.65, 3.98, 2.42, 2.19),
    # "Ablation Study: Per-instance Personalization": "Per-instance Flow outperforming
    # Per-client Flow by ...".
    ("pi_over_pc", "acc_p"): (1.88, 0.82, 5.07, 2.90, 2.41, 7.52, 1.09),
    # "... Per-instance Flow outperforming Per-Instance Per-Client Flow by ...": read
    # literally pi-Flow would lead, but the main text has Flow 29.49 vs pi-Flow 26.31 on
    # Stackoverflow (3.18 points), so these are Flow minus pi-Flow.
    ("flow_over_pi", "acc_p"): (3.19, 1.24, 0.94, 0.55, 4.49, 3.88, 1.37),
}


def _columns(row: Sequence[float | None], columns: Sequence[str]) -> dict[str, float | None]:
    return dict(zip(columns, row, strict=True))


def _build_figures() -> dict[tuple[str, str, str], PaperFigure]:
    figures: dict[tuple[str, str, str], PaperFigure] = {}
    pairs = [(d, m) for d in _ALL_ACCURACY_COLUMNS for m in ("acc_g", "acc_p")]
    for method, values in ALL_ACCURACIES.items():
        spreads = ALL_ACCURACY_SPREADS[method]
        for (dataset, metric), value, spread in zip(pairs, values, spreads, strict=True):
            if value is not None:
                figures[dataset, _METHODS[method], metric] = PaperFigure(
                    value, spread, "tbl:all-accuracies, tbl:all-accuracies-variances")
    for method, row in CLIENTS_UNHARMED.items():
        for dataset, value in _columns(row, CLIENTS_UNHARMED_COLUMNS).items():
            if value is not None:
                figures[dataset, _METHODS[method], "clients_benefiting"] = PaperFigure(
                    value, None, "tbl:clients-unharmed")
    for dataset, (value, spread) in zip(SOFT_HARD_COLUMNS, SOFT_POLICY, strict=True):
        figures[dataset, "flow", "acc_p_soft"] = PaperFigure(
            value, spread, "tab:soft-versus-hard-policy-ablation")
    for key, (value, spread) in ABLATION_TEXT.items():
        figures[key] = PaperFigure(value, spread, "sec:ablation")
    # pc-Flow "is simply FedAvgFT" (Sec. 5.2), and its Stackoverflow figure above equals
    # FedAvgFT's, so FedAvgFT's Table 2 numbers are pc-Flow's on the other datasets.
    # The paper prints pc-Flow's number only for Stackoverflow: the others say so.
    for (dataset, variant, metric), figure in list(figures.items()):
        if variant == "fedavg_ft" and metric in ("acc_g", "acc_p"):
            figures.setdefault((dataset, "pc_flow", metric), dataclasses.replace(
                figure, source=f"FedAvgFT's {figure.source} (sec:ablation: pc-Flow is "
                               f"simply FedAvgFT)"))
    _add_snapshot_figures(figures)
    _add_fedavg_snapshot_figures(figures)
    _add_knn_per_snapshot_figures(figures)
    return figures


# The paper's Acc_g is that of the authors' evaluation, which scores a client's copy of
# the global model (FedAvgFT, Flow: after its first evaluation epoch; APFL, Ditto: after
# the E epochs of its local update; FedRep, LG-FedAvg, HypCluster: after one epoch of
# their fine-tuning; README, "Baselines as implemented"),
# and their code records per client the flag harmed = (copy's accuracy >= final
# accuracy); their script that turned the flags into Table 3 is not published, so its
# "% unharmed" is read as the share of flags that are false. A row reporting that copy
# gets those figures beside it, not beside the server model's acc_g and the count
# against it (in every table; flow_reference's other table, gain_source, runs only
# datasets the paper lacks).
SNAPSHOT_ROWS = {"fedavg_ft_snapshot": "fedavg_ft", "apfl_snapshot": "apfl",
                 "ditto_snapshot": "ditto", "fedrep_snapshot": "fedrep",
                 "lg_fedavg_snapshot": "lg_fedavg", "hypcluster_snapshot": "hypcluster",
                 "fedrep_their_training": "fedrep", "lg_fedavg_their_training": "lg_fedavg",
                 "flow_reference": "flow"}


# The rows whose method's Acc_p the authors' evaluation scores on another model than the
# method's own (HypCluster: the cluster fine-tuned E epochs), reported as
# acc_p_client_snapshot: the paper's Acc_p goes beside that.
AUTHORS_ACC_P_ROWS = ("hypcluster_snapshot",)


# FedAvg's rows of the authors' evaluation: the datasets whose paper Acc_g is that row's
# copy (their CIFAR-100 FedAvg scores it on the test split, their CIFAR-10 FedAvg on the
# train split); on the cross-device datasets their FedAvg scores the server model, so the
# paper's figure goes beside Acc_g itself, and on the other CIFAR beside nothing.
FEDAVG_SNAPSHOT_ROWS = {"fedavg_snapshot": ("cifar100_0.1", "cifar100_0.6"),
                        "fedavg_snapshot_train": ("cifar10_0.1", "cifar10_0.6")}


def _add_fedavg_snapshot_figures(figures: dict[tuple[str, str, str], PaperFigure]) -> None:
    for (dataset, method, metric), figure in list(figures.items()):
        if method != "fedavg" or metric != "acc_g":
            continue
        for row, theirs in FEDAVG_SNAPSHOT_ROWS.items():
            if dataset in theirs:
                figures[dataset, row, "acc_g_client_snapshot"] = dataclasses.replace(
                    figure, source=f"{figure.source} (the authors' evaluation)")
            elif not dataset.startswith("cifar"):
                figures[dataset, row, "acc_g"] = dataclasses.replace(
                    figure, source=f"{figure.source} (the authors' evaluation: the server "
                                   f"model)")


# kNN-Per's row of the authors' evaluation (plan ``knn_per_snapshot``): their Acc_g is the
# server model's except on CIFAR (the one-epoch copy); their Acc_p and harmed flags are
# reproduced for the image models only (``knn_per.REFERENCE_KEY_LAYERS``).
KNN_PER_SNAPSHOT_ROW = "knn_per_snapshot"


def _add_knn_per_snapshot_figures(figures: dict[tuple[str, str, str], PaperFigure]) -> None:
    theirs = {"acc_p": ("acc_p_client_snapshot", "the authors' evaluation"),
              "clients_benefiting": ("clients_benefiting_snapshot",
                                     "read as the authors' harmed flags that are false")}
    for (dataset, method, metric), figure in list(figures.items()):
        if method != "knn_per" or metric not in ("acc_g", *theirs):
            continue
        cifar = dataset.startswith("cifar")
        if metric == "acc_g":
            field, reading = (("acc_g_client_snapshot", "the authors' evaluation") if cifar
                              else ("acc_g", "the authors' evaluation: the server model"))
        elif cifar or dataset == "emnist":
            field, reading = theirs[metric]
        else:
            continue  # their text kNN-Per: not reproduced
        figures[dataset, KNN_PER_SNAPSHOT_ROW, field] = dataclasses.replace(
            figure, source=f"{figure.source} ({reading})")


def _add_snapshot_figures(figures: dict[tuple[str, str, str], PaperFigure]) -> None:
    beside = {"acc_g": ("acc_g_client_snapshot", "the authors' evaluation"),
              "acc_p": ("acc_p", "the authors' evaluation"),
              "clients_benefiting": ("clients_benefiting_snapshot", "read as the authors' "
                                     "harmed flags that are false")}
    for (dataset, method, metric), figure in list(figures.items()):
        for row, row_method in SNAPSHOT_ROWS.items():
            if method == row_method and metric in beside:
                field, reading = beside[metric]
                if metric == "acc_p" and row in AUTHORS_ACC_P_ROWS:
                    field = "acc_p_client_snapshot"
                figures[dataset, row, field] = dataclasses.replace(
                    figure, source=f"{figure.source} ({reading})")


FIGURES = _build_figures()


def paper_figure(dataset: str, variant: str, metric: str) -> PaperFigure | None:
    """The paper's number for ``metric`` of ``variant`` on ``dataset``, or None.

    Args:
      dataset: a ``plan.DATASETS`` key, e.g. ``cifar10_0.1``.
      variant: a method or ablation name, e.g. ``flow``, ``flow_gamma_0``.
      metric: a results field: ``acc_g``, ``acc_p``, ``acc_p_soft``, ``clients_benefiting``,
        and for ``SNAPSHOT_ROWS`` ``acc_g_client_snapshot``, ``clients_benefiting_snapshot``
        (and ``acc_p_client_snapshot`` for ``AUTHORS_ACC_P_ROWS``).
    """
    return FIGURES.get((dataset, variant, metric))


def paper_delta(key: str, dataset: str, metric: str) -> PaperFigure | None:
    """A difference the paper states in words (``DELTAS``), or None."""
    row = DELTAS.get((key, metric))
    if row is None:
        return None
    value = _columns(row, DELTA_COLUMNS).get(dataset)
    return None if value is None else PaperFigure(value, None, "Appendix E ablation text")
