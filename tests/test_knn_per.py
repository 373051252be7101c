"""kNN-Per: the datastore, the kNN distribution, the mixture, and FedAvg training."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from flowjax import config as run_config
from flowjax import experiment
from flowjax.algorithms.base import SGDConfig
from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
from flowjax.algorithms.knn_per import (Datastore, KnnPerConfig, build_datastore,
                                        embed_and_logits, knn_log_probs, knn_per,
                                        mix_log_probs)
from flowjax.core.cohort import assemble_cohort, client_at
from flowjax.models import get_model
from flowjax.models.base import forward
from tests.helpers import small_config

SGD = dict(learning_rate=0.05, epochs=1, batch_size=4)
CONFIG = dict(sgd=SGDConfig(**SGD))
KNN = dict(CONFIG, neighbours=3, lam=0.45)  # the paper's Shakespeare values



@pytest.fixture(scope="module")
def lstm():
    return get_model("shakespeare_lstm", hidden=16)


def _client(data, index, padded_examples, split="train", batch_size=4):
    cohort = assemble_cohort(data, split, [index], num_clients=1,
                             padded_examples=padded_examples, batch_size=batch_size)
    return client_at(jax.tree.map(jnp.asarray, cohort), 0)


def test_embedding_pass_returns_the_forward_logits(cnn, lstm, images_small, shakespeare_small):
    for model, data in ((cnn, images_small), (lstm, shakespeare_small)):
        params = model.init(jax.random.key(0))
        x = _client(data.train, 0, padded_examples=4).x[0]
        phi, logits = embed_and_logits(model, params, x)
        np.testing.assert_array_equal(logits, forward(model, params, x))
        assert phi.shape[:-1] == logits.shape[:-1]


def test_training_is_fedavg(cnn, images_small):
    algorithm = knn_per(cnn, KnnPerConfig(**KNN))
    reference = fedavg(cnn, FedAvgConfig(**CONFIG))
    params = algorithm.init(jax.random.key(0))
    client = _client(images_small.train, 1, padded_examples=16)
    a = algorithm.client_update(params, client, jax.random.key(1))
    b = reference.client_update(params, client, jax.random.key(1))
    for x, y in zip(jax.tree.leaves((a.params, a.weight)), jax.tree.leaves((b.params, b.weight))):
        np.testing.assert_array_equal(x, y)


def test_datastore_holds_embeddings_and_true_labels_of_the_valid_examples(cnn, images_small):
    params = cnn.init(jax.random.key(0))
    client = _client(images_small.train, 2, padded_examples=40)
    n = int(client.num_examples)
    store = build_datastore(cnn, params, client, jax.random.key(0), max_size=64)
    assert int(store.valid.sum()) == n
    # The capacity is max_size whatever the client's padding, and more padding changes
    # nothing in the store (the distance matmul's shape never follows padding).
    more_padding = _client(images_small.train, 2, padded_examples=56)
    again = build_datastore(cnn, params, more_padding, jax.random.key(0), max_size=64)
    assert store.keys.shape[0] == again.keys.shape[0] == 64
    for a, b in zip(jax.tree.leaves(store), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)
    x, y, _ = client.flat()
    phi, _ = embed_and_logits(cnn, params, x)
    np.testing.assert_allclose(store.keys[:n], phi[:n], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(store.labels[:n], y[:n])


def test_capped_datastore_keeps_a_seeded_random_subset(cnn, images_small):
    params = cnn.init(jax.random.key(0))
    client = _client(images_small.train, 2, padded_examples=40)
    n = int(client.num_examples)
    cap = n // 2
    x, y, _ = client.flat()
    phi = np.asarray(embed_and_logits(cnn, params, x)[0][:n])

    def kept_rows(key):
        store = build_datastore(cnn, params, client, jax.random.key(key), max_size=cap)
        assert store.keys.shape[0] == cap and bool(store.valid.all())
        distance = np.linalg.norm(np.asarray(store.keys)[:, None] - phi[None], axis=-1)
        rows = distance.argmin(axis=1)
        assert distance.min(axis=1).max() < 1e-4
        np.testing.assert_array_equal(store.labels, np.asarray(y)[rows])
        return rows

    first = kept_rows(0)
    assert len(set(first.tolist())) == cap and np.all(np.diff(first) > 0)  # split order
    assert not np.array_equal(first, kept_rows(1))


def test_lstm_datastore_holds_every_non_pad_position(lstm, shakespeare_small):
    params = lstm.init(jax.random.key(0))
    client = _client(shakespeare_small.train, 0, padded_examples=8)
    store = build_datastore(lstm, params, client, jax.random.key(0), max_size=4096)
    _, y, mask = client.flat()
    positions = np.asarray(y)[np.asarray(mask)]
    non_pad = positions[positions != 0]
    assert int(store.valid.sum()) == non_pad.size
    np.testing.assert_array_equal(store.labels[: non_pad.size], non_pad)


def test_knn_distribution_is_the_normalized_exp_minus_distance_vote():
    keys = jnp.array([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [9.0, 9.0]])
    store = Datastore(keys=keys, labels=jnp.array([1, 2, 1, 0, 2]),
                      valid=jnp.array([True, True, True, True, False]))
    query = jnp.array([[0.0, 0.5]])
    log_p, has = knn_log_probs(store, query, neighbours=3, num_classes=3)
    d = np.linalg.norm(np.asarray(keys[:3]) - np.asarray(query), axis=-1)  # the 3 nearest
    votes = np.exp(-d)
    expected = np.array([0.0, votes[0] + votes[2], votes[1]]) / votes.sum()
    np.testing.assert_allclose(np.exp(log_p[0]), expected, rtol=1e-5)
    assert bool(has[0])
    # The invalid entry (label 2, far away) never counts, even when k exceeds the valid count.
    log_p, _ = knn_log_probs(store, jnp.array([[9.0, 9.0]]), neighbours=5, num_classes=3)
    d = np.linalg.norm(np.asarray(keys[:4]) - np.array([9.0, 9.0]), axis=-1)
    votes = np.exp(-(d - d.min()))
    expected = np.array([votes[3], votes[0] + votes[2], votes[1]]) / votes.sum()
    np.testing.assert_allclose(np.exp(log_p[0]), expected, rtol=1e-5)


def test_lam_zero_is_the_global_model_exactly(cnn, images_small):
    algorithm = knn_per(cnn, KnnPerConfig(**dict(KNN, lam=0.0)))
    params = algorithm.init(jax.random.key(0))
    store = algorithm.personalize(params, _client(images_small.train, 3, 32), jax.random.key(1))
    x = _client(images_small.train, 3, 8, split="test").x[0]
    predictions = jax.jit(algorithm.predict)(params, store, x)
    np.testing.assert_array_equal(predictions.global_logits, forward(cnn, params, x))
    np.testing.assert_array_equal(predictions.personal_hard,
                                  jax.nn.log_softmax(predictions.global_logits))
    np.testing.assert_array_equal(jnp.argmax(predictions.personal_hard, -1),
                                  jnp.argmax(predictions.global_logits, -1))


def test_prediction_mixes_a_hand_computed_k_nearest_vote_with_the_global_softmax(
        cnn, images_small):
    """The paper's kNN-Per prediction, lam p_kNN + (1 - lam) softmax(w(x)), with p_kNN the
    exp(-distance) vote of the k = 3 nearest stored embeddings, computed in numpy."""
    lam, k = 0.45, 3
    algorithm = knn_per(cnn, KnnPerConfig(**dict(KNN, lam=lam, neighbours=k)))
    params = algorithm.init(jax.random.key(0))
    store = algorithm.personalize(params, _client(images_small.train, 3, 32), jax.random.key(1))
    x = _client(images_small.train, 3, 8, split="test").x[0]
    predictions = jax.jit(algorithm.predict)(params, store, x)
    phi, logits = (np.asarray(a, np.float64) for a in embed_and_logits(cnn, params, x))
    keys = np.asarray(store.keys, np.float64)[np.asarray(store.valid)]
    labels = np.asarray(store.labels)[np.asarray(store.valid)]
    assert len(labels) > k
    expected = []
    for query, row in zip(phi, logits):
        distance = np.linalg.norm(keys - query, axis=-1)
        nearest = np.argsort(distance)[:k]
        votes = np.exp(-(distance[nearest] - distance[nearest].min()))
        p_knn = np.bincount(labels[nearest], votes, minlength=10) / votes.sum()
        softmax = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
        expected.append(np.log(lam * p_knn + (1 - lam) * softmax))
    np.testing.assert_allclose(np.exp(predictions.personal_hard), np.exp(expected), atol=2e-6)
    np.testing.assert_array_equal(predictions.global_logits, forward(cnn, params, x))


def test_lam_one_k_one_predicts_the_true_label_of_a_duplicated_train_example(cnn, images_small):
    algorithm = knn_per(cnn, KnnPerConfig(**dict(KNN, lam=1.0, neighbours=1)))
    params = algorithm.init(jax.random.key(0))
    client = _client(images_small.train, 4, padded_examples=16)
    # Labels no model would predict: a fixed permutation of the true ones.
    relabelled = client.replace(y=(client.y * 7 + 3) % 10)
    store = algorithm.personalize(params, relabelled, jax.random.key(1))
    x = client.x[1]  # test examples duplicating train examples 4..7
    predicted = jnp.argmax(algorithm.predict(params, store, x).personal_hard, axis=-1)
    np.testing.assert_array_equal(predicted, relabelled.y[1])


def test_client_without_train_data_falls_back_to_the_global_model(cnn, images_small):
    algorithm = knn_per(cnn, KnnPerConfig(**dict(KNN, lam=0.5)))
    params = algorithm.init(jax.random.key(0))
    client = _client(images_small.train, 0, padded_examples=8)
    empty = client.replace(mask=jnp.zeros_like(client.mask), num_examples=jnp.int32(0))
    store = algorithm.personalize(params, empty, jax.random.key(1))
    assert not bool(store.valid.any())
    predictions = algorithm.predict(params, store, client.x[0])
    np.testing.assert_array_equal(predictions.personal_hard,
                                  jax.nn.log_softmax(predictions.global_logits))


def test_bad_config_values_name_the_field():
    with pytest.raises(ValueError, match=r"^lam=1.5: expected a number in \[0, 1\]$"):
        KnnPerConfig(**dict(KNN, lam=1.5))
    with pytest.raises(ValueError, match=r"^neighbours=0: expected an integer >= 1$"):
        KnnPerConfig(**dict(KNN, neighbours=0))
    with pytest.raises(ValueError,
                       match=r"^max_datastore=2: expected an integer >= neighbours \(3\)$"):
        KnnPerConfig(**dict(KNN, max_datastore=2))


def test_knn_per_run_trains_and_evaluates():
    config = small_config(algorithm="knn_per", num_rounds=2)
    config.model_options = ml_collections.ConfigDict({"hidden": 32})
    result = experiment.run(run_config.build_simulation(config))
    train = [h for h in result.history if h["kind"] == "train"]
    assert len(train) == 2 and all(np.isfinite(h["loss"]) for h in train)
    summary = result.summaries["train_clients"]
    assert 0 < summary.acc_g < 1 and 0 < summary.acc_p < 1
    assert summary.acc_p != summary.acc_g  # the kNN term changes predictions


def test_mixture_is_lam_knn_plus_rest_global_softmax():
    log_knn = jnp.log(jnp.array([[0.0, 0.25, 0.75], [1.0, 0.0, 0.0]]))
    logits = jnp.array([[2.0, -1.0, 0.5], [0.0, 3.0, -2.0]])
    mixed = mix_log_probs(log_knn, logits, 0.45)
    expected = 0.45 * np.exp(np.asarray(log_knn)) + 0.55 * np.asarray(jax.nn.softmax(logits))
    np.testing.assert_allclose(np.exp(mixed), expected, rtol=1e-6)
    np.testing.assert_array_equal(mix_log_probs(log_knn, logits, 1.0), log_knn)


def _their_scores(model, scored, train, x, neighbours, lam):
    """The authors' kNN-Per scores in numpy, from their code's recipe (client_knnper.py,
    emnist_generalized_test): every valid train example's fc1 input and ``scored``'s
    predicted label; per query ``(1 - lam) logits + lam sum exp(-d) onehot`` over the k
    nearest by ``|q - key|``."""
    layer = model.layer_names.index("fc1")
    # Batch by batch as the datastore is built: a duplicate's distance is then exactly 0
    # (near 0 the square root turns a rounding difference of 1e-12 into 1e-6).
    per_batch = [embed_and_logits(model, scored, x, layer) for x in train.x]
    mask = np.asarray(train.mask).reshape(-1)
    keys = np.concatenate([np.asarray(phi, np.float64) for phi, _ in per_batch])[mask]
    labels = np.concatenate([np.asarray(logits) for _, logits in per_batch]).argmax(-1)[mask]
    queries, logits = (np.asarray(a, np.float64) for a in embed_and_logits(
        model, scored, x, layer))
    scores = []
    for query, row in zip(queries, logits):
        distance = np.linalg.norm(keys - query, axis=-1)
        nearest = np.argsort(distance)[:neighbours]
        votes = np.bincount(labels[nearest], np.exp(-distance[nearest]), minlength=row.size)
        scores.append((1 - lam) * row + lam * votes)
    return np.asarray(scores), labels


def test_reference_acc_p_is_the_authors_raw_logit_vote_of_predicted_labels(cnn, images_small):
    """``reference_acc_p``: their datastore (fc1's input, the model's predicted labels) and
    scores, recomputed in numpy; on test examples that duplicate train examples, so the
    votes are large. The method's own predictions are those without the option."""
    lam, k = 0.4, 3
    config = dict(KNN, lam=lam, neighbours=k)
    algorithm = knn_per(cnn, KnnPerConfig(**config, reference_acc_p=True))
    plain = knn_per(cnn, KnnPerConfig(**config))
    params = algorithm.init(jax.random.key(0))
    train = _client(images_small.train, 4, padded_examples=16)
    x = train.x[1]
    personal = jax.jit(algorithm.personalize)(params, train, jax.random.key(1))
    predictions = jax.jit(algorithm.predict)(params, personal, x)
    expected, labels = _their_scores(cnn, params, train, x, k, lam)
    np.testing.assert_allclose(predictions.personal_snapshot, expected, atol=2e-6)
    store = personal["reference_store"]
    np.testing.assert_array_equal(np.asarray(store.labels)[np.asarray(store.valid)], labels)
    votes = np.asarray(predictions.personal_snapshot) - (1 - lam) * np.asarray(
        predictions.global_logits)
    assert votes.max() > 0.3  # a duplicate's exp(-0) = 1, weighed by lam
    without = jax.jit(plain.predict)(
        params, jax.jit(plain.personalize)(params, train, jax.random.key(1)), x)
    np.testing.assert_array_equal(predictions.personal_hard, without.personal_hard)
    np.testing.assert_array_equal(predictions.global_logits, without.global_logits)
    # The model their EMNIST evaluation scores as Acc_g is the server model.
    np.testing.assert_array_equal(predictions.global_snapshot, predictions.global_logits)


def test_reference_acc_p_scores_the_copy_when_client_snapshot_is_on(cnn, images_small):
    """With ``client_snapshot`` (their CIFAR evaluation) the datastore and the scores come
    from the one-epoch copy; at lam = 0 the scores are that copy's logits exactly."""
    train = _client(images_small.train, 4, padded_examples=16)
    x = train.x[1]
    for lam in (0.0, 0.5):
        algorithm = knn_per(cnn, KnnPerConfig(**dict(KNN, lam=lam), client_snapshot=True,
                                              reference_acc_p=True))
        params = algorithm.init(jax.random.key(0))
        personal = jax.jit(algorithm.personalize)(params, train, jax.random.key(1))
        predictions = jax.jit(algorithm.predict)(params, personal, x)
        if lam == 0.0:
            np.testing.assert_array_equal(predictions.personal_snapshot,
                                          predictions.global_snapshot)
            continue
        expected, _ = _their_scores(cnn, personal["snapshot"], train, x, 3, lam)
        np.testing.assert_allclose(predictions.personal_snapshot, expected, atol=2e-6)
        server, _ = _their_scores(cnn, params, train, x, 3, lam)
        assert np.max(np.abs(server - expected)) > 1e-3  # not the server model's


def test_reference_acc_p_votes_with_the_entries_a_small_store_has(cnn, images_small):
    """Fewer train examples than k: their topk would raise; here the entries present
    vote and absent ones add nothing; none at all leaves (1 - lam) logits."""
    algorithm = knn_per(cnn, KnnPerConfig(**dict(KNN, neighbours=10, lam=0.5),
                                          reference_acc_p=True))
    params = algorithm.init(jax.random.key(0))
    client = _client(images_small.train, 0, padded_examples=8)
    few = client.replace(mask=client.mask.at[1:].set(False).at[0, 3:].set(False),
                         num_examples=jnp.int32(3))
    x = client.x[0]
    predictions = algorithm.predict(params, algorithm.personalize(params, few, jax.random.key(1)),
                                    x)
    expected, _ = _their_scores(cnn, params, few, x, 10, 0.5)
    np.testing.assert_allclose(predictions.personal_snapshot, expected, atol=2e-6)
    empty = client.replace(mask=jnp.zeros_like(client.mask), num_examples=jnp.int32(0))
    predictions = algorithm.predict(params, algorithm.personalize(params, empty,
                                                                  jax.random.key(1)), x)
    np.testing.assert_array_equal(predictions.personal_snapshot,
                                  0.5 * predictions.global_logits)


def test_reference_acc_p_is_refused_for_models_their_evaluation_does_not_cover(lstm):
    with pytest.raises(ValueError, match=r"^expected a model of \['emnist_cnn', "
                                         r"'resnet18_gn'\]: .* not shakespeare_lstm$"):
        knn_per(lstm, KnnPerConfig(**KNN, reference_acc_p=True))


def test_reference_acc_p_run_reports_it_beside_an_unchanged_acc_p():
    """Through ``experiment.run``: ``acc_p_client_snapshot`` is their Acc_p; Acc_g, Acc_p
    and training are as without the option."""
    from tests.bad_input_cases import base_config, images

    def result(**fields):
        config = base_config({"model": "emnist_cnn", "algorithm": "knn_per", "num_rounds": 1,
                              "methods.knn_per.max_datastore": 16, **fields})
        data = images(sizes=(6, 9, 12), test_sizes=(3, 4, 5))
        return experiment.run(run_config.simulation_for(run_config.resolve(config, data)))

    on = result(**{"methods.knn_per.reference_acc_p": True})
    off = result()
    assert on.history[0]["loss"] == off.history[0]["loss"]
    a, b = on.summaries["train_clients"], off.summaries["train_clients"]
    assert (a.acc_g, a.acc_p, a.clients_benefiting) == (b.acc_g, b.acc_p, b.clients_benefiting)
    assert b.acc_p_client_snapshot is None and b.acc_g_client_snapshot is None
    assert 0.0 <= a.acc_p_client_snapshot <= 1.0
    # Their Acc_g model is the server model: its snapshot is Acc_g, and their harmed flag
    # counts their Acc_p against it.
    assert (a.acc_g_client_snapshot, a.acc_g_client_snapshot_weighted) == (a.acc_g,
                                                                           a.acc_g_weighted)
    assert a.clients_benefiting_snapshot is not None


def test_knn_votes_launcher_measures_the_votes_of_a_run():
    """``launch/knn_votes.py``'s measurement of a small CNN run with their CIFAR scoring
    (the copy): per test example the nearest entry's distance and the largest vote, which
    lies between lam exp(-d) (the nearest entry's class) and lam k exp(-d); a changed
    prediction needs a vote; and from the run's own model, copy and keys their scores'
    accuracy is the run's acc_p_client_snapshot (another copy's reads 26.4, not 34.7)."""
    from flowjax.data.synthetic import synthetic_images
    from launch import knn_votes
    from tests.bad_input_cases import base_config

    config = base_config({"model": "emnist_cnn", "algorithm": "knn_per", "num_rounds": 2,
                          "model_options": {"num_classes": 10}, "sgd.learning_rate": 0.05,
                          "sgd.batch_size": 4, "methods.knn_per.reference_acc_p": True,
                          "methods.knn_per.client_snapshot": True,
                          "methods.knn_per.max_datastore": 32})
    data = synthetic_images(num_clients=6, num_classes=10, examples=(6, 30), seed=1,
                            held_out=0)
    run = run_config.resolve(config, data)
    simulation = run_config.simulation_for(run)
    result = experiment.run(simulation)
    votes = knn_votes.client_votes(simulation, run.method, result.final_state.params)
    lam, k = run.method.lam, run.method.neighbours
    nearest = lam * np.exp(-votes["distance"].astype(np.float64))
    assert np.all(votes["vote"] >= nearest * (1 - 1e-5))
    assert np.all(votes["vote"] <= k * nearest * (1 + 1e-5))
    assert not np.any(votes["changed"] & (votes["vote"] == 0))
    assert votes["changed"].any()  # votes here are large enough to move predictions
    accuracy = [votes["correct"][votes["client"] == c].mean()
                for c in np.unique(votes["client"])]
    summary = result.summaries["train_clients"]
    assert 0 < summary.acc_p_client_snapshot != summary.acc_g_client_snapshot
    assert np.mean(accuracy) == pytest.approx(summary.acc_p_client_snapshot, abs=1e-12)


def test_their_text_knn_launcher_tells_a_class_constant_vote_from_a_diagonal_one():
    """``launch/their_text_knn.py``'s reading of their scores: a vote the same for every
    class of a position (their Shakespeare indexing) changes no prediction; one on class
    t at position t (their Stack Overflow indexing) is found on the diagonal only."""
    from launch.their_text_knn import describe

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 30, 20))  # [sequences, classes, positions]
    labels = np.ones((2, 20), np.int64)
    everywhere = np.zeros_like(logits)
    everywhere[:, :, [3, 7]] = 0.8  # every class of positions 3 and 7
    diagonal = np.zeros_like(logits)
    diagonal[:, [3, 7], [3, 7]] = 5.0  # class 3 at position 3, class 7 at position 7
    found = [describe("case", dict(logits=logits, scores=0.5 * logits + vote, lam=0.5,
                                   labels=labels)) for vote in (everywhere, diagonal)]
    assert found[0]["changed"] == 0 and found[0]["spread"] < 1e-12
    assert found[0]["classes"] == list(range(30)) and not found[0]["on_diagonal"]
    assert found[1]["on_diagonal"] and found[1]["classes"] == [3, 7]
    assert found[1]["changed"] == 4 and found[1]["spread"] == pytest.approx(5.0)


@pytest.mark.parametrize("name, shape, dim", [("emnist_cnn", (3, 28, 28), 9216),
                                              ("resnet18_gn", (2, 32, 32, 3), 512)])
def test_reference_key_is_the_input_of_their_first_linear_layer(name, shape, dim):
    """Their memoization networks' embedding is what their first linear layer takes (the
    EMNIST CNN's flattened pooled convolutions, the ResNet's pooled features): the rest of
    the model applied to the key gives the logits exactly."""
    from flowjax.algorithms.knn_per import reference_key_layer
    from flowjax.models.base import layer_key

    model = get_model(name, num_classes=10)
    params = model.init(jax.random.key(0))
    x = jax.random.uniform(jax.random.key(1), shape)
    first = reference_key_layer(model)
    phi, logits = embed_and_logits(model, params, x, first)
    assert phi.shape == (shape[0], dim)
    h = phi
    for j in range(first, model.num_layers):
        h = model.layer_apply(j, params[model.layer_names[j]], h)
        h = model.glue_apply(j, h, False, layer_key(jax.random.key(0), j))
    np.testing.assert_array_equal(h, logits)
    np.testing.assert_array_equal(logits, forward(model, params, x))
