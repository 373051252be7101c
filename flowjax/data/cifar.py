"""Federated CIFAR-10/100: Dirichlet label partitions of TFDS's CIFAR (paper Sec. 5, App. B).

500 clients x 100 train / 20 test examples by default. Each client draws one class
distribution ``p ~ Dir(alpha)`` and samples both its train and its test examples from it
(so a client's test data looks like its train data), without replacement from the
class pools; when a class runs out, the client's ``p`` is renormalized over the classes
that still have examples. Smaller ``alpha`` means more skewed clients (the paper uses 0.1
and 0.6).

Images are read through ``tfds.data_source`` (array_record, no TensorFlow needed):
prepare them once with ``tfds.builder('cifar10', file_format='array_record')
.download_and_prepare()`` on a machine with internet, then point ``data_dir`` at it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from flowjax.data.federated import ArrayFederatedData, FederatedTask, RaggedSplit

# Per-channel statistics of the CIFAR-10 train set (0-255 scale), used for both datasets.
_MEAN = np.array([125.3, 123.0, 113.9], np.float32)
_STD = np.array([63.0, 62.1, 66.7], np.float32)
NUM_CLASSES = {"cifar10": 10, "cifar100": 100}


def dirichlet_partition(labels: np.ndarray, client_probs: np.ndarray, per_client: int,
                        rng: np.random.Generator) -> np.ndarray:
    """Example indices ``[num_clients, per_client]``, disjoint across clients.

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


def _read(source, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    images = np.empty((len(indices), 32, 32, 3), np.float32)
    labels = np.empty((len(indices),), np.int32)
    for row, index in enumerate(indices):
        example = source[int(index)]
        images[row] = (np.asarray(example["image"], np.float32) - _MEAN) / _STD
        labels[row] = int(example["label"])
    return images, labels


def load_cifar_dirichlet(*, name: str = "cifar10", alpha: float = 0.1, num_clients: int = 500,
                         train_per_client: int = 100, test_per_client: int = 20, seed: int = 0,
                         data_dir: str | None = None) -> FederatedTask:
    """The federated CIFAR task; evaluation uses every client's test split."""
    import tensorflow_datasets as tfds  # imported here: only CIFAR needs it

    if name not in NUM_CLASSES:
        raise ValueError(f"unknown CIFAR name {name!r}; expected one of {sorted(NUM_CLASSES)}")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    for field, value in (("num_clients", num_clients), ("train_per_client", train_per_client),
                         ("test_per_client", test_per_client)):
        if value < 1:
            raise ValueError(f"{field} must be >= 1, got {value}")
    rng = np.random.default_rng(seed)
    client_probs = rng.dirichlet(np.full(NUM_CLASSES[name], alpha), size=num_clients)
    splits = {}
    for split, per_client in (("train", train_per_client), ("test", test_per_client)):
        source = tfds.data_source(name, split=split, data_dir=data_dir)
        labels = np.array([int(source[i]["label"]) for i in range(len(source))])
        chosen = dirichlet_partition(labels, client_probs, per_client, rng)
        x, y = _read(source, chosen.reshape(-1))
        offsets = np.arange(num_clients + 1, dtype=np.int64) * per_client
        splits[split] = RaggedSplit({"x": x, "y": y}, offsets)
    ids = tuple(f"client{i:04d}" for i in range(num_clients))
    return FederatedTask(train=ArrayFederatedData(ids, splits), held_out=None,
                         name=f"{name}_dirichlet_{alpha:g}")


def label_skew(task: FederatedTask, split: str = "train") -> float:
    """Mean over clients of the largest class share: 1/C when iid, 1 when one class each."""
    data = task.train
    shares = []
    for client in range(len(data.client_ids)):
        y = data.client(client, split)["y"]
        if len(y):
            shares.append(np.bincount(y).max() / len(y))
    return float(np.mean(shares))


__all__: Sequence[str] = ("dirichlet_partition", "load_cifar_dirichlet", "label_skew")
