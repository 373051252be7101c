"""Local training: every client learns alone, with no communication (the "Local"
baseline of the Flow paper, Appendix B: EMNIST 10 epochs at lr 0.05, CIFAR 20 at 0.1).

Rule: client m's model is E epochs of minibatch SGD at the local learning rate on its
own train split, starting from the server's initial params ``w_0``.

How it runs on the engine:

* ``client_update`` trains nothing and returns the received params with weight 0, so
  every round's total weight is 0 and the engine leaves the server params (and the
  server optimizer state) exactly as initialised: the server holds ``w_0`` forever.
* ``personalize`` trains the client's local model from ``w_0`` (E epochs, seeded by the
  evaluation key); that is the personalized model.
* Global model (Acc_g): ``w_0``, the untrained initial model, since no global model is
  ever learned; Acc_g is thus a chance-level reference, not a trained baseline.

Choice where the paper is silent: every client starts from the same ``w_0`` (the run's
seeded init) rather than its own random init, so "from scratch" differs only in data.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from flowjax.algorithms.base import (ClientResult, FederatedAlgorithm, SGDConfig,
                                     separate_models_predict, train_plain, valid_examples)
from flowjax.core.cohort import ClientExamples
from flowjax.models.base import Params, RoutableModel


@dataclasses.dataclass(frozen=True)
class LocalConfig:
    """Local training's hyperparameters.

    Attributes:
      sgd: the local SGD (the paper gives Local its own epochs and rate:
        ``config.methods.local.sgd``).
    """

    sgd: SGDConfig


def local(model: RoutableModel, config: LocalConfig) -> FederatedAlgorithm:
    """Local training of ``model`` on each client alone."""
    optimizer = config.sgd.optimizer()

    def client_update(params, examples: ClientExamples, key, client_state=None) -> ClientResult:
        del examples, key, client_state  # no communication: nothing reaches the server
        return ClientResult(params=params, weight=jnp.zeros((), jnp.float32), metrics={})

    def personalize(params, examples: ClientExamples, key, client_state=None) -> Params:
        del client_state  # stateless
        return train_plain(model, params, optimizer, examples, valid_examples(examples),
                           epochs=config.sgd.epochs, batch_size=config.sgd.batch_size, key=key,
                           **config.sgd.loop)[0]

    return FederatedAlgorithm(name="local", model=model, init=model.init,
                              client_update=client_update, personalize=personalize,
                              predict=separate_models_predict(model))
