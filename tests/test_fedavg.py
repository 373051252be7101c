"""FedAvg and FedAvgFT: the personalized model is the server's, or that model fine-tuned."""

import jax
import jax.numpy as jnp
import numpy as np

from flowjax.algorithms.base import SGDConfig, plain_loss_sums
from flowjax.algorithms.fedavg import FedAvgConfig, fedavg
from flowjax.core.cohort import assemble_cohort, client_at
from flowjax.core.losses import mean_from_sums
from flowjax.models.base import forward
from tests.helpers import assert_trees_equal


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
