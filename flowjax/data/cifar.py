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

from flowjax.data import partition as partitions
from flowjax.data.federated import ArrayFederatedData, FederatedTask
from flowjax.data.partition import dirichlet_partition  # noqa: F401 (re-exported)
from flowjax.data.tfds_source import prepared_sources

# Per-channel statistics of the CIFAR-10 train set (0-255 scale), used for both datasets.
CHANNEL_MEAN = np.array([125.3, 123.0, 113.9], np.float32)
CHANNEL_STD = np.array([63.0, 62.1, 66.7], np.float32)
NUM_CLASSES = {"cifar10": 10, "cifar100": 100}


def _read(source, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    images = np.empty((len(indices), 32, 32, 3), np.float32)
    labels = np.empty((len(indices),), np.int32)
    for row, index in enumerate(indices):
        example = source[int(index)]
        images[row] = (np.asarray(example["image"], np.float32) - CHANNEL_MEAN) / CHANNEL_STD
        labels[row] = int(example["label"])
    return images, labels


def load_cifar_dirichlet(*, name: str = "cifar10", alpha: float = 0.1, num_clients: int = 500,
                         train_per_client: int = 100, test_per_client: int = 20, seed: int = 0,
                         data_dir: str | None = None) -> FederatedTask:
    """The federated CIFAR task; evaluation uses every client's test split."""
    if name not in NUM_CLASSES:
        raise ValueError(f"unknown CIFAR name {name!r}; expected one of {sorted(NUM_CLASSES)}")
    spec = partitions.LabelPartition("dirichlet", alpha=alpha, num_clients=num_clients,
                                     train_per_client=train_per_client,
                                     test_per_client=test_per_client)
    sources = prepared_sources(name, ("train", "test"), data_dir)
    labels = {split: np.array([int(source[i]["label"]) for i in range(len(source))])
              for split, source in sources.items()}
    chosen = dict(zip(("train", "test"), partitions.partition_indices(
        spec, labels["train"], labels["test"], NUM_CLASSES[name], seed)))
    splits = {}
    for split, per_client in (("train", train_per_client), ("test", test_per_client)):
        x, y = _read(sources[split], chosen[split].reshape(-1))
        splits[split] = partitions.fixed_size_split({"x": x, "y": y}, per_client)
    ids = tuple(f"client{i:04d}" for i in range(num_clients))
    return FederatedTask(train=ArrayFederatedData(ids, splits), held_out=None,
                         name=f"{name}_dirichlet_{alpha:g}")


def label_skew(task: FederatedTask, split: str = "train") -> float:
    """Mean over clients of the largest class share: 1/C when iid, 1 when one class each."""
    data = task.train
    return partitions.label_skew([data.client(i, split)["y"] for i in range(len(data.client_ids))])


__all__: Sequence[str] = ("dirichlet_partition", "load_cifar_dirichlet", "label_skew")
