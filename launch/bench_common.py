"""The synthetic clients and the FedAvg / Flow setups that launch/benchmark.py times and
launch/determinism_check.py runs twice: random examples shaped like each model's dataset,
the paper's batch sizes and learning rates, Flow's policy widths; and the timer the
benchmarks share."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import jax
import numpy as np

from flowjax.algorithms.base import FederatedAlgorithm, SGDConfig
from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
from flowjax.algorithms.flow import FlowConfig, flow
from flowjax.core.mapping import ClientMapping
from flowjax.core.server_opt import server_optimizer
from flowjax.data.federated import ArrayFederatedData, FederatedTask, RaggedSplit
from flowjax.experiment import RunSettings, Simulation
from flowjax.models.base import RoutableModel

BATCH = {"emnist_cnn": 20, "shakespeare_lstm": 4, "stackoverflow_lstm": 16}
POLICY = {"emnist_cnn": (350, 150, 50, 50), "shakespeare_lstm": (64, 64, 32, 16),
          "stackoverflow_lstm": (64, 64, 32, 16)}
LEARNING_RATE = {"emnist_cnn": 0.01, "shakespeare_lstm": 0.11, "stackoverflow_lstm": 0.1}
TOKENS = {"shakespeare_lstm": (87, 81), "stackoverflow_lstm": (10004, 21)}  # (vocab, length + 1)
# flow_fused: Flow with each layer's two branches in one product where its input outweighs
# its weights (FlowConfig.fuse_branches); flow_mixed_state: Flow whose LSTM layers route
# each cell application (FlowConfig.recurrence); each timed beside flow in the same run.
ALGORITHMS = ("fedavg", "flow", "flow_fused", "flow_mixed_state")


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn()`` to a ready result over ``repeats`` calls, after one
    call that compiles and warms up."""
    return first_and_median_seconds(fn, repeats)[1]


def first_and_median_seconds(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """The first call's wall time (compiling included) and the median of ``repeats`` more."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def synthetic_examples(model_name: str, n: int, rng: np.random.Generator):
    """``n`` random examples ``(x, y)`` shaped like the model's dataset."""
    if model_name == "emnist_cnn":
        x = rng.normal(size=(n, 28, 28)).astype(np.float32)
        return x, rng.integers(0, 62, size=(n,)).astype(np.int32)
    vocab, length = TOKENS[model_name]
    tokens = rng.integers(1, vocab, size=(n, length)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def synthetic_task(model_name: str, sizes: np.ndarray, seed: int = 0) -> FederatedTask:
    """Client ``i`` holds ``sizes[i]`` random examples."""
    x, y = synthetic_examples(model_name, int(np.sum(sizes)), np.random.default_rng(seed))
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    split = RaggedSplit({"x": x, "y": y}, offsets)
    ids = tuple(f"c{i}" for i in range(len(sizes)))
    data = ArrayFederatedData(ids, {"train": split, "test": split})
    return FederatedTask(train=data, held_out=None, name=f"synthetic_{model_name}")


def build_algorithm(model: RoutableModel, name: str, example_x: jax.Array,
                    epochs: int = 1, steps_per_loop: int = 1) -> FederatedAlgorithm:
    """FedAvg, or Flow with gamma 1e-3 and the model's policy widths (``flow_fused``: and
    ``fuse_branches``; ``flow_mixed_state``: and the ``mixed_state`` recurrence), at the
    model's batch size and learning rate (``steps_per_loop``: ``SGDConfig``'s)."""
    sgd = SGDConfig(learning_rate=LEARNING_RATE[model.name], epochs=epochs,
                    batch_size=BATCH[model.name], steps_per_loop=steps_per_loop)
    if name == "fedavg":
        return fedavg(model, FedAvgConfig(sgd=sgd))
    if name in ("flow", "flow_fused", "flow_mixed_state"):
        recurrence = "mixed_state" if name == "flow_mixed_state" else None  # None: semantics'
        return flow(model, FlowConfig(sgd=sgd, gamma=1e-3, policy_hidden=POLICY[model.name],
                                      fuse_branches=name == "flow_fused",
                                      recurrence=recurrence), example_x)
    raise ValueError(f"unknown algorithm {name!r}; expected one of {', '.join(ALGORITHMS)}")


def run_twice(algorithm: FederatedAlgorithm, task: FederatedTask, rounds: int,
              batch_size: int) -> dict:
    """Runs ``rounds`` rounds of every client twice from the same state with the same
    compiled program (vmapped clients) and compares the final server params and the
    round metrics bit for bit: ``identical``, how many arrays differ and by how much."""
    settings = RunSettings(seed=0, num_rounds=rounds, clients_per_round=len(task.train.client_ids),
                           batch_size=batch_size, eval_held_out=False)
    simulation = Simulation(algorithm, task, settings, server_optimizer("sgd", 1.0),
                            ClientMapping("vmap"))
    runs = []
    for _ in range(2):
        state, metrics = simulation.init_state(), []
        for round_index in range(rounds):
            state, round_metrics = simulation.run_round(state, round_index)
            metrics.append(round_metrics)
        runs.append(jax.device_get((state.params, metrics)))
    first, second = (jax.tree.leaves(run) for run in runs)
    differing = [float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                 for a, b in zip(first, second) if not np.array_equal(a, b)]
    return {"identical": not differing, "arrays": len(first), "differing_arrays": len(differing),
            "max_abs_diff": max(differing, default=0.0),
            "compilations": simulation.trace_counts["round"]}
