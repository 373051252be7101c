"""Test helpers: tiny configs and clients, tree comparisons, the stateful-method round trip."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from configs import shakespeare
from flowjax import config as run_config
from flowjax import experiment
from flowjax.core.cohort import ClientExamples, assemble_cohort, client_at
from flowjax.models.base import RoutableModel
from flowjax.models.layers import Dense, chain_model
from tests import forkserver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def products(fn, *args) -> int:
    """``dot_general`` and convolution equations in ``fn``'s jaxpr, nested ones included:
    how many matrix products a formulation runs, whatever the compiler does with them."""
    import jax.extend.core

    def count(jaxpr):
        total = 0
        for eqn in jaxpr.eqns:
            total += eqn.primitive.name in ("dot_general", "conv_general_dilated")
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                total += count(sub)
        return total
    return count(jax.make_jaxpr(fn)(*args).jaxpr)


def loops(fn, *args) -> int:
    """``while`` loops in ``jax.jit(fn)``'s lowered program (before XLA's passes): how many
    loops a formulation asks for, e.g. none for a fully unrolled scan."""
    import jax
    return jax.jit(fn).lower(*args).as_text().count("stablehlo.while")


_CIFAR_ROUND_CHILD = """
import json, sys
import tensorflow_datasets as tfds
from configs import cifar
from flowjax import config as run_config
from flowjax import experiment
config = cifar.get_config("cifar10_0.1")
config.data.update(num_clients=4, train_per_client=4, test_per_client=2)
config.update(num_rounds=1, clients_per_round=2, batch_size=2, epochs=1)
config.eval.clients = 2
config.methods.flow.semantics = sys.argv[1]
with tfds.testing.mock_data(num_examples=64):
    result = experiment.run(run_config.build_simulation(config))
summary = result.summaries["train_clients"]
print(json.dumps(dict(acc_p=summary.acc_p, snapshot=summary.acc_g_client_snapshot)))
"""


def cifar_round_in_child(semantics: str) -> dict:
    """One round of ``configs/cifar.py``'s Flow (2 of 4 clients) on TFDS's mock CIFAR-10,
    in a child compiled as a default build: under the suite's XLA flags the routed
    ResNet-18 runs about 12x slower (this round took 35 min on the 2-core machine against
    2.5 min, jax 0.10.2). Returns the train clients' ``acc_p`` and client-snapshot Acc_g."""
    done = forkserver.run([sys.executable, "-c", _CIFAR_ROUND_CHILD, semantics],
                          env=default_xla_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def default_xla_env() -> dict[str, str]:
    """This process's environment for a child that compiles as a user's default build
    does: without the suite's XLA flags (``conftest.TEST_XLA_FLAGS``) and without the
    launchers' CPU tuning (``launch/xla_env.py``), whose flags cannot be unset in a
    process where JAX has started."""
    from conftest import TEST_XLA_FLAGS
    return _env_without(TEST_XLA_FLAGS)


def untuned_xla_env() -> dict[str, str]:
    """This process's environment for a child that compiles with the suite's XLA flags
    but without the launchers' CPU tuning (``launch/xla_env.py``)."""
    return _env_without(())


def _env_without(flags: tuple[str, ...]) -> dict[str, str]:
    from launch import xla_env
    env = dict(os.environ, FLOWJAX_XLA_TUNING="0")
    dropped = {flag.split("=")[0] for flag in (*xla_env.CPU_FLAGS, *flags)}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if f.split("=")[0] not in dropped)
    return env


def apply_overrides(config, overrides):
    """Sets dotted ``{"eval.clients": 4}`` style overrides on a ConfigDict."""
    for name, value in dict(overrides).items():
        target = config
        *parents, leaf = name.split(".")
        for parent in parents:
            target = target[parent]
        target[leaf] = value
    return config


def small_config(**overrides):
    """The quick Shakespeare config shrunk to two plays and a few tiny rounds."""
    config = shakespeare.get_config("quick")
    config.data.plays = ("hamlet", "macbeth")
    config.data.max_train_examples = 8
    config.data.max_test_examples = 4
    config.num_rounds = 3
    config.clients_per_round = 4
    config.eval.clients = 6
    config.eval.chunk = 4
    config.methods.flow.policy_hidden = (16, 16, 16, 16)
    # A 32-unit LSTM (the config's is 256): the runs' 80-step recurrences dominate the
    # tests' time otherwise, and no test here depends on the width.
    config.model_options = {"hidden": 32}
    return apply_overrides(config, overrides)


def small_synthetic_config(**overrides):
    """The synthetic MLP config on 12 clients (43 to 320 training examples each), 4 per
    round: for engine behaviour that does not depend on the model, at a fraction of the
    LSTM's compile time."""
    from configs import synthetic
    config = synthetic.get_config("quick")
    config.data.num_clients = 12
    config.clients_per_round = 4
    config.eval.clients = 6
    return apply_overrides(config, overrides)


def tiny_mlp() -> RoutableModel:
    """A dropout-free model on 28x28 inputs, so a step can be recomputed by hand."""
    return chain_model(
        name="mlp", layer_names=("fc1", "fc2"), modules=(Dense(8), Dense(10)),
        embed_input=lambda x: x.reshape(x.shape[0], -1),
        glue_apply=lambda j, h, train, key: jax.nn.relu(h) if j == 0 else h,
        example_input=jax.ShapeDtypeStruct((1, 28, 28), jnp.float32),
        label_weights=lambda y: jnp.ones(y.shape, jnp.float32), instance_ndim=1,
        num_classes=10)


def one_client(task, index: int, padded_examples: int, batch_size: int = 4) -> ClientExamples:
    """Training client ``index`` of ``task`` as device arrays, padded to ``padded_examples``."""
    cohort = assemble_cohort(task.train, "train", [index], num_clients=1,
                             padded_examples=padded_examples, batch_size=batch_size)
    return client_at(jax.tree.map(jnp.asarray, cohort), 0)


def params_before_and_after_adam_rounds(algorithm, task, rounds: int = 2):
    """``(initial, final)`` server params of ``rounds`` rounds with an Adam server: Adam
    moves every parameter that gets a nonzero pseudo-gradient even once, so it exposes a
    part that should stay frozen."""
    import optax
    settings = experiment.RunSettings(seed=0, num_rounds=rounds, clients_per_round=3,
                                      batch_size=4)
    simulation = experiment.Simulation(algorithm, task, settings,
                                       server_optimizer=optax.adam(0.01))
    state = simulation.init_state()
    initial = jax.tree.map(np.array, state.params)
    for round_index in range(rounds):
        state, _ = simulation.run_round(state, round_index)
    return initial, state.params


def assert_trees_equal(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def differs(a, b) -> bool:
    return any(bool(jnp.any(x != y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def recording_simulation(simulation: experiment.Simulation, calls: list) -> experiment.Simulation:
    """The same simulation with a ``client_update`` that appends, per client call as the
    engine makes it, ``(client_id, state received, state returned)`` to ``calls``."""
    update = simulation.algorithm.client_update

    def client_update(params, examples, key, client_state):
        result = update(params, examples, key, client_state)
        jax.debug.callback(lambda *a: calls.append(jax.tree.map(np.asarray, a)),
                           examples.client_id, client_state, result.client_state)
        return result

    algorithm = dataclasses.replace(simulation.algorithm, client_update=client_update)
    return experiment.Simulation(algorithm, simulation.task, simulation.settings,
                                 simulation.server_optimizer, simulation.mapping)


def client_sampled_twice(sampler, num_rounds: int) -> tuple[int, int, int]:
    """``(client, first round, second round)`` of the first client sampled twice."""
    seen: dict[int, int] = {}
    for round_index in range(num_rounds):
        for client in sampler.sample(round_index):
            if int(client) in seen:
                return int(client), seen[int(client)], round_index
            seen[int(client)] = round_index
    raise AssertionError(f"no client is sampled twice in {num_rounds} rounds")


def stored_rows(store) -> dict[int, list[np.ndarray]]:
    """Every visited client's stored state leaves, by client id."""
    saved = store.state_dict()
    return {int(c): [leaf[row].copy() for leaf in saved["leaves"]]
            for row, c in enumerate(saved["ids"])}


def check_state_round_trip(algorithm_name: str, num_rounds: int = 4) -> experiment.RunResult:
    """Runs ``algorithm_name`` end to end through ``experiment.run`` and checks that

    * after each round, exactly the sampled clients' stored states changed, to what their
      ``client_update`` returned;
    * a client sampled in two rounds receives in the second exactly the state it left
      after the first (and that state is not the never-trained template);
    * the round and the evaluation are each traced once (no recompilation).
    """
    config = small_config(algorithm=algorithm_name, num_rounds=num_rounds)
    calls: list = []
    simulation = recording_simulation(run_config.build_simulation(config), calls)
    client, first, second = client_sampled_twice(simulation.sampler, num_rounds)
    store_after_round: dict[int, dict[int, list[np.ndarray]]] = {}
    previous: dict[int, list[np.ndarray]] = {}

    def after_round(rounds_done, _):
        nonlocal previous
        jax.effects_barrier()
        round_index = rounds_done - 1
        sampled = {int(c) for c in simulation.sampler.sample(round_index)}
        returned = {int(c[0]): c[2] for c in calls[-simulation.cohort_clients:]}
        assert set(returned) == sampled
        rows = stored_rows(simulation.client_states)
        assert set(rows) == set(previous) | sampled
        for c, leaves in rows.items():
            if c in sampled:
                assert_trees_equal(leaves, jax.tree.leaves(returned[c]))
            else:
                assert_trees_equal(leaves, previous[c])
        if round_index in (first, second - 1):
            store_after_round[round_index] = {client: rows[client]}
        previous = rows

    result = experiment.run(simulation, progress=after_round)
    # States in and out of the store every round, one compiled round and evaluation.
    assert simulation.trace_counts == {"round": 1, "eval": 1}, simulation.trace_counts
    assert len(calls) == num_rounds * simulation.cohort_clients
    rounds = [calls[r * simulation.cohort_clients:(r + 1) * simulation.cohort_clients]
              for r in range(num_rounds)]
    template, left = next((c[1], c[2]) for c in rounds[first] if int(c[0]) == client)
    received = next(c[1] for c in rounds[second] if int(c[0]) == client)
    assert_trees_equal(received, left)
    assert_trees_equal(jax.tree.leaves(received), store_after_round[first][client])
    assert_trees_equal(store_after_round[second - 1][client], store_after_round[first][client])
    assert differs(left, template)
    return result
