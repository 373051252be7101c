"""The algorithm protocol: what the engine runs, the one seam between it and the methods.

An algorithm is a frozen dataclass of pure functions (``FederatedAlgorithm``; the
methods, their shared building blocks and the contract of each function are in
``flowjax.algorithms.base``). It lives here, with the engine that calls it, so that the
engine and the evaluation import no method: importing ``flowjax.algorithms`` loads every
method's module for its registry.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct
import jax

from flowjax.core.cohort import ClientExamples
from flowjax.models.base import RoutableModel

PyTree = Any


@flax.struct.dataclass
class ClientResult:
    """What one client sends back.

    Attributes:
      params: the pytree the server averages (same structure as the server params).
      weight: aggregation weight (examples the update was trained on), or a dict of
        weights per top-level params key.
      metrics: sums over the client's steps, e.g. ``loss_sum`` and ``loss_count``;
        the engine sums them over clients and divides ``*_sum`` by ``*_count``.
      client_state: the client's new state (stateful methods), else None.
    """

    params: PyTree
    weight: Any
    metrics: dict[str, jax.Array]
    client_state: PyTree = None


@flax.struct.dataclass
class Predictions:
    """Logits of one batch for the evaluation.

    Attributes:
      global_logits: the server's global model.
      personal_hard: the personalized model (hard routing where routing applies).
      personal_soft: the personalized model with soft routing (= hard without routing).
      q0: per-instance, per-layer probability of the global branch, ``[*instance, L]``;
        zeros with ``L = 0`` for methods without routing.
      global_snapshot: logits of a client-side copy of the global model, where a method's
        evaluation defines one (Flow's reference evaluation: the global branch after the
        client's first routing epoch; FedAvgFT's ``client_snapshot``: the model after its
        first fine-tuning epoch; FedAvg's and kNN-Per's: the server model trained one
        epoch, scored on ``FederatedAlgorithm.snapshot_split``; APFL's and Ditto's: the
        global model after E epochs of local training; FedRep's, LG-FedAvg's and
        HypCluster's: after one epoch of their evaluation's fine-tuning); None elsewhere.
        Reported beside, never instead of, the server model's ``global_logits``.
      personal_snapshot: logits of the personalized model a method's evaluation of the
        authors defines where it is not ``personal_hard`` (HypCluster's
        ``client_snapshot``: the cluster fine-tuned E epochs); None elsewhere. Reported
        beside, never instead of, ``personal_hard``.
    """

    global_logits: jax.Array
    personal_hard: jax.Array
    personal_soft: jax.Array
    q0: jax.Array
    global_snapshot: jax.Array | None = None
    personal_snapshot: jax.Array | None = None


def same_for_every_batch(personal: PyTree, index: jax.Array) -> PyTree:
    """``FederatedAlgorithm.for_test_batch`` of a method whose prediction draws no
    randomness: every test batch is predicted with ``personal`` itself."""
    del index
    return personal


@dataclasses.dataclass(frozen=True)
class FederatedAlgorithm:
    """A federated method as pure functions (see the module docstring)."""

    name: str
    model: RoutableModel
    init: Callable[[jax.Array], PyTree]
    client_update: Callable[[PyTree, ClientExamples, jax.Array, PyTree], ClientResult]
    personalize: Callable[[PyTree, ClientExamples, jax.Array, PyTree], PyTree]
    predict: Callable[[PyTree, PyTree, jax.Array], Predictions]
    init_client_state: Callable[[PyTree], PyTree] | None = None
    # Methods whose prediction draws randomness: each test batch's own personal state.
    for_test_batch: Callable[[PyTree, jax.Array], PyTree] = same_for_every_batch
    # The split ``Predictions.global_snapshot`` is scored on: "test", or "train" where the
    # authors' evaluation scores its copy on the client's train split (their CIFAR-10
    # FedAvg: ``flowjax.algorithms.fedavg``).
    snapshot_split: str = "test"

    def __post_init__(self):
        if self.snapshot_split not in ("test", "train"):
            raise ValueError(f"snapshot_split={self.snapshot_split!r}: expected 'test' or "
                             "'train'")

    @property
    def stateful(self) -> bool:
        return self.init_client_state is not None
