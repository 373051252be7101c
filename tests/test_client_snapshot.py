"""FedRep's, LG-FedAvg's and HypCluster's ``client_snapshot``: the copy the Flow authors'
evaluation scores as the method's Acc_g (``before_net``, after the first epoch of its
fine-tuning), and HypCluster's fine-tuned model they score as its Acc_p, built beside the
personalized model the option-off method builds."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowjax.algorithms.base import SGDConfig, plain_loss_sums, split_layers
from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
from flowjax.algorithms.fedrep import FedRepConfig, fedrep
from flowjax.algorithms.hypcluster import HypClusterConfig, hypcluster
from flowjax.algorithms.lg_fedavg import LGFedAvgConfig, lg_fedavg
from flowjax.core.local_training import epoch_batches
from flowjax.core.losses import mean_from_sums
from flowjax.models.base import forward
from tests.helpers import assert_trees_equal, differs, one_client

SGD = SGDConfig(learning_rate=0.05, epochs=3, batch_size=4, momentum=0.9)


@pytest.fixture(scope="module")
def headed(mlp):
    return dataclasses.replace(mlp, head_layers=("fc2",))


def _client(images_small):
    """A client with several minibatches per epoch (at least 12 examples, batches of 4)."""
    index = next(i for i, n in enumerate(images_small.train.num_examples("train")) if n >= 12)
    return one_client(images_small, index, padded_examples=32)


def _allclose(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)  # two programs: rounding


def _assert_scored(on, off, params, personal, x, whole=lambda part: part):
    """``predict`` with the option: the option-off method's global logits, and those of
    the personalized model and of the copy (``whole`` completes a part to a model)."""
    predictions = on.predict(params, personal, x)
    without = off.predict(params, personal["personal"], x)
    np.testing.assert_array_equal(predictions.global_logits, without.global_logits)
    assert without.global_snapshot is None and without.personal_snapshot is None
    for got, part in ((predictions.personal_hard, personal["personal"]),
                      (predictions.global_snapshot, personal["snapshot"]),
                      (predictions.personal_snapshot, personal.get("personal_snapshot"))):
        if part is None:  # FedRep, LG-FedAvg: their Acc_p model is the method's own
            assert got is None
        else:
            np.testing.assert_array_equal(got, forward(on.model, whole(part), x))


def _fedrep(model, snapshot=None, one_epoch=False):
    return fedrep(model, FedRepConfig(sgd=SGD, client_snapshot=snapshot,
                                      head_epochs=1 if one_epoch else None))


def _lg_fedavg(model, snapshot=None, one_epoch=False):
    sgd = dataclasses.replace(SGD, epochs=1) if one_epoch else SGD
    return lg_fedavg(model, LGFedAvgConfig(sgd=sgd, client_snapshot=snapshot))


@pytest.mark.parametrize("method, part", [(_fedrep, 0), (_lg_fedavg, 1)],
                         ids=["fedrep", "lg_fedavg"])
def test_the_snapshot_is_the_personal_part_after_the_first_evaluation_epoch(
        headed, images_small, method, part):
    """FedRep's head (body frozen) after the first of its 2 evaluation head epochs is what
    ``head_epochs=1`` builds; LG-FedAvg's local layers (global layers frozen) after the
    first of E = 3 what E = 1 builds: from the client's stored part and the same key. The
    personalized part is the option-off one."""
    on, off, one_epoch = method(headed, True), method(headed), method(headed, one_epoch=True)
    params = on.init(jax.random.key(0))
    stored = split_layers(headed.init(jax.random.key(5)), ("fc2",))[part]
    client, key = _client(images_small), jax.random.key(2)
    personal = jax.jit(on.personalize)(params, client, key, stored)
    _allclose(personal["personal"], jax.jit(off.personalize)(params, client, key, stored))
    _allclose(personal["snapshot"], jax.jit(one_epoch.personalize)(params, client, key, stored))
    assert differs({name: personal["snapshot"][name] for name in stored}, stored)
    assert differs(personal["snapshot"], personal["personal"])
    for name in set(personal["snapshot"]) - set(stored):  # LG-FedAvg's frozen global layers
        assert_trees_equal(personal["snapshot"][name], params["global"][name])
    whole = ((lambda head: {**params["body"], **head}) if method is _fedrep
             else (lambda model_params: model_params))
    _assert_scored(on, off, params, personal, client.x[0], whole)


def test_fedrep_snapshot_without_head_epochs_is_the_stored_head(headed, images_small):
    algorithm = fedrep(headed, FedRepConfig(sgd=SGD, head_epochs=0, client_snapshot=True))
    params = algorithm.init(jax.random.key(0))
    stored = split_layers(headed.init(jax.random.key(5)), ("fc2",))[0]
    personal = jax.jit(algorithm.personalize)(params, _client(images_small),
                                              jax.random.key(2), stored)
    assert_trees_equal(personal["snapshot"], stored)
    assert_trees_equal(personal["personal"], stored)


def _epochs_by_hand(model, params, client, key, epochs=1):
    """Epochs of plain SGD (lr 0.05), step by step: per epoch, (params after it, the mean
    of its steps' losses weighted by their examples)."""
    x, y, member = client.flat()
    after = []
    for epoch in range(epochs):
        indices, mask = epoch_batches(jax.random.fold_in(key, epoch), member, 4, x.shape[0])
        loss_sum = count = 0.0
        for step, (batch, batch_mask) in enumerate(zip(np.asarray(indices), np.asarray(mask))):
            if not batch_mask.any():
                continue
            batch = (x[batch], y[batch], jnp.asarray(batch_mask, jnp.float32))

            def mean_loss(p):
                sums = plain_loss_sums(model, p, batch, jax.random.key(step))  # no dropout
                return mean_from_sums(sums[0], sums[1]), sums

            grads, sums = jax.grad(mean_loss, has_aux=True)(params)
            params = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
            loss_sum, count = loss_sum + float(sums[0]), count + float(sums[1])
        after.append((params, loss_sum / count))
    return after


def _hypcluster_in_both_orders(model, starts, client, key):
    """HypCluster with ``client_snapshot`` (plain SGD, lr 0.05, as ``_epochs_by_hand``)
    from the two cluster ``starts`` in each order: yields the client's personalized
    models, checked first: the option-off personalized model (the pre-training choice,
    not trained) and every model scored by ``predict``."""
    sgd = dataclasses.replace(SGD, momentum=0.0)
    for order in ((0, 1), (1, 0)):
        build = lambda snapshot: hypcluster(
            model, HypClusterConfig(sgd=sgd, client_snapshot=snapshot),
            cluster_starts=[starts[i] for i in order])
        on, off = build(True), build(None)
        params = on.init(jax.random.key(0))
        personal = jax.jit(on.personalize)(params, client, key)
        assert_trees_equal(personal["personal"], jax.jit(off.personalize)(params, client, key))
        _assert_scored(on, off, params, personal, client.x[0])
        yield personal


def test_hypcluster_snapshot_is_the_cluster_with_the_lower_first_epoch_loss(mlp, images_small):
    """Every cluster trained one epoch on the same minibatches; the copy is the one whose
    steps had the lower mean loss (recomputed here step by step), whichever index it has.
    The personalized model is the option-off one (the pre-training choice, not trained)."""
    client, key = _client(images_small), jax.random.key(2)
    starts = [mlp.init(jax.random.key(7)), mlp.init(jax.random.key(8))]
    by_hand = [_epochs_by_hand(mlp, start, client, key)[0] for start in starts]
    losses = [loss for _, loss in by_hand]
    assert abs(losses[0] - losses[1]) > 1e-3  # the choice is not a near tie
    snapshots = []
    for personal in _hypcluster_in_both_orders(mlp, starts, client, key):
        _allclose(personal["snapshot"], by_hand[int(np.argmin(losses))][0])
        snapshots.append(personal["snapshot"])
    _allclose(snapshots[0], snapshots[1])


def test_hypcluster_fine_tuned_copy_is_the_cluster_with_the_lower_last_epoch_loss(
        mlp, images_small):
    """The authors' Acc_p model: every cluster trained E epochs on the same minibatches,
    the one whose last epoch had the lower mean loss, after all E (recomputed step by
    step). These two starts rank the other way after the first epoch, so the two copies
    are different clusters: a choice by the wrong epoch's losses fails."""
    client, key = _client(images_small), jax.random.key(2)
    starts = [mlp.init(jax.random.key(8)),
              jax.tree.map(lambda leaf: 0.3 * leaf, mlp.init(jax.random.key(21)))]
    by_hand = [_epochs_by_hand(mlp, start, client, key, epochs=3) for start in starts]
    first, last = ([run[epoch][1] for run in by_hand] for epoch in (0, -1))
    assert np.argmin(first) != np.argmin(last)
    assert min(abs(first[0] - first[1]), abs(last[0] - last[1])) > 0.1  # no near tie
    for personal in _hypcluster_in_both_orders(mlp, starts, client, key):
        _allclose(personal["snapshot"], by_hand[int(np.argmin(first))][0][0])
        _allclose(personal["personal_snapshot"], by_hand[int(np.argmin(last))][-1][0])


@pytest.mark.parametrize("epochs", [1, 2, 3])
def test_one_cluster_copies_are_fedavg_fts_models_after_one_and_all_epochs(mlp, images_small,
                                                                           epochs):
    """With k = 1 the copies are the one cluster fine-tuned one epoch and E epochs:
    FedAvgFT's personalized models at E = 1 and E from the same params and key (momentum
    0.9 as their code's); at E = 1 one model (E = 2, 3: the run without, with middle
    epochs)."""
    sgd = dataclasses.replace(SGD, epochs=epochs)
    algorithm = hypcluster(mlp, HypClusterConfig(sgd=sgd, clusters=1, client_snapshot=True))
    params = algorithm.init(jax.random.key(0))
    client, key = _client(images_small), jax.random.key(2)
    personal = jax.jit(algorithm.personalize)(params, client, key)
    for name, run_epochs in (("snapshot", 1), ("personal_snapshot", epochs)):
        fine_tune = fedavg(mlp, FedAvgConfig(sgd=dataclasses.replace(sgd, epochs=run_epochs),
                                             finetune=True))
        _allclose(personal[name], jax.jit(fine_tune.personalize)(params["cluster0"], client,
                                                                 key))
    assert differs(personal["snapshot"], personal["personal_snapshot"]) == (epochs > 1)
    assert_trees_equal(personal["personal"], params["cluster0"])


def test_a_diverged_cluster_is_copied_only_when_every_cluster_diverged(mlp, images_small):
    """A cluster whose fine-tuning loss is not finite is never the copy beside a finite
    one, in either order (``argmin`` alone would pick a NaN)."""
    client, key = _client(images_small), jax.random.key(2)
    finite = mlp.init(jax.random.key(8))
    diverged = jax.tree.map(lambda leaf: jnp.full_like(leaf, jnp.nan), finite)
    for personal in _hypcluster_in_both_orders(mlp, [diverged, finite], client, key):
        for name in ("snapshot", "personal_snapshot"):
            assert all(bool(jnp.all(jnp.isfinite(leaf)))
                       for leaf in jax.tree.leaves(personal[name])), name
    # Both diverged: the lowest index, as on a tie (its copies are NaN too).
    for personal in _hypcluster_in_both_orders(mlp, [diverged, diverged], client, key):
        for name in ("snapshot", "personal_snapshot"):
            assert all(bool(jnp.all(jnp.isnan(leaf)))
                       for leaf in jax.tree.leaves(personal[name])), name


@pytest.mark.parametrize("method", [
    lambda m, v: fedrep(m, FedRepConfig(sgd=SGD, client_snapshot=v)),
    lambda m, v: lg_fedavg(m, LGFedAvgConfig(sgd=SGD, client_snapshot=v)),
    lambda m, v: hypcluster(m, HypClusterConfig(sgd=SGD, client_snapshot=v))],
    ids=["fedrep", "lg_fedavg", "hypcluster"])
def test_client_snapshot_takes_only_a_bool(headed, method):
    with pytest.raises(ValueError, match=r"^client_snapshot='yes': expected one of "):
        method(headed, "yes")
