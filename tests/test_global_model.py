"""The global model FedRep and LG-FedAvg report (Acc_g): the server's example-weighted mean
of the personal layers its latest cohort trained, kept for reporting only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowjax import config as run_config
from flowjax import experiment
from flowjax.algorithms.base import SGDConfig
from flowjax.algorithms.fedrep import FedRepConfig, fedrep
from flowjax.algorithms.lg_fedavg import LGFedAvgConfig, lg_fedavg
from flowjax.core.cohort import assemble_cohort, client_at
from flowjax.core.server_opt import ClientMean, server_optimizer
from flowjax.models.base import forward
from tests.helpers import assert_trees_equal, small_config

# method -> (builder, server key of the shared part, server key of the reported mean,
#            a valid personalized model from the server params, for predict)
METHODS = {
    "fedrep": (lambda model: fedrep(model, FedRepConfig(sgd=SGD, head_epochs=1, body_epochs=1)),
               "body", "mean_head", lambda params: params["initial_head"]),
    "lg_fedavg": (lambda model: lg_fedavg(model, LGFedAvgConfig(sgd=SGD)),
                  "global", "mean_local",
                  lambda params: {**params["initial_local"], **params["global"]}),
}
SGD = SGDConfig(learning_rate=0.05, epochs=1, batch_size=4)
CLIENTS = [1, 4, 7]  # unequal sizes: a uniform mean would not pass


@pytest.mark.parametrize("server", ["sgd", "adam"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_the_reported_part_is_the_weighted_mean_of_the_cohorts_trained_parts(
        method, server, cnn, images_small):
    build, shared, mean, personal_of = METHODS[method]
    algorithm = build(cnn)
    settings = experiment.RunSettings(seed=0, num_rounds=1, clients_per_round=3, batch_size=4)
    simulation = experiment.Simulation(algorithm, images_small, settings,
                                       server_optimizer=server_optimizer(server, 0.01
                                                                         if server == "adam"
                                                                         else 1.0))
    cohort = jax.tree.map(jnp.asarray, assemble_cohort(
        images_small.train, "train", CLIENTS, num_clients=3,
        padded_examples=simulation.train_examples, batch_size=4))
    state = simulation.init_state()
    state, _ = simulation.run_round(state, 0, cohort)

    # What the clients kept (their personal parts after the round), from the host store.
    stored = simulation.client_states.gather(np.array(CLIENTS))
    weights = np.asarray(cohort.num_examples, np.float64)
    assert len(set(weights)) > 1
    expected = jax.tree.map(lambda leaf: np.tensordot(weights, leaf, axes=1) / weights.sum(),
                            stored)
    assert isinstance(state.params[mean], ClientMean)
    for got, want in zip(jax.tree.leaves(state.params[mean].value), jax.tree.leaves(expected),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    # Acc_g's model is the shared part with that mean.
    x = client_at(cohort, 0).x[0]
    predictions = algorithm.predict(state.params, personal_of(state.params), x)
    np.testing.assert_array_equal(
        predictions.global_logits,
        forward(cnn, {**state.params[shared], **state.params[mean].value}, x))


@pytest.mark.parametrize("method", sorted(METHODS))
def test_training_never_reads_the_reported_part(method, cnn, images_small):
    build, shared, mean, _ = METHODS[method]
    algorithm = build(cnn)
    params = algorithm.init(jax.random.key(0))
    garbage = dict(params, **{mean: jax.tree.map(lambda a: a + 100.0, params[mean])})
    cohort = assemble_cohort(images_small.train, "train", [2], num_clients=1,
                             padded_examples=32, batch_size=4)
    client = client_at(jax.tree.map(jnp.asarray, cohort), 0)
    state = algorithm.init_client_state(params)
    update = jax.jit(algorithm.client_update)
    a = update(params, client, jax.random.key(1), state)
    b = update(garbage, client, jax.random.key(1), state)
    assert_trees_equal(a.params[shared], b.params[shared])
    assert_trees_equal(a.client_state, b.client_state)
    assert_trees_equal(a.params[mean], b.params[mean])  # the client's own trained part


def test_the_reported_part_survives_checkpoint_and_resume(tmp_path):
    # ClientMean is a pytree node of the server params: orbax must restore it as one.
    def run(rounds, workdir):
        config = small_config(algorithm="fedrep", num_rounds=rounds, checkpoint_every=1,
                              **{"eval.held_out": False})
        return experiment.run(run_config.build_simulation(config), workdir=str(workdir),
                              checkpoint_every=1)

    clean = run(2, tmp_path / "clean")
    run(1, tmp_path / "resumed")
    resumed = run(2, tmp_path / "resumed")  # restores round 1's checkpoint, trains round 2
    assert isinstance(resumed.final_state.params["mean_head"], ClientMean)
    assert_trees_equal(resumed.final_state.params["mean_head"],
                       clean.final_state.params["mean_head"])
    assert (resumed.summaries["train_clients"].acc_g
            == clean.summaries["train_clients"].acc_g)
