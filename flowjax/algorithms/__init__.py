"""Federated methods, one file each, behind the protocol in ``base``.

``build_algorithm`` turns a run config into an algorithm; adding a method means one new
file and one entry in ``_BUILDERS``.
"""

from __future__ import annotations

from typing import Callable

import jax

from flowjax.algorithms.apfl import APFLConfig, apfl
from flowjax.algorithms.base import FederatedAlgorithm
from flowjax.algorithms.ditto import DittoConfig, ditto
from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
from flowjax.algorithms.fedrep import FedRepConfig, epochs_for_budget, fedrep
from flowjax.algorithms.flow import FlowConfig, flow
from flowjax.algorithms.flow_reference import resolve_options as flow_options
from flowjax.algorithms.hypcluster import HypClusterConfig, hypcluster
from flowjax.algorithms.knn_per import KnnPerConfig, knn_per
from flowjax.algorithms.lg_fedavg import LGFedAvgConfig, lg_fedavg
from flowjax.algorithms.local import LocalConfig, local
from flowjax.algorithms.partialfed import PartialFedConfig, partialfed
from flowjax.models.base import RoutableModel


def _fedavg(model, config, example_x, finetune=False):
    del example_x
    return fedavg(model, FedAvgConfig(learning_rate=config.learning_rate, epochs=config.epochs,
                                      batch_size=config.batch_size, momentum=config.momentum,
                                      finetune=finetune))


def _flow(model, config, example_x):
    fields = dict(
        learning_rate=config.learning_rate, local_epochs=config.epochs,
        routing_epochs=config.epochs, batch_size=config.batch_size, gamma=config.gamma,
        policy_hidden=tuple(config.policy_hidden), split_ratio=config.split_ratio,
        policy_dropout=config.policy_dropout, order=config.order,
        global_step=config.global_step, momentum=config.momentum,
        fixed_q0=config.get("fixed_q0"), local_route=config.get("local_route", "local"))
    # flow_semantics / flow_* fields: the authors' departures (flow_reference).
    fields.update(flow_options(model.name, config))
    return flow(model, FlowConfig(**fields), example_x)


def _apfl(model, config, example_x):
    del example_x
    return apfl(model, APFLConfig(learning_rate=config.learning_rate, epochs=config.epochs,
                                  batch_size=config.batch_size, alpha=config.methods.apfl.alpha,
                                  momentum=config.momentum))


def _ditto(model, config, example_x):
    del example_x
    return ditto(model, DittoConfig(learning_rate=config.learning_rate, epochs=config.epochs,
                                    batch_size=config.batch_size, lam=config.methods.ditto.lam,
                                    momentum=config.momentum))


def _fedrep(model, config, example_x):
    del example_x
    options = config.methods.fedrep
    # Unset phases follow the shared budget E: (E - 1) head epochs + 1 body epoch.
    head, body = epochs_for_budget(config.epochs)
    head = head if options.get("head_epochs") is None else options.head_epochs
    body = body if options.get("body_epochs") is None else options.body_epochs
    return fedrep(model, FedRepConfig(learning_rate=config.learning_rate,
                                      batch_size=config.batch_size, head_epochs=head,
                                      body_epochs=body, momentum=config.momentum))


def _lg_fedavg(model, config, example_x):
    del example_x
    layers = config.methods.lg_fedavg.global_layers
    return lg_fedavg(model, LGFedAvgConfig(
        learning_rate=config.learning_rate, epochs=config.epochs, batch_size=config.batch_size,
        global_layers=None if layers is None else tuple(layers), momentum=config.momentum))


def _hypcluster(model, config, example_x, warm_start=None):
    del example_x
    options = config.methods.hypcluster
    return hypcluster(model, HypClusterConfig(
        learning_rate=config.learning_rate, epochs=config.epochs, batch_size=config.batch_size,
        clusters=options.clusters, perturbation=options.perturbation,
        momentum=config.momentum), warm_start=warm_start)


def _knn_per(model, config, example_x):
    del example_x
    options = config.methods.knn_per
    return knn_per(model, KnnPerConfig(
        learning_rate=config.learning_rate, epochs=config.epochs, batch_size=config.batch_size,
        neighbours=options.neighbours, lam=options.lam, max_datastore=options.max_datastore,
        momentum=config.momentum))


def _local(model, config, example_x):
    del example_x
    options = config.methods.local
    return local(model, LocalConfig(learning_rate=options.learning_rate, epochs=options.epochs,
                                    batch_size=config.batch_size, momentum=config.momentum))


def _partialfed(model, config, example_x):
    del example_x
    options = config.methods.partialfed
    return partialfed(model, PartialFedConfig(
        learning_rate=config.learning_rate, strategy_learning_rate=options.strategy_learning_rate,
        temperature=options.temperature, epochs=config.epochs, batch_size=config.batch_size,
        momentum=config.momentum))


_BUILDERS: dict[str, Callable[..., FederatedAlgorithm]] = {
    "fedavg": _fedavg,
    "fedavg_ft": lambda model, config, x: _fedavg(model, config, x, finetune=True),
    "flow": _flow,
    "apfl": _apfl,
    "ditto": _ditto,
    "fedrep": _fedrep,
    "lg_fedavg": _lg_fedavg,
    "hypcluster": _hypcluster,
    "knn_per": _knn_per,
    "local": _local,
    "partialfed": _partialfed,
}
ALGORITHMS = tuple(sorted(_BUILDERS))


def build_algorithm(name: str, model: RoutableModel, config, example_x: jax.Array,
                    **options) -> FederatedAlgorithm:
    """The algorithm ``name`` for ``model`` with hyperparameters from ``config``.

    ``options`` go to the method's builder (e.g. HypCluster's ``warm_start`` params).
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown algorithm {name!r}; expected one of {list(ALGORITHMS)}")
    return _BUILDERS[name](model, config, example_x, **options)
