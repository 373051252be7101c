"""From an ml_collections run config to the engine's objects (one place, used by launch/)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np
import optax

from flowjax import distributed, run_folder
from flowjax.algorithms import make_algorithm, method_revision
from flowjax.algorithms.base import SGDConfig
from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
from flowjax.algorithms.hypcluster import kmeans_starts
from flowjax.core import prng
from flowjax.core.mapping import ClientMapping, default_mapping
from flowjax.core.server_opt import server_optimizer
from flowjax.data import FederatedTask, load_task
from flowjax.engine.callbacks import DivergenceGuard, RunState
from flowjax.experiment import RunSettings, Simulation, finalize_metrics
from flowjax.models import RoutableModel, model_revision
from flowjax.validation import (validate_cohort_size, validate_config,
                                validate_evaluated_populations, validate_task)


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


def build_settings(config, sgd: SGDConfig) -> RunSettings:
    """The engine's settings; ``sgd`` is the method's resolved SGD (its batch size shapes
    the cohorts)."""
    return RunSettings(
        seed=config.seed, num_rounds=config.num_rounds, clients_per_round=config.clients_per_round,
        batch_size=sgd.batch_size,
        max_examples_per_client=_optional_int(config.max_examples_per_client),
        max_eval_examples=_optional_int(config.eval.max_examples),
        eval_every=config.eval.every, eval_clients=_optional_int(config.eval.clients),
        eval_held_out_clients=_optional_int(config.eval.get("held_out_clients")),
        eval_held_out=config.eval.held_out, eval_chunk=config.eval.chunk,
        log_every=config.log_every)


@dataclasses.dataclass(frozen=True)
class ResolvedRun:
    """A run config resolved once: everything the stages of a run share.

    Attributes:
      config: the run config as given.
      method: the configured method's config dataclass (``config.methods.<algorithm>``
        with its resolved ``sgd``), checked.
      model: the configured model, built once.
      task: the loaded data, checked against the model.
      settings: the engine's settings.
      example_x: one batch of zero inputs (``example_batch``), for shape-dependent
        parts such as Flow's policy.
    """

    config: Any
    method: Any
    model: RoutableModel
    task: FederatedTask
    settings: RunSettings
    example_x: jax.Array

    @property
    def algorithm(self) -> str:
        return self.config.algorithm

    @property
    def sgd(self) -> SGDConfig:
        return self.method.sgd


def resolve(config, task: FederatedTask | None = None) -> ResolvedRun:
    """Checks ``config`` and builds what every stage of the run shares, once: the method's
    config (per-method SGD fields applied), the model and the data (``task`` if given).

    Raises:
      ValueError: one line naming the bad field or datum, before anything is compiled.
    """
    method, model = validate_config(config)
    task = task or build_task(config)
    validate_task(task, model)
    validate_cohort_size(config, task)
    validate_evaluated_populations(config, task)
    return ResolvedRun(config, method, model, task, build_settings(config, method.sgd),
                       example_batch(task, method.sgd.batch_size))


def example_batch(task: FederatedTask, batch_size: int) -> jax.Array:
    """A batch of zero inputs in the shape and dtype of ``task``'s train examples.

    Shape-dependent parts (Flow's policy) are initialized from it: only its shape counts,
    and taking no client's rows keeps a first client without train examples valid.
    """
    shape, dtype = task.train.example_spec["x"]
    return jax.numpy.zeros((batch_size, *shape), dtype)


def warm_up_simulation(run: ResolvedRun) -> Simulation:
    """The FedAvg simulation of HypCluster's warm-up stage (``warm_up``): this run's SGD,
    seed, client sampling, server optimizer and mapping."""
    settings = dataclasses.replace(run.settings, num_rounds=max(warmup_rounds(run), 1))
    return Simulation(fedavg(run.model, FedAvgConfig(sgd=run.sgd)), run.task, settings,
                      server_optimizer=build_server_optimizer(run.config),
                      mapping=build_mapping(run.config))


@dataclasses.dataclass(frozen=True)
class WarmUp:
    """HypCluster's warm-up stage, done (``warm_up``).

    Attributes:
      options: the method factory's starting options (``warm_start``, ``cluster_starts``).
      records: the stage's training records, rounds 1 to W, each marked
        ``"stage": "warm-up"``: the run's history starts with them (``simulation_for``).
    """

    options: dict[str, Any]
    records: tuple[dict[str, Any], ...] = ()


def warm_up(run: ResolvedRun, guard: DivergenceGuard | None = None) -> WarmUp | None:
    """HypCluster's warm-up stage: its factory's starting options and its rounds' training
    records; None for other methods or with neither warm-up rounds nor k-means init.

    ``guard`` (the run's own, so its warnings stay once per run) checks each warm-up
    round's training record as it checks the method's rounds: a client returning
    non-finite parameters stops the run at that round under ``on_divergence='stop'``, and
    a non-finite server step under either setting. The records start the method's
    simulation's history (``Simulation.earlier_records``), so ``metrics.jsonl`` has a line
    for every round of the run.

    Options ``{"warm_start": params}``: the server params after ``methods.hypcluster.warmup_rounds``
    rounds W of FedAvg with this run's SGD, seed, client sampling, server optimizer and
    mapping (no evaluation). They are the run's rounds 1 to W of ``num_rounds``, so
    HypCluster trains on as many cohorts as every other method; its own rounds are W + 1
    to ``num_rounds`` (``simulation_for``). With ``init="kmeans"``, options
    ``{"cluster_starts": [...]}``: ``hypcluster.kmeans_starts`` from those params (the
    plain init when W = 0) over the clients of round W, HypCluster's first cohort, with
    keys and the first pick from the ``KMEANS_INIT`` stream of round W.
    """
    rounds = warmup_rounds(run)
    kmeans = run.algorithm == "hypcluster" and run.method.init == "kmeans"
    if not rounds and not kmeans:
        return None
    simulation = warm_up_simulation(run)
    stage = RunState(simulation=simulation, state=simulation.init_state())
    for round_index in range(rounds):
        stage.state, metrics = simulation.run_round(stage.state, round_index)
        stage.rounds_done = round_index + 1
        record = {"round": round_index + 1, "kind": "train", "stage": "warm-up",
                  **finalize_metrics(distributed.fetch(metrics))}
        stage.history.append(record)
        if guard is not None:
            guard.on_record(stage, record)
    records = tuple(stage.history)
    state = stage.state
    if not kmeans:
        return WarmUp({"warm_start": state.params}, records)
    seed = run.settings.seed
    cohort = simulation.host_cohort(rounds)
    key_of_round = prng.round_key(prng.base_key(seed, prng.Purpose.KMEANS_INIT), rounds)
    keys = jax.vmap(prng.client_key, in_axes=(None, 0))(key_of_round, cohort.client_id)
    real = np.flatnonzero(cohort.num_examples > 0)
    first = int(real[prng.host_rng(seed, int(prng.Purpose.KMEANS_INIT), rounds)
                     .integers(len(real))])
    return WarmUp({"cluster_starts": kmeans_starts(run.model, run.sgd, state.params, cohort,
                                                   keys, run.method.clusters, first,
                                                   build_mapping(run.config))}, records)


def warmup_rounds(run: ResolvedRun) -> int:
    """The FedAvg rounds of HypCluster's warm-up stage (0 for other methods)."""
    return getattr(run.method, "warmup_rounds", 0) if run.algorithm == "hypcluster" else 0


def simulation_for(run: ResolvedRun, starts: WarmUp | None = None,
                   workdir: str | None = None) -> Simulation:
    """The run's simulation; ``starts``: HypCluster's warm-up stage (``warm_up``), whose
    options the method starts from and whose records start the run's history.

    After a warm-up of W rounds the simulation runs rounds W to ``num_rounds - 1`` of the
    seed's streams (``Settings.first_round``): the warm-up's cohorts and keys are not
    drawn again, and rounds are logged, evaluated and checkpointed by their run index.
    With ``client_states="disk"`` a stateful method keeps its client states in
    ``workdir``'s ``client_states/`` (``client_state_dir``).

    Raises:
      ValueError: ``client_states="disk"`` for a stateful method without a ``workdir``.
    """
    starts = starts or WarmUp({})
    settings = run.settings
    if warmup_rounds(run):
        settings = dataclasses.replace(settings, first_round=warmup_rounds(run))
    algorithm = make_algorithm(run.algorithm, run.model, run.method, run.example_x,
                               **starts.options)
    return Simulation(algorithm, run.task, settings,
                      server_optimizer=build_server_optimizer(run.config),
                      mapping=build_mapping(run.config),
                      client_state_dir=client_state_dir(run.config, algorithm, workdir),
                      earlier_records=starts.records)


def client_state_dir(config, algorithm, workdir: str | None) -> str | None:
    """The folder of a stateful method's client states with ``client_states="disk"``
    (one per process of a multi-host run: every process keeps all rows), else None."""
    if config.get("client_states", "memory") != "disk" or not algorithm.stateful:
        return None
    if workdir is None:
        raise ValueError("config.client_states='disk': expected a run folder for the "
                         "client states' files (launch/train.py --workdir=...), or 'memory'")
    folder = run_folder.path(workdir, run_folder.CLIENT_STATES)
    return (os.path.join(folder, f"process_{jax.process_index()}")
            if distributed.multiprocess() else folder)


def build_simulation(config, task: FederatedTask | None = None,
                     workdir: str | None = None) -> Simulation:
    """Everything a run needs, validated; raises ``ValueError`` with a one-line reason.

    The run's stages in order: ``resolve`` (checks; method, model and data built once),
    ``warm_up`` (HypCluster's FedAvg rounds, if any), ``simulation_for``.
    """
    run = resolve(config, task)
    return simulation_for(run, warm_up(run), workdir)


def stored_config(config) -> dict[str, Any]:
    """The run config as a run folder's ``config.json`` stores it: as given (what each
    method trains with follows from it alone, ``method_config``), as plain JSON, with
    the method's code revision as ``method_revision`` (``algorithms.Method.revision``)
    and, where a fix raised it, the model's as ``model_revision``: the same config run by
    another revision gives other numbers (an absent ``model_revision`` reads as None)."""
    revision = model_revision(config.get("model"))
    return {**json.loads(config.to_json_best_effort()),
            "method_revision": method_revision(config.get("algorithm")),
            **({"model_revision": revision} if revision is not None else {})}


def set_fields(config, fields: dict[str, Any]) -> Any:
    """Sets dotted-path fields (``{"methods.flow.gamma": 0.0}``) on ``config`` in place
    and returns it; every path must name an existing field.

    Raises:
      ValueError: an unknown field, or a value of the wrong type (one line).
    """
    for path, value in fields.items():
        *parents, leaf = path.split(".")
        node = config
        for depth, part in enumerate(parents + [leaf]):
            if not hasattr(node, "keys") or part not in node:
                where = "config" + "".join(f".{p}" for p in path.split(".")[:depth])
                fields = sorted(node.keys()) if hasattr(node, "keys") else "none (it is a value)"
                raise ValueError(f"unknown config field {path!r}; expected one of {where}'s "
                                 f"fields {fields}")
            if depth < len(parents):
                node = node[part]
        try:
            node[leaf] = value
        except (TypeError, ValueError) as error:
            raise ValueError(f"config.{path}={value!r}: {' '.join(str(error).split())}") from None
    return config
