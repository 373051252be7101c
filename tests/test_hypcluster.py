"""HypCluster: cluster choice, per-cluster aggregation, warm start, and k = 1 = FedAvg."""

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from flowjax import config as run_config
from flowjax import experiment
from flowjax.algorithms.base import SGDConfig, train_plain, valid_examples
from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
from flowjax.algorithms.hypcluster import (HypClusterConfig, hypcluster, kmeans_starts,
                                          mean_train_loss)
from flowjax.core.cohort import assemble_cohort, client_at
from flowjax.core.mapping import ClientMapping
from flowjax.engine.callbacks import Callback, ProgressBar
from flowjax.core.server_opt import server_optimizer
from flowjax.core.losses import masked_mean_loss
from flowjax.experiment import RunSettings, Simulation
from flowjax.models import get_model
from flowjax.models.base import forward
from flowjax.models.layers import Dense, chain_model
from tests import forkserver
from tests.helpers import default_xla_env, small_config, small_synthetic_config

SGD = dict(learning_rate=0.05, epochs=1, batch_size=4)
CONFIG = dict(sgd=SGDConfig(**SGD))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



@pytest.fixture(scope="module")
def mlp():
    """A small dropout-free model: quick to compile for the unit tests."""
    return chain_model(
        name="mlp", layer_names=("fc1", "fc2"), modules=(Dense(16), Dense(10)),
        embed_input=lambda x: x.reshape(x.shape[0], -1),
        glue_apply=lambda j, h, train, key: jax.nn.relu(h) if j == 0 else h,
        example_input=jax.ShapeDtypeStruct((1, 28, 28), jnp.float32),
        label_weights=lambda y: jnp.ones(y.shape, jnp.float32), instance_ndim=1,
        num_classes=10)


def _client(task, index, padded_examples, batch_size=4):
    cohort = assemble_cohort(task.train, "train", [index], num_clients=1,
                             padded_examples=padded_examples, batch_size=batch_size)
    return client_at(jax.tree.map(jnp.asarray, cohort), 0)


def _leaves_equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


_ONE_CLUSTER_CHILD = """
import jax, numpy as np, optax
from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
from flowjax.algorithms.hypcluster import HypClusterConfig, hypcluster
from flowjax.algorithms.base import SGDConfig, train_plain, valid_examples
from flowjax.data.synthetic import synthetic_images
from flowjax.experiment import RunSettings, Simulation
from flowjax.models import get_model
from flowjax.models.base import forward
from tests.helpers import one_client

def leaves_equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

cnn = get_model("emnist_cnn", num_classes=10)  # with dropout: the keys must match too
task = synthetic_images(num_clients=12, num_classes=10, examples=(6, 30), seed=1, held_out=3)
settings = RunSettings(seed=3, num_rounds=1, clients_per_round=3, batch_size=4,
                       max_examples_per_client=8)
sgd = SGDConfig(learning_rate=0.05, epochs=1, batch_size=4)
states, initial = {}, {}
one_cluster = hypcluster(cnn, HypClusterConfig(sgd=sgd, clusters=1))
for name, algorithm in (("fedavg", fedavg(cnn, FedAvgConfig(sgd=sgd))),
                        ("hypcluster", one_cluster)):
    simulation = Simulation(algorithm, task, settings, server_optimizer=optax.sgd(1.0))
    state = simulation.init_state()
    initial[name] = jax.tree.map(np.array, state.params)
    state, _ = simulation.run_round(state, 0)
    states[name] = state.params
assert set(states["hypcluster"]) == {"cluster0"}
assert leaves_equal(states["hypcluster"]["cluster0"], states["fedavg"]), "round"
assert leaves_equal(initial["hypcluster"]["cluster0"], initial["fedavg"]), "init"
assert not leaves_equal(states["fedavg"], initial["fedavg"]), "the round trained"
# ... and the evaluation's global and personal predictions are FedAvg's too.
client = one_client(task, 0, padded_examples=32)
personal = one_cluster.personalize(states["hypcluster"], client, jax.random.key(0))
predictions = one_cluster.predict(states["hypcluster"], personal, client.x[0])
expected = forward(cnn, states["fedavg"], client.x[0])
np.testing.assert_array_equal(predictions.global_logits, expected)
np.testing.assert_array_equal(predictions.personal_hard, expected)
# A warm-up of W FedAvg rounds, then HypCluster's rounds W .. R - 1 of the seed's sampling and
# training streams: with k = 1 and no perturbation, R rounds of FedAvg.
from flowjax import config as run_config
from tests.helpers import small_synthetic_config  # the MLP: the LSTM took 23 s here, it 19
warm_then_one = run_config.build_simulation(small_synthetic_config(
    algorithm="hypcluster", num_rounds=3, **{"methods.hypcluster.warmup_rounds": 2,
                                             "methods.hypcluster.clusters": 1,
                                             "methods.hypcluster.perturbation": 0.0}))
plain = run_config.build_simulation(small_synthetic_config(algorithm="fedavg", num_rounds=3))
assert not np.array_equal(plain.host_cohort(0).client_id, plain.host_cohort(2).client_id)
np.testing.assert_array_equal(warm_then_one.host_cohort(2).client_id,
                              plain.host_cohort(2).client_id)
assert warm_then_one.settings.first_round == 2
state = warm_then_one.init_state()
state, _ = warm_then_one.run_round(state, 2)
reference = plain.init_state()
for round_index in range(3):
    reference, _ = plain.run_round(reference, round_index)
assert leaves_equal(state.params["cluster0"], reference.params), "warm-up + 1 == 3 rounds"
print("one cluster == FedAvg")
"""


# -m slow (34 s of CI's 2 cores, a default build's compiles). CI keeps HypCluster's warm-up
# equal to FedAvg's rounds (test_schema) and its choice and training of a cluster here.
@pytest.mark.slow
def test_one_cluster_is_fedavg_exactly_through_the_engine():
    """HypCluster with k = 1 trains and predicts exactly as FedAvg, and after its warm-up
    continues FedAvg's rounds rather than replaying them: two different programs
    agreeing bit for bit, so checked as a user's default build compiles them (in a child
    without the suite's XLA flags, under which their sums may be ordered differently)."""
    done = forkserver.run([sys.executable, "-c", _ONE_CLUSTER_CHILD], capture_output=True,
                          text=True, cwd=ROOT, env=default_xla_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "one cluster == FedAvg" in done.stdout


def test_client_picks_and_trains_only_the_cluster_that_fits_it(mlp, images_small):
    client = _client(images_small, 1, padded_examples=32)
    random_init = mlp.init(jax.random.key(0))
    fitted = jax.jit(fedavg(mlp, FedAvgConfig(sgd=SGDConfig(**{**SGD, "epochs": 5})))
                     .client_update)(random_init, client, jax.random.key(1)).params
    algorithm = hypcluster(mlp, HypClusterConfig(**CONFIG, clusters=2))
    update = jax.jit(algorithm.client_update)
    n = float(client.num_examples)
    for fitted_cluster in (1, 0):
        params = {f"cluster{fitted_cluster}": fitted, f"cluster{1 - fitted_cluster}": random_init}
        other = f"cluster{1 - fitted_cluster}"
        chosen = f"cluster{fitted_cluster}"
        assert (mean_train_loss(mlp, params[chosen], client)
                < mean_train_loss(mlp, params[other], client))
        result = update(params, client, jax.random.key(2))
        assert float(result.weight[chosen]) == n and float(result.weight[other]) == 0.0
        assert _leaves_equal(result.params[other], params[other])  # untouched
        assert not _leaves_equal(result.params[chosen], params[chosen])  # trained
        assert float(result.metrics[f"clients_in_{chosen}_sum"]) == 1.0
        assert float(result.metrics[f"clients_in_{other}_sum"]) == 0.0
        assert _leaves_equal(algorithm.personalize(params, client, jax.random.key(3)),
                             params[chosen])


def test_a_cluster_with_a_non_finite_loss_is_not_chosen_over_a_finite_one(mlp, images_small):
    """A bare argmin picks the first NaN; the choice reads a non-finite loss as +inf, so
    the client trains the finite cluster, whichever index holds the NaN one, and with
    every loss NaN falls back to the lowest index, as a tie does."""
    client = _client(images_small, 1, padded_examples=32)
    finite = mlp.init(jax.random.key(0))
    broken = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), finite)
    update = jax.jit(hypcluster(mlp, HypClusterConfig(**CONFIG, clusters=2)).client_update)
    n = float(client.num_examples)
    for nan_cluster in (0, 1):
        params = {f"cluster{nan_cluster}": broken, f"cluster{1 - nan_cluster}": finite}
        assert not np.isfinite(float(mean_train_loss(mlp, broken, client)))
        result = update(params, client, jax.random.key(2))
        assert float(result.weight[f"cluster{1 - nan_cluster}"]) == n
        assert float(result.weight[f"cluster{nan_cluster}"]) == 0.0
    result = update({"cluster0": broken, "cluster1": broken}, client, jax.random.key(2))
    assert float(result.weight["cluster0"]) == n and float(result.weight["cluster1"]) == 0.0


def test_selection_loss_is_the_masked_mean_and_ignores_padding(mlp, images_small):
    params = mlp.init(jax.random.key(0))
    n = int(images_small.train.num_examples("train")[2])
    tight = _client(images_small, 2, padded_examples=-(-n // 4) * 4)
    padded = _client(images_small, 2, padded_examples=-(-n // 4) * 4 + 16)
    x, y, mask = tight.flat()
    expected = masked_mean_loss(forward(mlp, params, x), y, mask.astype(jnp.float32))
    np.testing.assert_allclose(mean_train_loss(mlp, params, tight), expected, rtol=1e-6)
    np.testing.assert_allclose(mean_train_loss(mlp, params, padded),
                               mean_train_loss(mlp, params, tight), rtol=1e-6)


def test_clusters_nobody_chose_keep_their_params_through_the_engine(mlp, images_small):
    # Cluster 1 starts far off (scaled weights), so every client picks cluster 0.
    algorithm = hypcluster(mlp, HypClusterConfig(**CONFIG, clusters=2))
    settings = RunSettings(seed=0, num_rounds=1, clients_per_round=3, batch_size=4,
                           max_examples_per_client=16)
    simulation = Simulation(algorithm, images_small, settings, server_optimizer=optax.sgd(1.0))
    state = simulation.init_state()
    far = jax.tree.map(lambda a: 30.0 * a, state.params["cluster1"])
    state = state.replace(params={"cluster0": state.params["cluster0"], "cluster1": far})
    far_copy = jax.tree.map(jnp.copy, far)
    before = jax.tree.map(jnp.copy, state.params["cluster0"])
    state, metrics = simulation.run_round(state, 0)
    assert float(metrics["clients_in_cluster0_sum"]) == 3
    assert float(metrics["clients_in_cluster0_count"]) == 3
    assert float(metrics["updates_to_cluster0"]) == 3
    assert float(metrics["updates_to_cluster1"]) == 0
    assert _leaves_equal(state.params["cluster1"], far_copy)
    assert not _leaves_equal(state.params["cluster0"], before)


def test_with_an_adam_server_a_cluster_nobody_chose_does_not_move(mlp, images_small):
    # Round 0: cluster 0 starts far off, every client picks and trains cluster 1, which
    # gets Adam momentum. Round 1: cluster 1 is moved far off, every client picks cluster
    # 0; cluster 1's zero pseudo-gradient must not step it on its momentum, and its Adam
    # state must stay exactly as round 0 left it.
    algorithm = hypcluster(mlp, HypClusterConfig(**CONFIG, clusters=2))
    settings = RunSettings(seed=0, num_rounds=2, clients_per_round=3, batch_size=4,
                           max_examples_per_client=16)
    simulation = Simulation(algorithm, images_small, settings,
                            server_optimizer=server_optimizer("adam", 0.01))
    state = simulation.init_state()
    far = lambda params: jax.tree.map(lambda a: 30.0 * a, params)  # noqa: E731
    state = state.replace(params={"cluster0": far(state.params["cluster0"]),
                                  "cluster1": state.params["cluster1"]})
    state, metrics = simulation.run_round(state, 0)
    assert float(metrics["clients_in_cluster1_sum"]) == 3
    state = state.replace(params={"cluster0": mlp.init(jax.random.key(4)),
                                  "cluster1": far(state.params["cluster1"])})
    parked = jax.tree.map(np.array, state.params["cluster1"])
    adam_state = jax.tree.map(np.array, state.opt_state["cluster1"])
    state, metrics = simulation.run_round(state, 1)
    assert float(metrics["clients_in_cluster0_sum"]) == 3
    assert _leaves_equal(state.params["cluster1"], parked)
    assert _leaves_equal(state.opt_state["cluster1"], adam_state)


def test_warm_start_is_a_seeded_perturbation_of_every_cluster(mlp):
    warm = mlp.init(jax.random.key(7))
    algorithm = hypcluster(mlp, HypClusterConfig(**CONFIG, clusters=3, perturbation=0.01),
                           warm_start=warm)
    params = algorithm.init(jax.random.key(0))
    assert set(params) == {"cluster0", "cluster1", "cluster2"}
    noise = [np.concatenate([np.ravel(a - b) for a, b in
                             zip(jax.tree.leaves(params[c]), jax.tree.leaves(warm))])
             for c in params]
    for draw in noise:
        assert 0.009 < np.std(draw) < 0.011 and abs(np.mean(draw)) < 1e-3
    assert not np.array_equal(noise[0], noise[1])
    assert _leaves_equal(params, algorithm.init(jax.random.key(0)))  # seeded
    exact = hypcluster(mlp, HypClusterConfig(**CONFIG, clusters=2, perturbation=0.0),
                       warm_start=warm).init(jax.random.key(0))
    assert _leaves_equal(exact["cluster0"], warm) and _leaves_equal(exact["cluster1"], warm)


def test_random_init_gives_distinct_clusters_and_cluster0_is_the_plain_init(mlp):
    params = hypcluster(mlp, HypClusterConfig(**CONFIG, clusters=2)).init(jax.random.key(0))
    assert _leaves_equal(params["cluster0"], mlp.init(jax.random.key(0)))
    assert not _leaves_equal(params["cluster0"], params["cluster1"])


def test_bad_config_and_warm_start_raise_one_line_errors(cnn):
    with pytest.raises(ValueError, match=r"^clusters=0: expected an integer >= 1$"):
        HypClusterConfig(**CONFIG, clusters=0)
    with pytest.raises(ValueError, match=r"^perturbation=-0.1: expected a finite number >= 0$"):
        HypClusterConfig(**CONFIG, perturbation=-0.1)
    other = get_model("emnist_cnn", num_classes=5).init(jax.random.key(0))
    with pytest.raises(ValueError, match="warm_start does not match the params of emnist_cnn"):
        hypcluster(cnn, HypClusterConfig(**CONFIG), warm_start=other)


def test_warm_started_run_trains_and_evaluates():
    """The warm-up's rounds count within ``num_rounds``: after 1 FedAvg round (its record
    first in the history), HypCluster trains rounds 2 and 3 of 3, logged and evaluated by
    their run index."""
    config = small_config(algorithm="hypcluster", num_rounds=3)
    config.model_options = ml_collections.ConfigDict({"hidden": 32})
    config.methods.hypcluster.warmup_rounds = 1
    simulation = run_config.build_simulation(config)
    bar = ProgressBar(3, "hypcluster")  # drawn on stderr, which pytest captures
    shown = []

    class ShownAtStart(Callback):
        def on_run_start(self, run):
            shown.append(bar.rounds_shown)

    result = experiment.run(simulation, callbacks=[bar, ShownAtStart()])
    assert (shown, bar.rounds_shown) == ([1], 3)  # the bar starts after the warm-up
    warm, *train = [h for h in result.history if h["kind"] == "train"]
    assert (warm["round"], warm["stage"], [h["round"] for h in train]) == (1, "warm-up", [2, 3])
    assert np.isfinite(warm["loss"]) and "clients_in_cluster0" not in warm
    assert all(np.isfinite(h["loss"]) for h in train)
    assert {h["round"] for h in result.history if h["kind"] == "eval"} == {3}
    for record in train:
        assert record["clients_in_cluster0"] + record["clients_in_cluster1"] == pytest.approx(1.0)
    summary = result.summaries["train_clients"]
    assert 0 < summary.acc_g < 1 and 0 < summary.acc_p < 1
    # The warm start moved the clusters off the random init: both start near one point.
    params = simulation.algorithm.init(jax.random.key(0))
    gap = max(float(jnp.max(jnp.abs(a - b))) for a, b in
              zip(jax.tree.leaves(params["cluster0"]), jax.tree.leaves(params["cluster1"])))
    assert gap < 0.2
    plain = simulation.algorithm.model.init(jax.random.key(0))
    assert not _leaves_equal(params["cluster0"], plain)


# The run's own mapping: the whole cohort in one vmap, client by client, and chunks of 3
# (two whole chunks and a rest of one: the padding client).
@pytest.mark.parametrize("mapping", [ClientMapping("vmap"), ClientMapping("loop"),
                                     ClientMapping("chunked", 3)],
                         ids=lambda m: f"{m.strategy}{m.chunk_size}")
def test_kmeans_starts_pick_a_client_then_the_one_worst_served_so_far(mlp, images_small,
                                                                     mapping):
    """FedJAX's kmeans_init: cluster 0 at the first client's trained params, then the
    trained params of the client whose lowest loss under the picks so far is largest;
    checked against each client trained alone and its losses computed alone, under each
    mapping of the clients."""
    sgd = SGDConfig(**SGD)
    cohort = jax.tree.map(jnp.asarray, assemble_cohort(
        images_small.train, "train", [0, 1, 2, 3, 4, 5], num_clients=7, padded_examples=32,
        batch_size=4))  # a padding client last: never picked
    keys = jax.random.split(jax.random.key(3), 7)
    start = mlp.init(jax.random.key(0))
    starts = kmeans_starts(mlp, sgd, start, cohort, keys, clusters=3, first=2,
                           mapping=mapping)
    alone = [train_plain(mlp, start, sgd.optimizer(), client_at(cohort, i),
                         valid_examples(client_at(cohort, i)), epochs=1, batch_size=4,
                         key=keys[i])[0] for i in range(6)]
    best, picks = np.full(6, np.inf), [2]
    for _ in range(2):
        losses = np.array([mean_train_loss(mlp, alone[picks[-1]], client_at(cohort, i))
                           for i in range(6)])
        best = np.minimum(best, losses)
        top, second = np.sort(best)[::-1][:2]
        assert top - second > 1e-3  # the pick does not hang on the last bits
        picks.append(int(np.argmax(best)))
    assert len(set(picks)) == 3
    for got, pick in zip(starts, picks):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(alone[pick])):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_metrics_jsonl_logs_the_warm_up_rounds_as_fedavgs_first_rounds(tmp_path):
    """``metrics.jsonl`` has a line for every round: a HypCluster run's first W training
    records are its FedAvg warm-up's, marked ``"stage": "warm-up"``, and equal FedAvg's
    first W records of the same config (the warm-up is those rounds)."""
    from flowjax import run_folder
    from flowjax.runner import run_config_to_workdir
    config = small_config(algorithm="hypcluster", num_rounds=3)
    config.model_options = ml_collections.ConfigDict({"hidden": 32})
    config.methods.hypcluster.warmup_rounds = 2
    run_config_to_workdir(config, str(tmp_path), progress=False)
    logged = [r for r in run_folder.read_metrics(str(tmp_path)) if r["kind"] == "train"]
    assert [(r["round"], r.get("stage")) for r in logged] == [
        (1, "warm-up"), (2, "warm-up"), (3, None)]
    config.algorithm = "fedavg"
    fedavg_run = experiment.run(run_config.build_simulation(config)).history
    fedavg_train = [r for r in fedavg_run if r["kind"] == "train"]
    assert [{k: v for k, v in r.items() if k != "stage"} for r in logged[:2]] == fedavg_train[:2]


def test_kmeans_init_starts_a_run_at_its_picks_and_is_seeded():
    config = small_synthetic_config(algorithm="hypcluster", num_rounds=3)
    config.methods.hypcluster.update(warmup_rounds=1, init="kmeans")
    run = run_config.resolve(config)
    warm = run_config.warm_up(run)
    starts = warm.options["cluster_starts"]
    assert not _leaves_equal(starts[0], starts[1])
    again = run_config.warm_up(run_config.resolve(config)).options["cluster_starts"]
    assert _leaves_equal(starts, again)  # a resumed attempt computes the same starts
    simulation = run_config.simulation_for(run, warm)
    late = dataclasses.replace(warm, records=(*warm.records, {"round": 2, "kind": "train"}))
    with pytest.raises(ValueError, match=r"^earlier_records: round 2 is not an earlier "
                       r"stage's: expected rounds 1 to first_round=1$"):
        run_config.simulation_for(run, late)
    params = simulation.init_state().params
    assert _leaves_equal(params["cluster0"], starts[0])
    assert _leaves_equal(params["cluster1"], starts[1])
    result = experiment.run(simulation)
    # The history starts with the warm-up's round, then HypCluster's own.
    assert [(h["round"], h.get("stage")) for h in result.history if h["kind"] == "train"] == [
        (1, "warm-up"), (2, None), (3, None)]
    with pytest.raises(ValueError, match=r"^init='kmeanz': expected one of \[None, 'kmeans'\]$"):
        HypClusterConfig(**CONFIG, init="kmeanz")
