"""Skewed client sizes: no recompilation, padded steps never run, results independent of
how the clients are grouped into vmapped chunks."""

import jax
import numpy as np
import optax
import pytest

from flowjax.algorithms.base import SGDConfig
from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
from flowjax.core.mapping import ClientMapping, executed_steps
from flowjax.data.synthetic import stackoverflow_like_sizes, synthetic_images
from flowjax.experiment import RunSettings, Simulation
from tests.helpers import tiny_mlp

BATCH = 16  # Stack Overflow's client batch


@pytest.fixture(scope="module")
def skewed_task():
    sizes = np.maximum(stackoverflow_like_sizes(60, seed=3), 2)
    return synthetic_images(num_clients=60, num_classes=10, sizes=sizes, seed=0)


def simulation(task, mapping, rounds=20, epochs=3):
    algorithm = fedavg(tiny_mlp(), FedAvgConfig(sgd=SGDConfig(learning_rate=0.05, epochs=epochs,
                                                              batch_size=BATCH)))
    settings = RunSettings(seed=0, num_rounds=rounds, clients_per_round=10, batch_size=BATCH,
                           eval_held_out=False)
    return Simulation(algorithm, task, settings, optax.sgd(1.0), mapping)


def test_stackoverflow_like_sizes_are_skewed_and_capped():
    sizes = stackoverflow_like_sizes(20_000, seed=0)
    assert sizes.max() == 1000 and sizes.min() >= 1
    assert np.median(sizes) < 0.6 * np.mean(sizes)  # a heavy right tail
    np.testing.assert_array_equal(sizes, stackoverflow_like_sizes(20_000, seed=0))


def test_no_recompilation_over_20_rounds_of_skewed_cohorts(skewed_task):
    compiles = []

    def on_event(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    sim = simulation(skewed_task, ClientMapping("chunked", chunk_size=5))
    state = sim.init_state()
    state, metrics = sim.run_round(state, 0)
    jax.block_until_ready(metrics)
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        lengths = set()
        for round_index in range(1, 20):
            cohort = sim.cohort(round_index)
            lengths.add(tuple(np.asarray(cohort.num_examples)))
            state, metrics = sim.run_round(state, round_index, cohort)
            assert np.isfinite(float(metrics["loss_sum"]))
    finally:
        jax.monitoring.clear_event_listeners()
    assert len(lengths) == 19  # every round a different mix of sizes ...
    assert compiles == [] and sim.trace_counts["round"] == 1  # ... and one compilation


def test_sorted_chunks_equal_the_loop_on_skewed_sizes(skewed_task):
    finals = {}
    for mapping in (ClientMapping("loop"), ClientMapping("chunked", chunk_size=4),
                    ClientMapping("vmap")):
        sim = simulation(skewed_task, mapping, rounds=2, epochs=1)
        state = sim.init_state()
        for round_index in range(2):
            state, _ = sim.run_round(state, round_index)
        finals[mapping.strategy] = jax.tree.leaves(state.params)
    for strategy in ("chunked", "vmap"):
        for a, b in zip(finals["loop"], finals[strategy], strict=True):
            np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mapped", ["loop", "vmap"])
def test_padded_steps_are_never_executed(mapped):
    """Clients with 1, 10 and 3 real batches in a padded 16: a loop executes exactly the
    real steps; a vmap runs as many (batched) iterations as its longest client, never 16."""
    from flowjax.core.local_training import run_epochs

    executed = []

    def step_fn(carry, batch, key):
        jax.debug.callback(lambda: executed.append(1))
        return carry + 1, jax.numpy.stack([batch[2].sum(), batch[2].sum()])

    def client(member):
        x = jax.numpy.zeros((64, 3))
        return run_epochs(step_fn, 0, x, x[:, 0], member, num_epochs=2, batch_size=4,
                          key=jax.random.key(0))

    members = np.arange(64)[None, :] < np.array([2, 40, 9])[:, None]
    mapper = jax.vmap if mapped == "vmap" else (lambda f: lambda m: jax.lax.map(f, m))
    steps, sums = jax.jit(mapper(client))(members)
    jax.effects_barrier()
    np.testing.assert_array_equal(steps, [2, 20, 6])  # real steps per client, 2 epochs
    np.testing.assert_array_equal(sums[:, 1], [4, 80, 18])
    # The callback takes no batched argument: under vmap it fires once per iteration.
    assert len(executed) == (2 * (1 + 10 + 3) if mapped == "loop" else 2 * 10)


def test_executed_steps_per_mapping():
    steps = np.array([10, 1, 1, 10, 2, 2])
    assert executed_steps(steps, ClientMapping("loop")) == 26
    assert executed_steps(steps, ClientMapping("vmap")) == 60
    # Sorted longest first: [10, 10], [2, 2], [1, 1].
    assert executed_steps(steps, ClientMapping("chunked", chunk_size=2)) == 26
    # Chunks of 4: [10, 10, 2, 2] and the remainder [1, 1].
    assert executed_steps(steps, ClientMapping("chunked", chunk_size=4)) == 42


@pytest.mark.parametrize("method", ["fedavg", "ditto"])
def test_methods_without_routing_evaluate_under_sorted_chunks(method):
    """Their ``q0`` has no elements, which ``lax.map(batch_size=...)`` could not reshape:
    the evaluation after training crashed whenever chunks were smaller than its own."""
    from configs import synthetic
    from flowjax import config as run_config
    from flowjax import experiment

    config = synthetic.get_config("quick")
    config.update(algorithm=method, num_rounds=1)
    config.mapping.update(strategy="chunked", chunk_size=2)
    config.eval.chunk = 16
    result = experiment.run(run_config.build_simulation(config))
    config.mapping.update(strategy="loop", chunk_size=1)
    looped = experiment.run(run_config.build_simulation(config))
    chunked, expected = result.summaries["train_clients"], looped.summaries["train_clients"]
    assert chunked.num_clients == expected.num_clients > 0
    np.testing.assert_allclose(chunked.acc_p, expected.acc_p, rtol=1e-5)
