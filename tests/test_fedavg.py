"""FedAvg and FedAvgFT: the personalized model is the server's, or that model fine-tuned."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowjax.algorithms.base import SGDConfig, plain_loss_sums
from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
from flowjax.core.cohort import assemble_cohort, client_at
from flowjax.core.losses import mean_from_sums
from flowjax.models.base import forward
from tests.helpers import assert_trees_equal, differs


def _one_batch_client(task, index):
    cohort = assemble_cohort(task.train, "train", [index], num_clients=1, padded_examples=32,
                             batch_size=32)
    return client_at(jax.tree.map(jnp.asarray, cohort), 0)


def test_fedavg_ft_personalizes_by_sgd_from_the_server_model_and_fedavg_does_not(
        mlp, images_small):
    """One epoch of one minibatch (a dropout-free model): FedAvgFT's personal model is one
    SGD step from the server params on the client's train split; FedAvg's is the server's."""
    lr = 0.05
    sgd = SGDConfig(learning_rate=lr, epochs=1, batch_size=32)
    params = mlp.init(jax.random.key(0))
    client = _one_batch_client(images_small, 1)

    def loss(p):
        sums = plain_loss_sums(mlp, p, client.flat(), jax.random.key(0))
        return mean_from_sums(sums[0], sums[1])

    expected = jax.tree.map(lambda p, g: p - lr * g, params, jax.grad(loss)(params))
    fine_tuned = fedavg(mlp, FedAvgConfig(sgd=sgd, finetune=True))
    personal = jax.jit(fine_tuned.personalize)(params, client, jax.random.key(2))
    for got, want in zip(jax.tree.leaves(personal), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    x = client.x[0]
    predictions = fine_tuned.predict(params, personal, x)
    np.testing.assert_array_equal(predictions.global_logits, forward(mlp, params, x))
    np.testing.assert_array_equal(predictions.personal_hard, forward(mlp, personal, x))

    plain = fedavg(mlp, FedAvgConfig(sgd=sgd))
    assert_trees_equal(jax.jit(plain.personalize)(params, client, jax.random.key(2)), params)


def _client_of_size(task, size):
    """The first client with at least ``size`` train examples, padded to 32 (batches of 4:
    several steps per epoch)."""
    index = next(i for i, n in enumerate(task.train.num_examples("train")) if n >= size)
    cohort = assemble_cohort(task.train, "train", [index], num_clients=1, padded_examples=32,
                             batch_size=4)
    return client_at(jax.tree.map(jnp.asarray, cohort), 0)


def test_fedavg_ft_client_snapshot_is_its_fine_tuning_after_the_first_epoch(mlp, images_small):
    """The paper's FedAvgFT Acc_g model (the authors' ``before_net``): one run of E epochs,
    copied after epoch 0. Momentum, so the second part must carry the optimizer state on."""
    sgd = SGDConfig(learning_rate=0.05, epochs=3, batch_size=4, momentum=0.9)
    params = mlp.init(jax.random.key(0))
    client = _client_of_size(images_small, 12)
    key = jax.random.key(2)
    plain = jax.jit(fedavg(mlp, FedAvgConfig(sgd=sgd, finetune=True)).personalize)
    snapshotting = fedavg(mlp, FedAvgConfig(sgd=sgd, finetune=True, client_snapshot=True))
    personal = jax.jit(snapshotting.personalize)(params, client, key)
    one_epoch = fedavg(mlp, FedAvgConfig(sgd=dataclasses.replace(sgd, epochs=1), finetune=True))
    for got, want in ((personal["personal"], plain(params, client, key)),
                      (personal["snapshot"], jax.jit(one_epoch.personalize)(params, client, key))):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)  # two programs: rounding
    assert differs(personal["snapshot"], params)
    assert differs(personal["personal"], personal["snapshot"])
    x = client.x[0]
    predictions = snapshotting.predict(params, personal, x)
    np.testing.assert_array_equal(predictions.global_logits, forward(mlp, params, x))
    np.testing.assert_array_equal(predictions.personal_hard,
                                  forward(mlp, personal["personal"], x))
    np.testing.assert_array_equal(predictions.global_snapshot,
                                  forward(mlp, personal["snapshot"], x))


@pytest.mark.parametrize("method", ["apfl", "ditto"])
@pytest.mark.parametrize("visited", [False, True])
def test_apfl_and_ditto_client_snapshot_is_fedavg_fts_fine_tuned_model(mlp, images_small,
                                                                        method, visited):
    """The authors' APFL and Ditto Acc_g model (their ``net`` after the E epochs of its
    evaluation update): the server params after FedAvgFT's fine-tuning on the same key and
    optimizer, whatever the client's stored ``v``; the personalized model stays the one
    the option-off method builds."""
    from flowjax.algorithms.apfl import APFLConfig, apfl
    from flowjax.algorithms.ditto import DittoConfig, ditto

    sgd = SGDConfig(learning_rate=0.05, epochs=2, batch_size=4, momentum=0.9)
    build = {"apfl": lambda snapshot: apfl(mlp, APFLConfig(sgd=sgd, alpha=0.25,
                                                           client_snapshot=snapshot)),
             "ditto": lambda snapshot: ditto(mlp, DittoConfig(sgd=sgd, lam=0.1,
                                                              client_snapshot=snapshot))}[method]
    params = mlp.init(jax.random.key(0))
    state = {"v": mlp.init(jax.random.key(5)), "visited": jnp.asarray(visited)}
    client = _client_of_size(images_small, 12)
    key = jax.random.key(2)
    personal = jax.jit(build(True).personalize)(params, client, key, state)
    fine_tuned = jax.jit(fedavg(mlp, FedAvgConfig(sgd=sgd, finetune=True)).personalize)(
        params, client, key)
    off = jax.jit(build(None).personalize)(params, client, key, state)
    for got, want in ((personal["snapshot"], fine_tuned), (personal["personal"], off)):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)  # two programs: rounding
    assert differs(personal["snapshot"], params)
    assert differs(personal["snapshot"], personal["personal"])
    x = client.x[0]
    predictions = build(True).predict(params, personal, x)
    np.testing.assert_array_equal(predictions.global_logits, forward(mlp, params, x))
    np.testing.assert_array_equal(predictions.personal_hard,
                                  forward(mlp, personal["personal"], x))
    np.testing.assert_array_equal(predictions.global_snapshot,
                                  forward(mlp, personal["snapshot"], x))


@pytest.mark.parametrize("visited", [False, True])
def test_apfl_snapshot_momentum_trains_only_the_copy_with_it(mlp, images_small, visited):
    """Their Stack Overflow APFL evaluation trains ``net`` with momentum 0.9 where their
    training uses none: ``snapshot_momentum=0.9`` gives the copy FedAvgFT's fine-tuned
    model at momentum 0.9 (same key), and leaves the personalized model the momentum-free
    one; at the training's own momentum it is the option without it, bit for bit."""
    from flowjax.algorithms.apfl import APFLConfig, apfl

    sgd = SGDConfig(learning_rate=0.05, epochs=2, batch_size=4)
    build = lambda **fields: apfl(mlp, APFLConfig(sgd=sgd, alpha=0.25, **fields))
    params = mlp.init(jax.random.key(0))
    state = {"v": mlp.init(jax.random.key(5)), "visited": jnp.asarray(visited)}
    client, key = _client_of_size(images_small, 12), jax.random.key(2)
    personalize = lambda algorithm: jax.jit(algorithm.personalize)(params, client, key, state)
    personal = personalize(build(client_snapshot=True, snapshot_momentum=0.9))
    fine_tune = lambda momentum: jax.jit(fedavg(mlp, FedAvgConfig(
        sgd=dataclasses.replace(sgd, momentum=momentum), finetune=True)).personalize)(
        params, client, key)
    for got, want in ((personal["snapshot"], fine_tune(0.9)),
                      (personal["personal"], personalize(build()))):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)  # two programs: rounding
    assert differs(personal["snapshot"], fine_tune(0.0))  # the momentum reached the copy
    assert_trees_equal(personalize(build(client_snapshot=True, snapshot_momentum=0.0)),
                       personalize(build(client_snapshot=True)))
    with pytest.raises(ValueError, match=r"^snapshot_momentum=0.9: expected None: it sets "
                                         r"the momentum of the client snapshot"):
        build(snapshot_momentum=0.9)
    with pytest.raises(ValueError, match=r"^snapshot_momentum=1.5: expected None or a "
                                         r"number in \[0, 1\)"):
        build(client_snapshot=True, snapshot_momentum=1.5)


def _split_of(task, index, split):
    cohort = assemble_cohort(task.train, split, [index], num_clients=1, padded_examples=32,
                             batch_size=4)
    return client_at(jax.tree.map(jnp.asarray, cohort), 0)


@pytest.mark.parametrize("split", [None, "train"])
def test_fedavg_client_snapshot_is_one_epoch_of_training_scored_on_its_split(
        mlp, images_small, split):
    """FedAvg's ``client_snapshot`` (the authors' CIFAR FedAvg Acc_g): the server model
    trained one epoch, FedAvgFT's first (same key: equal to rounding), counted on the test
    split, or on the train split with ``snapshot_split="train"`` (their CIFAR-10 code);
    every other count is the test split's, as without the option, and Acc_p stays the
    server model."""
    from flowjax.core.losses import correct
    from flowjax.evaluation.metrics import evaluate_client

    sgd = SGDConfig(learning_rate=0.05, epochs=3, batch_size=4, momentum=0.9)
    params = mlp.init(jax.random.key(0))
    index = next(i for i, n in enumerate(images_small.train.num_examples("train")) if n >= 12)
    train, test = _split_of(images_small, index, "train"), _split_of(images_small, index, "test")
    key = jax.random.key(2)
    algorithm = fedavg(mlp, FedAvgConfig(sgd=sgd, client_snapshot=True, snapshot_split=split))
    personal = jax.jit(algorithm.personalize)(params, train, key)
    assert_trees_equal(personal["personal"], params)
    one_epoch = fedavg(mlp, FedAvgConfig(sgd=dataclasses.replace(sgd, epochs=1), finetune=True))
    for a, b in zip(jax.tree.leaves(personal["snapshot"]),
                    jax.tree.leaves(jax.jit(one_epoch.personalize)(params, train, key)),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)  # two programs: rounding
    assert differs(personal["snapshot"], params)

    def count(alg):
        return jax.jit(lambda p, tr, te, k: evaluate_client(alg, p, tr, te, k))(
            params, train, test, key)

    counts, without = count(algorithm), count(fedavg(mlp, FedAvgConfig(sgd=sgd)))
    scored = train if split == "train" else test
    x, y, mask = scored.flat()
    by_hand = jnp.sum(correct(forward(mlp, personal["snapshot"], x), y) & mask)
    assert float(counts.correct_global_snapshot) == float(by_hand)
    assert float(counts.snapshot_instances) == float(scored.num_examples)
    assert float(counts.instances) == float(test.num_examples) != float(train.num_examples)
    for field in ("instances", "correct_global", "correct_personal", "groups", "nonfinite"):
        np.testing.assert_array_equal(getattr(counts, field), getattr(without, field))
    assert float(without.snapshot_instances) == 0.0


def test_only_fedavg_takes_the_train_split_and_only_with_its_snapshot():
    sgd = SGDConfig(learning_rate=0.05, epochs=1, batch_size=4)
    for fields in ({"snapshot_split": "train"},
                   {"finetune": True, "client_snapshot": True, "snapshot_split": "train"}):
        with pytest.raises(ValueError, match=r"^snapshot_split='train': expected None or "
                                             r"'test': only FedAvg's client_snapshot"):
            FedAvgConfig(sgd=sgd, **fields)
    with pytest.raises(ValueError, match=r"^snapshot_split='val': expected one of "):
        FedAvgConfig(sgd=sgd, client_snapshot=True, snapshot_split="val")
