"""Ditto's personal update (the paper's step and the proximal one), its first
participation, and its state through the engine."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flowjax.algorithms.apfl import APFLConfig, apfl
from flowjax.algorithms.base import SGDConfig, plain_loss_sums
from flowjax.algorithms.ditto import DittoConfig, ditto, proximal_pull
from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
from flowjax.core import prng
from flowjax.core.cohort import client_at
from flowjax.core.losses import mean_from_sums
from flowjax.experiment import RunSettings, Simulation
from flowjax.validation import validate_config
from tests.helpers import (assert_trees_equal, check_state_round_trip, one_client,
                           small_config)

SGD = dict(learning_rate=0.05, epochs=2, batch_size=4)
CONFIG = dict(sgd=SGDConfig(**SGD))




def _visited(v):
    return {"v": v, "visited": jnp.asarray(True)}


def test_proximal_pull_is_exact_at_both_ends():
    z, anchor = {"a": jnp.array([1.5, -2.0, 0.0])}, {"a": jnp.array([0.25, 3.0, -1.0])}
    assert_trees_equal(proximal_pull(z, anchor, 0.0), z)
    np.testing.assert_allclose(proximal_pull(z, anchor, 1e12)["a"], anchor["a"], rtol=0, atol=1e-11)
    expected = (z["a"] + 3.0 * anchor["a"]) / 4.0
    np.testing.assert_allclose(proximal_pull(z, anchor, 3.0)["a"], expected, rtol=1e-6)


@pytest.mark.parametrize("step", [None, "gradient", "proximal"])
def test_one_minibatch_is_the_configured_step(step, mlp, images_small):
    """The paper's step ``v - lr (grad f(v) + lam (v - w_t))`` by default; the exact
    proximal step ``(v - lr grad f(v) + lr lam w_t) / (1 + lr lam)`` on request."""
    lr, lam = 0.05, 0.1
    algorithm = ditto(mlp, DittoConfig(sgd=SGDConfig(learning_rate=lr, epochs=1, batch_size=32),
                                       lam=lam, step=step))
    w_t = mlp.init(jax.random.key(0))
    v = mlp.init(jax.random.key(1))
    client = one_client(images_small, 1, padded_examples=32, batch_size=32)  # one minibatch
    result = algorithm.client_update(w_t, client, jax.random.key(2), _visited(v))

    def loss(params):
        sums = plain_loss_sums(mlp, params, client.flat(), jax.random.key(0))
        return mean_from_sums(sums[0], sums[1])

    expected_w = jax.tree.map(lambda p, g: p - lr * g, w_t, jax.grad(loss)(w_t))
    paper = jax.tree.map(lambda p, g, a: p - lr * (g + lam * (p - a)), v, jax.grad(loss)(v), w_t)
    proximal = jax.tree.map(lambda p, g, a: (p - lr * g + lr * lam * a) / (1 + lr * lam),
                            v, jax.grad(loss)(v), w_t)
    expected_v = proximal if step == "proximal" else paper
    for got, want in ((result.params, expected_w), (result.client_state["v"], expected_v)):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # The two steps differ beyond that tolerance (second order in lr * lam), so the
    # check above tells them apart.
    other = paper if step == "proximal" else proximal
    assert any(not np.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in
               zip(jax.tree.leaves(result.client_state["v"]), jax.tree.leaves(other)))


def test_huge_lam_keeps_the_personal_model_at_the_received_global_model(mlp, images_small):
    # lr * lam = 5e10: the paper's gradient step would diverge (> 2); the proximal one
    # holds v at w_t.
    algorithm = ditto(mlp, DittoConfig(**CONFIG, lam=1e12, step="proximal"))
    w_t = algorithm.init(jax.random.key(0))
    client = one_client(images_small, 1, padded_examples=32)
    update = jax.jit(algorithm.client_update)
    fresh, far = algorithm.init_client_state(w_t), _visited(mlp.init(jax.random.key(7)))
    results = [update(w_t, client, jax.random.key(1), state) for state in (fresh, far)]
    # The global update is FedAvg's whatever the personal model does.
    assert_trees_equal(results[1].params, results[0].params)
    fedavg_update = jax.jit(fedavg(mlp, FedAvgConfig(**CONFIG)).client_update)
    assert_trees_equal(results[0].params, fedavg_update(w_t, client, jax.random.key(1)).params)
    personal = jax.jit(algorithm.personalize)(w_t, client, jax.random.key(2), fresh)
    for v in (results[0].client_state["v"], results[1].client_state["v"], personal):
        for a, b in zip(jax.tree.leaves(v), jax.tree.leaves(w_t)):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-9)
    predictions = algorithm.predict(w_t, personal, client.x[0])
    np.testing.assert_allclose(predictions.personal_hard, predictions.global_logits, atol=1e-6)


@pytest.mark.parametrize("step", ["gradient", "proximal"])
def test_lam_zero_is_plain_local_training_of_v(step, cnn, images_small):
    algorithm = ditto(cnn, DittoConfig(**CONFIG, lam=0.0, step=step))
    fedavg_update = jax.jit(fedavg(cnn, FedAvgConfig(**CONFIG)).client_update)
    update = jax.jit(algorithm.client_update)
    w_t = algorithm.init(jax.random.key(0))
    v = cnn.init(jax.random.key(7))
    client = one_client(images_small, 2, padded_examples=32)
    key = jax.random.key(1)
    # First participation: v starts at w_t, so it is the FedAvg update itself.
    first = update(w_t, client, key, algorithm.init_client_state(w_t))
    assert_trees_equal(first.client_state["v"], first.params)
    assert bool(first.client_state["visited"])
    # Later: E epochs of plain SGD from the stored v.
    later = update(w_t, client, key, _visited(v))
    assert_trees_equal(later.client_state["v"], fedavg_update(v, client, key).params)


def test_personal_model_at_evaluation(mlp, images_small):
    algorithm = ditto(mlp, DittoConfig(**CONFIG, lam=0.1))
    w_t = algorithm.init(jax.random.key(0))
    client = one_client(images_small, 3, padded_examples=32)
    personalize = jax.jit(algorithm.personalize)
    key = jax.random.key(4)
    # Never trained: v trained from w_t on the train split, as at a first participation.
    fresh = algorithm.init_client_state(w_t)
    expected = jax.jit(algorithm.client_update)(w_t, client, key, fresh).client_state["v"]
    assert_trees_equal(personalize(w_t, client, key, fresh), expected)
    # Trained before: the stored v, untouched.
    stored = _visited(mlp.init(jax.random.key(7)))
    assert_trees_equal(personalize(w_t, client, key, stored), stored["v"])


def test_a_never_trained_clients_model_ignores_the_templates_values(mlp, images_small):
    # The engine builds every state from the *initial* params; with the server at a later
    # w_t, a never-trained client's v (update and evaluation) depends on w_t only, the
    # same rule as APFL's.
    algorithm = ditto(mlp, DittoConfig(**CONFIG, lam=0.1))
    fresh = algorithm.init_client_state(algorithm.init(jax.random.key(0)))
    other = dict(fresh, v=mlp.init(jax.random.key(4)))
    w_t = mlp.init(jax.random.key(9))
    client = one_client(images_small, 2, padded_examples=32)
    update, personalize = jax.jit(algorithm.client_update), jax.jit(algorithm.personalize)
    key = jax.random.key(1)
    assert_trees_equal(update(w_t, client, key, fresh).client_state,
                       update(w_t, client, key, other).client_state)
    assert_trees_equal(personalize(w_t, client, key, fresh), personalize(w_t, client, key, other))
    assert_trees_equal(personalize(w_t, client, key, fresh),
                       update(w_t, client, key, _visited(w_t)).client_state["v"])


def test_a_client_without_examples_stays_unvisited(mlp, images_small):
    algorithm = ditto(mlp, DittoConfig(**CONFIG, lam=0.1))
    w_t = algorithm.init(jax.random.key(0))
    client = one_client(images_small, 1, padded_examples=8)
    empty = client.replace(mask=jnp.zeros_like(client.mask), num_examples=jnp.int32(0))
    result = jax.jit(algorithm.client_update)(w_t, empty, jax.random.key(1),
                                              algorithm.init_client_state(w_t))
    assert not bool(result.client_state["visited"]) and float(result.weight) == 0.0


def test_bad_config_values_name_the_field():
    with pytest.raises(ValueError, match=r"^lam=-0.1: expected a finite number >= 0$"):
        DittoConfig(**CONFIG, lam=-0.1)
    with pytest.raises(ValueError, match=r"^step='prox': expected one of \[None, 'gradient', "
                                         r"'proximal'\]$"):
        DittoConfig(**CONFIG, lam=0.1, step="prox")

def test_a_lam_the_papers_step_diverges_with_is_refused_for_a_ditto_run(mlp):
    # lr 0.05: the paper's step diverges from lam = 40 on; the proximal step takes it.
    with pytest.raises(ValueError, match=r"^lam=40.0: expected lam < 2 / learning_rate \(40\), "
                                         r"beyond which the paper's gradient step diverges; "
                                         r"step='proximal' is stable for any lam$"):
        ditto(mlp, DittoConfig(**CONFIG, lam=40.0))
    ditto(mlp, DittoConfig(**CONFIG, lam=39.9))
    ditto(mlp, DittoConfig(**CONFIG, lam=40.0, step="proximal"))
    # Through a run config: refused for Ditto's run, not for another method's, whose
    # learning rate Ditto never trains with.
    config = small_config(algorithm="ditto", **{"methods.ditto.lam": 2.5})  # lr 1.0
    with pytest.raises(ValueError, match=r"^config.methods.ditto.lam=2.5: expected lam < 2 / "
                                         r"learning_rate \(2\), beyond which"):
        validate_config(config)
    config.algorithm = "fedavg"
    validate_config(config)
    with pytest.raises(ValueError, match=r"^batch_size=0: expected an integer >= 1$"):
        SGDConfig(**{**SGD, "batch_size": 0})


def test_run_trains_evaluates_and_returns_each_client_its_own_state():
    result = check_state_round_trip("ditto")
    train = [h for h in result.history if h["kind"] == "train"]
    assert all(np.isfinite(h["loss"]) and np.isfinite(h["personal_loss"]) for h in train)
    summary = result.summaries["train_clients"]
    assert 0 < summary.acc_g < 1 and 0 < summary.acc_p < 1
    assert set(result.summaries) == {"train_clients", "held_out_clients"}


@pytest.mark.parametrize("method", ["ditto", "apfl"])
def test_a_personal_model_that_diverges_is_skipped_and_keeps_its_state(method, mlp,
                                                                      images_small):
    """v lives only in the client state: a v that goes non-finite while w stays finite
    drops the client from the round like a diverged w (counted in ``clients_skipped``),
    and its stored state stays what it came with."""
    algorithm = (ditto(mlp, DittoConfig(**CONFIG, lam=0.1)) if method == "ditto"
                 else apfl(mlp, APFLConfig(**CONFIG, alpha=0.3)))
    settings = RunSettings(seed=0, num_rounds=1, clients_per_round=3, batch_size=4)
    simulation = Simulation(algorithm, images_small, settings, server_optimizer=optax.sgd(1.0))
    state = simulation.init_state()
    victim = np.asarray(simulation.sampler.sample(0)[:1])
    # Finite, but a personal step from it overflows float32.
    planted = {"v": jax.tree.map(lambda p: np.full((1,) + p.shape, 1e30, np.float32),
                                 state.params),
               "visited": np.array([True])}
    simulation.client_states.scatter(victim, planted)
    cohort = jax.tree.map(jnp.asarray, simulation.host_cohort(0))
    before = simulation.client_states.gather(np.asarray(cohort.client_id))
    initial = jax.tree.map(np.array, state.params)  # the round donates its input state
    state, metrics = simulation.run_round(state, 0)
    assert float(metrics["clients_skipped"]) == 1.0
    # The server's mean is the other clients' alone, by their example counts.
    key_of_round = prng.round_key(prng.base_key(0, prng.Purpose.TRAIN), 0)
    sent, weights = [], []
    for slot in (1, 2):  # slot 0 is the victim
        client = client_at(cohort, slot)
        result = algorithm.client_update(initial, client,
                                         prng.client_key(key_of_round, client.client_id),
                                         jax.tree.map(lambda a, s=slot: a[s], before))
        sent.append(result.params)
        weights.append(float(result.weight))
    expected = jax.tree.map(lambda a, b: (weights[0] * a + weights[1] * b) / sum(weights), *sent)
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert all(np.isfinite(float(value)) for value in metrics.values())
    assert_trees_equal(simulation.client_states.gather(victim), planted)
    assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(state.params))
