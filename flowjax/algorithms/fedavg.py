"""FedAvg (McMahan et al. 2017) and FedAvgFT: E local epochs of SGD from the global model.

FedAvgFT trains exactly like FedAvg; at evaluation it fine-tunes the global model for E
epochs on the client's train split (the paper's pc-Flow ablation is the same method).

Its ``Acc_g`` is the server's model (the paper's Eq. 11). The paper's FedAvgFT ``Acc_g``
figures score a client-side copy instead: the fine-tuned model after the first of the E
epochs (the authors' ``*_generalized_test``). ``client_snapshot=True`` scores that copy
too, as ``acc_g_client_snapshot`` beside ``acc_g``, from the same fine-tuning run.

FedAvg's own ``client_snapshot=True`` scores what the authors' CIFAR evaluation reports
as FedAvg's (and kNN-Per's) ``Acc_g``: the server model trained one epoch on the client's
train split (``client_fedavg.py``, ``client_knnper.py``: ``cifar*_generalized_test``,
``range(1)``; on the other datasets they score the server model, ``acc_g`` itself). It is
the first epoch of FedAvgFT's fine-tuning, the same batches from the same key. Their
CIFAR-10 FedAvg scores it on the train split, not the test split:
``snapshot_split="train"``. FedAvg's ``Acc_p`` stays the server model.
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
      client_snapshot: also score the client-side copy of the authors' evaluation
        (the paper's baseline Acc_g; None = off): FedAvgFT's fine-tuned copy after the
        first of the E epochs; FedAvg's server model trained one epoch.
      snapshot_split: FedAvg with ``client_snapshot``: the split that copy is scored on,
        ``"test"`` (None) or ``"train"`` (their CIFAR-10 FedAvg).
    """

    sgd: SGDConfig
    finetune: bool = False
    client_snapshot: bool | None = None
    snapshot_split: str | None = None

    def __post_init__(self):
        check_fields(self, {"finetune": one_of((False, True)),
                            "client_snapshot": one_of((None, False, True)),
                            "snapshot_split": one_of((None, "test", "train"))})
        if self.snapshot_split == "train" and (self.finetune or not self.client_snapshot):
            raise FieldError("snapshot_split", self.snapshot_split,
                             "expected None or 'test': only FedAvg's client_snapshot (the "
                             "authors' CIFAR-10 FedAvg) is scored on the train split")


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
            if config.client_snapshot:  # one epoch: FedAvgFT's first, from the same key
                snapshot = train_plain(model, params, optimizer, examples,
                                       valid_examples(examples), epochs=1,
                                       batch_size=config.sgd.batch_size, key=key,
                                       **config.sgd.loop)[0]
                return {"personal": params, "snapshot": snapshot}
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
                                       if config.finetune or config.client_snapshot
                                       else global_only_predict),
                              snapshot_split=config.snapshot_split or "test")
