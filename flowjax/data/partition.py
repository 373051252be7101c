"""Label-skewed partitions of a centralized classification dataset into clients.

The two standard partitions of personalized FL benchmarks, shared by every dataset that
starts from one pool of labelled examples (CIFAR, the MNIST family):

* ``dirichlet``: each client draws a class distribution ``p ~ Dir(alpha)`` (Hsu et al.
  2019; the paper's CIFAR 0.1 / 0.6 splits). Smaller ``alpha`` means more skewed clients.
* ``shards``: the train pool is sorted by label and cut into ``num_clients x
  shards_per_client`` equal shards, each client getting ``shards_per_client`` of them at
  random (McMahan et al. 2017's pathological non-IID split), so a client sees few
  classes: ``shards_per_client`` when no shard straddles two labels, and one more for
  each of its shards that does (a class whose count is not a multiple of the shard size
  ends inside a shard).

Every client's test examples are drawn from the same class distribution as its train
examples (Dirichlet: its ``p``; shards: its train label histogram), without replacement
from the test pool, so a client's test data looks like its train data, as long as the
pool has its classes left. Where the clients take (nearly) the whole pool (the paper's
CIFAR and Fashion-MNIST: 500 clients x 20 = all 10,000 test examples), the classes run
out client by client and the last clients' draws are renormalized over the classes still
there (``dirichlet_partition``), so their test data can differ from their train data; the
authors' CIFAR loader (``dataloaders/cifar10/cifar10_dataloader.py``) draws the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from flowjax.data.federated import RaggedSplit

SCHEMES = ("dirichlet", "shards")


@dataclasses.dataclass(frozen=True)
class LabelPartition:
    """How a pool is split into clients.

    Attributes:
      scheme: ``"dirichlet"`` or ``"shards"``.
      alpha: Dirichlet concentration (``dirichlet`` only).
      shards_per_client: label shards per client (``shards`` only); must divide
        ``train_per_client``.
      num_clients: clients created.
      train_per_client: train examples per client.
      test_per_client: test examples per client.
    """

    scheme: str = "dirichlet"
    alpha: float = 0.1
    shards_per_client: int = 2
    num_clients: int = 500
    train_per_client: int = 100
    test_per_client: int = 20

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"partition={self.scheme!r}: expected one of {list(SCHEMES)}")
        for field in ("num_clients", "train_per_client", "test_per_client"):
            value = getattr(self, field)
            if not (isinstance(value, (int, np.integer)) and value >= 1):
                raise ValueError(f"{field}={value!r}: expected an integer >= 1")
        if self.scheme == "dirichlet" and not (np.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"alpha={self.alpha!r}: expected a finite number > 0")
        if self.scheme == "shards" and not (
                isinstance(self.shards_per_client, (int, np.integer))
                and 1 <= self.shards_per_client <= self.train_per_client
                and self.train_per_client % self.shards_per_client == 0):
            raise ValueError(f"shards_per_client={self.shards_per_client!r}: expected an "
                             f"integer >= 1 dividing train_per_client={self.train_per_client}")

    @property
    def label(self) -> str:
        """``dirichlet_0.1`` or ``shards_2``, for task names."""
        if self.scheme == "dirichlet":
            return f"dirichlet_{self.alpha:g}"
        return f"shards_{self.shards_per_client}"


def dirichlet_partition(labels: np.ndarray, client_probs: np.ndarray, per_client: int,
                        rng: np.random.Generator) -> np.ndarray:
    """Example indices ``[num_clients, per_client]`` drawn by class, disjoint across clients.

    Each slot of a client draws a class from its distribution, then an unused example of
    that class; when a class runs out, the client's distribution is renormalized over the
    classes that still have examples.

    Args:
      labels: int labels of the pool.
      client_probs: ``[num_clients, num_classes]`` class distribution of each client.
      per_client: examples drawn per client.
      rng: the partition's generator.

    Raises:
      ValueError: the pool has fewer than ``num_clients * per_client`` examples.
    """
    num_clients, num_classes = client_probs.shape
    if num_clients * per_client > len(labels):
        raise ValueError(f"{num_clients} clients x {per_client} examples need "
                         f"{num_clients * per_client} examples; the pool has {len(labels)}")
    pools = [list(rng.permutation(np.flatnonzero(labels == c))) for c in range(num_classes)]
    remaining = np.array([len(p) for p in pools], np.float64)
    chosen = np.empty((num_clients, per_client), np.int64)
    for client in range(num_clients):
        for slot in range(per_client):
            probs = client_probs[client] * (remaining > 0)
            if probs.sum() <= 0:  # all of this client's classes ran out: any class left
                probs = (remaining > 0).astype(np.float64)
            c = rng.choice(num_classes, p=probs / probs.sum())
            chosen[client, slot] = pools[c].pop()
            remaining[c] -= 1
    return chosen


def shard_partition(labels: np.ndarray, num_clients: int, shards_per_client: int,
                    per_client: int, rng: np.random.Generator) -> np.ndarray:
    """Example indices ``[num_clients, per_client]``: ``shards_per_client`` label shards each.

    A random ``num_clients * per_client`` examples of the pool are sorted by label (ties
    in random order) and cut into equal shards, dealt to clients in a random order.

    Raises:
      ValueError: the pool is too small, or ``shards_per_client`` does not divide
        ``per_client``.
    """
    total = num_clients * per_client
    if total > len(labels):
        raise ValueError(f"{num_clients} clients x {per_client} examples need {total} "
                         f"examples; the pool has {len(labels)}")
    if per_client % shards_per_client:
        raise ValueError(f"shards_per_client={shards_per_client} does not divide "
                         f"per_client={per_client}")
    subset = rng.permutation(len(labels))[:total]
    by_label = subset[np.argsort(labels[subset], kind="stable")]
    shards = by_label.reshape(num_clients * shards_per_client, per_client // shards_per_client)
    dealt = shards[rng.permutation(len(shards))]
    return dealt.reshape(num_clients, per_client)


def client_class_probs(labels: np.ndarray, chosen: np.ndarray, num_classes: int) -> np.ndarray:
    """``[num_clients, num_classes]``: each client's label histogram, normalized."""
    counts = np.stack([np.bincount(labels[row], minlength=num_classes) for row in chosen])
    return counts / counts.sum(axis=1, keepdims=True)


def partition_indices(partition: LabelPartition, train_labels: np.ndarray,
                      test_labels: np.ndarray, num_classes: int, seed: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Train and test example indices ``[num_clients, per_client]`` of every client.

    The generator is ``np.random.default_rng(seed)``, drawn in this order: the clients'
    class distributions (Dirichlet) or the shards, then the train and the test draws.
    """
    rng = np.random.default_rng(seed)
    n = partition.num_clients
    if partition.scheme == "dirichlet":
        probs = rng.dirichlet(np.full(num_classes, partition.alpha), size=n)
        train = dirichlet_partition(train_labels, probs, partition.train_per_client, rng)
    else:
        train = shard_partition(train_labels, n, partition.shards_per_client,
                                partition.train_per_client, rng)
        probs = client_class_probs(train_labels, train, num_classes)
    test = dirichlet_partition(test_labels, probs, partition.test_per_client, rng)
    return train, test


def fixed_size_split(features: dict[str, np.ndarray], per_client: int) -> RaggedSplit:
    """A split whose client ``i`` owns rows ``[i * per_client, (i + 1) * per_client)``."""
    rows = len(next(iter(features.values())))
    offsets = np.arange(rows // per_client + 1, dtype=np.int64) * per_client
    return RaggedSplit(features, offsets)


def label_skew(labels_per_client: Sequence[np.ndarray]) -> float:
    """Mean over clients of the largest class share: 1/C when iid, 1 when one class each."""
    shares = [np.bincount(y).max() / len(y) for y in labels_per_client if len(y)]
    return float(np.mean(shares))


def majority_baselines(train_labels: Sequence[np.ndarray],
                       test_labels: Sequence[np.ndarray]) -> dict[str, float]:
    """What two label-only predictors score, as client means of test accuracy (Acc_g, Acc_p).

    ``global_majority``: every client predicts the most common label of all clients' train
    data (the best constant a global model can learn without looking at inputs).
    ``client_majority``: each client predicts its own most common train label (a
    personalized model that ignores inputs). Learning shows as accuracy above these. One
    label per example (classification); a client without train labels predicts the pooled
    majority, and one without test labels is left out of the means.

    Raises:
      ValueError: labels that are not one integer per example (one line).
    """
    train = [np.asarray(y) for y in train_labels]
    test = [np.asarray(y) for y in test_labels]
    for y in train + test:
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            raise ValueError(f"labels of shape {y.shape} and dtype {y.dtype}: expected one "
                             "integer class per example (sequence tasks have no such floor)")
    pooled = np.bincount(np.concatenate(train)).argmax()
    scored = [(tr, te) for tr, te in zip(train, test) if len(te)]
    return {"global_majority": float(np.mean([np.mean(te == pooled) for _, te in scored])),
            "client_majority": float(np.mean([
                np.mean(te == (np.bincount(tr).argmax() if len(tr) else pooled))
                for tr, te in scored]))}


__all__: Sequence[str] = ("LabelPartition", "SCHEMES", "client_class_probs",
                          "dirichlet_partition", "fixed_size_split", "label_skew",
                          "majority_baselines", "partition_indices", "shard_partition")
