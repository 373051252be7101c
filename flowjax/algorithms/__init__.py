"""Federated methods, one file each, behind the protocol in ``base``.

A run config holds the clients' SGD in ``config.sgd`` and each method's own fields in
``config.methods.<name>`` (with ``config.methods.<name>.sgd`` overriding single SGD fields
for that method, None = as ``config.sgd``). ``method_config`` turns them into the method's
dataclass, ``XConfig(**config.methods[name], sgd=SGDConfig(...))``, whose ``__post_init__``
checks every value; ``build_algorithm`` hands that to the method's factory.

Adding a method: its file (factory + config dataclass), one ``METHODS`` entry (or a
``register`` call) and its defaults under ``config.methods`` in ``configs/base.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax

from flowjax.algorithms.apfl import APFLConfig, apfl
from flowjax.algorithms.base import FederatedAlgorithm, SGDConfig
from flowjax.algorithms.ditto import DittoConfig, ditto
from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
from flowjax.algorithms.fedrep import FedRepConfig, fedrep
from flowjax.algorithms.flow import FlowConfig, flow
from flowjax.algorithms.hypcluster import HypClusterConfig, hypcluster
from flowjax.algorithms.knn_per import KnnPerConfig, knn_per
from flowjax.algorithms.lg_fedavg import LGFedAvgConfig, lg_fedavg
from flowjax.algorithms.local import LocalConfig, local
from flowjax.algorithms.partialfed import PartialFedConfig, partialfed
from flowjax.core.checks import FieldError
from flowjax.models.base import RoutableModel


@dataclasses.dataclass(frozen=True)
class Method:
    """A registered method.

    Attributes:
      factory: ``factory(model, config[, example_x], **options) -> FederatedAlgorithm``.
      config_class: its config dataclass, called as ``config_class(**fields, sgd=sgd)``.
      takes_example: the factory's third argument is one input batch (Flow's policy
        shapes).
      revision: None until a change to the method's code alters its results beyond
        float32 rounding or the meaning of its checkpoints; then 2, 3, ... A run folder
        stores it in ``config.json`` (``flowjax.config.stored_config``), so a run made by
        an older revision is neither reused as finished nor resumed.
      global_model: it trains one model for all clients, scored as Acc_g (False for
        Local, whose Acc_g is its untrained starting model: the paper's "-").
      personal_model: it gives each client a model of its own, scored as Acc_p (False
        for FedAvg, whose Acc_p is its global model's: the paper's "-").
    """

    factory: Callable[..., FederatedAlgorithm]
    config_class: Callable[..., Any]
    takes_example: bool = False
    revision: int | None = None
    global_model: bool = True
    personal_model: bool = True


METHODS: dict[str, Method] = {
    "fedavg": Method(fedavg, FedAvgConfig, personal_model=False),
    "fedavg_ft": Method(fedavg, functools.partial(FedAvgConfig, finetune=True)),
    "flow": Method(flow, FlowConfig, takes_example=True),
    "apfl": Method(apfl, APFLConfig),
    # 2: the paper's gradient step on v by default (it was the exact proximal step).
    "ditto": Method(ditto, DittoConfig, revision=2),
    "fedrep": Method(fedrep, FedRepConfig),
    "lg_fedavg": Method(lg_fedavg, LGFedAvgConfig),
    # 2: the FedAvg warm-up counts within num_rounds (it was added on top).
    "hypcluster": Method(hypcluster, HypClusterConfig, revision=2),
    "knn_per": Method(knn_per, KnnPerConfig),
    "local": Method(local, LocalConfig, global_model=False),
    # 2: a first-time client's previous model is the received one (it was the run's
    # initial params), and its state records whether it has trained.
    "partialfed": Method(partialfed, PartialFedConfig, revision=2),
}
ALGORITHMS = tuple(sorted(METHODS))  # the built-in methods


def register(name: str, method: Method) -> None:
    """Adds (or replaces) a method; a run config then needs ``config.methods.<name>``."""
    METHODS[name] = method


def algorithm_names() -> tuple[str, ...]:
    """Every registered method, ``register``-ed ones included."""
    return tuple(sorted(METHODS))


def method_revision(name: str) -> int | None:
    """``Method.revision`` of a registered method (None for an unknown name, which the
    config's validation refuses)."""
    method = METHODS.get(name)
    return None if method is None else method.revision


def lacks_model(name: str, field: str) -> bool:
    """Whether result ``field`` of method ``name`` scores a model the method does not
    have (the paper's "-"): ``acc_g*`` needs its global model, ``acc_p*`` its personal
    ones, and every other field (% benefiting, ties, the breakdown) compares the two. A
    name not registered here has both."""
    method = METHODS.get(name)
    if method is None:
        return False
    needs_global, needs_personal = not field.startswith("acc_p"), not field.startswith("acc_g")
    return ((needs_global and not method.global_model)
            or (needs_personal and not method.personal_model))


def _method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown algorithm {name!r}; expected one of {list(algorithm_names())}")
    return METHODS[name]


def _field_names(config_class: Callable[..., Any]) -> tuple[str, ...]:
    target = getattr(config_class, "func", config_class)  # functools.partial
    return tuple(field.name for field in dataclasses.fields(target))


def _unknown_fields(fields: Mapping[str, Any], allowed: tuple[str, ...], path: str) -> None:
    for key in fields:
        if key not in allowed:
            raise ValueError(f"config.{path}{key}: not a field of it; expected some of "
                             f"{sorted(allowed)}")


def resolve_sgd(config: Any, name: str) -> SGDConfig:
    """``config.sgd`` with ``config.methods.<name>.sgd``'s set fields applied (the paper's
    per-method rates), checked; a bad value's message names the field it came from."""
    override = dict(config.methods[name].get("sgd", None) or {})
    allowed = _field_names(SGDConfig)
    _unknown_fields(config.sgd, allowed, "sgd.")
    _unknown_fields(override, allowed, f"methods.{name}.sgd.")
    values = dict(config.sgd)
    values.update({key: value for key, value in override.items() if value is not None})
    try:
        return SGDConfig(**values)
    except FieldError as error:
        own = override.get(error.field) is not None
        raise error.at(f"methods.{name}.sgd." if own else "sgd.") from None


def method_config(config: Any, name: str | None = None) -> Any:
    """The config dataclass of method ``name`` (default ``config.algorithm``) from a run
    config: ``XConfig(**config.methods[name], sgd=resolve_sgd(config, name))``.

    Raises:
      ValueError: ``config.methods.<name>.<field>=<value!r>: <what is expected>`` (or
        ``config.sgd.<field>...``) for the first bad value; an unknown name or field.
    """
    name = config.algorithm if name is None else name
    method = _method(name)
    path = f"methods.{name}."
    if name not in config.get("methods", {}):
        raise ValueError(f"config.methods.{name}: missing; expected the fields of "
                         f"{getattr(method.config_class, 'func', method.config_class).__name__}")
    fields = {key: value for key, value in dict(config.methods[name]).items() if key != "sgd"}
    _unknown_fields(fields, _field_names(method.config_class), path)
    sgd = resolve_sgd(config, name)
    try:
        return method.config_class(**fields, sgd=sgd)
    except FieldError as error:
        raise error.at(path) from None


def make_algorithm(name: str, model: RoutableModel, config: Any, example_x: jax.Array,
                   **options) -> FederatedAlgorithm:
    """Method ``name``'s algorithm for ``model`` from its config dataclass ``config``.

    ``options`` go to the method's factory (e.g. HypCluster's ``warm_start`` params).
    """
    method = _method(name)
    args = (model, config, example_x) if method.takes_example else (model, config)
    return method.factory(*args, **options)


def build_algorithm(name: str, model: RoutableModel, config: Any, example_x: jax.Array,
                    **options) -> FederatedAlgorithm:
    """The algorithm ``name`` for ``model`` with hyperparameters from the run ``config``."""
    return make_algorithm(name, model, method_config(config, name), example_x, **options)
