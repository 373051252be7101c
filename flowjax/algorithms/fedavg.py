"""FedAvg (McMahan et al. 2017) and FedAvgFT: E local epochs of SGD from the global model.

FedAvgFT trains exactly like FedAvg; at evaluation it fine-tunes the global model for E
epochs on the client's train split (the paper's pc-Flow ablation is the same method).

Its ``Acc_g`` is the server's model (the paper's Eq. 11). The paper's FedAvgFT ``Acc_g``
figures score a client-side copy instead: the fine-tuned model after the first of the E
epochs (the authors' ``*_generalized_test``). ``client_snapshot=True`` scores that copy
too, as ``acc_g_client_snapshot`` beside ``acc_g``, from the same fine-tuning run.
"""

from __future__ import annotations

import dataclasses


from flowjax.algorithms.base import (ClientResult, FederatedAlgorithm, Predictions, SGDConfig,
                                     separate_models_predict, train_plain,
                                     train_part_with_snapshot, unrouted_predictions,
                                     valid_examples)
from flowjax.core.checks import FieldError, check_fields, one_of
from flowjax.core.cohort import ClientExamples
from flowjax.models.base import RoutableModel, forward


@dataclasses.dataclass(frozen=True)
class FedAvgConfig:
    """Client-side hyperparameters.

    Attributes:
      sgd: the clients' SGD (its epochs are also FedAvgFT's fine-tuning epochs).
      finetune: evaluate a fine-tuned copy per client (FedAvgFT).
      client_snapshot: FedAvgFT only: also score the fine-tuned copy after the first of
        the E epochs (the paper's baseline Acc_g; None = off).
    """

    sgd: SGDConfig
    finetune: bool = False
    client_snapshot: bool | None = None

    def __post_init__(self):
        check_fields(self, {"finetune": one_of((False, True)),
                            "client_snapshot": one_of((None, False, True))})
        if self.client_snapshot and not self.finetune:
            raise FieldError("client_snapshot", self.client_snapshot,
                             "expected None or False: only FedAvgFT (finetune=True) has a "
                             "fine-tuned copy to snapshot")


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
        if config.client_snapshot:
            fine_tuned, snapshot = train_part_with_snapshot(
                model, params, {}, optimizer, examples, valid_examples(examples),
                epochs=config.sgd.epochs, batch_size=config.sgd.batch_size, key=key,
                **config.sgd.loop)
            return {"personal": fine_tuned, "snapshot": snapshot}
        return local_train(params, examples, key)[0]

    def global_only_predict(params, personal, x) -> Predictions:
        del personal  # FedAvg's is the server's model
        global_logits = forward(model, params, x)
        return unrouted_predictions(global_logits, global_logits)

    return FederatedAlgorithm(name="fedavg_ft" if config.finetune else "fedavg", model=model,
                              init=model.init, client_update=client_update,
                              personalize=personalize,
                              predict=(separate_models_predict(model, config.client_snapshot)
                                       if config.finetune else global_only_predict))
