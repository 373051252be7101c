"""FedAvg (McMahan et al. 2017) and FedAvgFT: E local epochs of SGD from the global model.

FedAvgFT trains exactly like FedAvg; at evaluation it fine-tunes the global model for E
epochs on the client's train split (the paper's pc-Flow ablation is the same method).
"""

from __future__ import annotations

import dataclasses


from flowjax.algorithms.base import (ClientResult, FederatedAlgorithm, Predictions, SGDConfig,
                                     unrouted_predictions, train_plain, valid_examples)
from flowjax.core.checks import check_fields, one_of
from flowjax.core.cohort import ClientExamples
from flowjax.models.base import RoutableModel, forward


@dataclasses.dataclass(frozen=True)
class FedAvgConfig:
    """Client-side hyperparameters.

    Attributes:
      sgd: the clients' SGD (its epochs are also FedAvgFT's fine-tuning epochs).
      finetune: evaluate a fine-tuned copy per client (FedAvgFT).
    """

    sgd: SGDConfig
    finetune: bool = False

    def __post_init__(self):
        check_fields(self, {"finetune": one_of((False, True))})


def fedavg(model: RoutableModel, config: FedAvgConfig) -> FederatedAlgorithm:
    """FedAvg (``config.finetune=False``) or FedAvgFT (``True``) for ``model``."""
    optimizer = config.sgd.optimizer()

    def local_train(params, examples: ClientExamples, key):
        return train_plain(model, params, optimizer, examples, valid_examples(examples),
                           epochs=config.sgd.epochs, batch_size=config.sgd.batch_size, key=key,
                           **config.sgd.loop)

    def client_update(params, examples: ClientExamples, key, client_state=None) -> ClientResult:
        del client_state  # stateless
        trained, sums = local_train(params, examples, key)
        return ClientResult(params=trained, weight=examples.num_examples.astype("float32"),
                            metrics={"loss_sum": sums[0], "loss_count": sums[1]})

    def personalize(params, examples: ClientExamples, key, client_state=None):
        del client_state  # stateless
        if not config.finetune:
            return params
        return local_train(params, examples, key)[0]

    def predict(params, personal, x) -> Predictions:
        global_logits = forward(model, params, x)
        personal_logits = forward(model, personal, x) if config.finetune else global_logits
        return unrouted_predictions(global_logits, personal_logits)

    return FederatedAlgorithm(name="fedavg_ft" if config.finetune else "fedavg", model=model,
                              init=model.init, client_update=client_update,
                              personalize=personalize, predict=predict)
