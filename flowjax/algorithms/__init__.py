"""Federated methods, one file each, behind the protocol in ``base``.

``build_algorithm`` turns a run config into an algorithm; adding a method means one new
file and one entry in ``_BUILDERS``.
"""

from __future__ import annotations

from typing import Callable

import jax

from flowjax.algorithms.base import FederatedAlgorithm
from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
from flowjax.algorithms.flow import FlowConfig, flow
from flowjax.models.base import RoutableModel


def _fedavg(model, config, example_x, finetune=False):
    del example_x
    return fedavg(model, FedAvgConfig(learning_rate=config.learning_rate, epochs=config.epochs,
                                      batch_size=config.batch_size, momentum=config.momentum,
                                      finetune=finetune))


def _flow(model, config, example_x):
    return flow(model, FlowConfig(
        learning_rate=config.learning_rate, local_epochs=config.epochs,
        routing_epochs=config.epochs, batch_size=config.batch_size, gamma=config.gamma,
        policy_hidden=tuple(config.policy_hidden), split_ratio=config.split_ratio,
        policy_dropout=config.policy_dropout, order=config.order,
        global_step=config.global_step, momentum=config.momentum), example_x)


_BUILDERS: dict[str, Callable[..., FederatedAlgorithm]] = {
    "fedavg": _fedavg,
    "fedavg_ft": lambda model, config, x: _fedavg(model, config, x, finetune=True),
    "flow": _flow,
}
ALGORITHMS = tuple(sorted(_BUILDERS))


def build_algorithm(name: str, model: RoutableModel, config, example_x: jax.Array) -> FederatedAlgorithm:
    """The algorithm ``name`` for ``model`` with hyperparameters from ``config``."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown algorithm {name!r}; expected one of {list(ALGORITHMS)}")
    return _BUILDERS[name](model, config, example_x)
