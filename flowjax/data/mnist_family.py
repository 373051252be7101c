"""MNIST-family image classification (MNIST, Fashion-MNIST, KMNIST, EMNIST) split into clients.

Two sources of the same 28x28 grayscale images, one partition:

* ``load_idx_task``: the IDX files users download (``train-images-idx3-ubyte.gz``,
  ``train-labels-idx1-ubyte.gz``, ``t10k-images-idx3-ubyte.gz``,
  ``t10k-labels-idx1-ubyte.gz``, compressed or not; ``prefix`` selects e.g. EMNIST's
  ``emnist-balanced-`` files). Debian's ``dataset-fashion-mnist`` package installs
  Fashion-MNIST's four files in ``/usr/share/datasets/fashion-mnist/``.
* ``load_tfds_task``: ``tfds.data_source`` of ``mnist``, ``fashion_mnist`` or ``emnist``
  (array_record, no TensorFlow), prepared once with ``tfds.builder(name,
  file_format='array_record').download_and_prepare()``, as for CIFAR.

The train pool is split into clients by Dirichlet(alpha) label skew or by label shards,
and every client's test examples are drawn from the test pool with the same class
distribution (``flowjax.data.partition``). Pixels are scaled to [0, 1]; images keep the
source's orientation (EMNIST's files store them transposed). Evaluation uses every
client's test split (no held-out clients), as for CIFAR.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from flowjax.data import partition as partitions
from flowjax.data.federated import ArrayFederatedData, FederatedTask
from flowjax.data.idx import DTYPES as IDX_DTYPES
from flowjax.data.idx import read_idx
from flowjax.data.tfds_source import prepared_sources

TFDS_NAMES = ("mnist", "fashion_mnist", "emnist")
_STEMS = {"train": ("train",), "test": ("t10k", "test")}
_KINDS = {"images": "idx3", "labels": "idx1"}
# Where a package puts the files, for the error message.
_INSTALL_HINTS = {"fashion_mnist": "apt-get install dataset-fashion-mnist puts them in "
                                   "/usr/share/datasets/fashion-mnist/"}


def idx_paths(data_dir: str, prefix: str = "") -> dict[str, dict[str, str]]:
    """``{split: {'images': path, 'labels': path}}`` of the IDX files in ``data_dir``.

    Raises:
      ValueError: a file is missing (one line listing the names looked for).
    """
    found, missing = {}, []
    for split, stems in _STEMS.items():
        found[split] = {}
        for kind, idx in _KINDS.items():
            names = [f"{prefix}{stem}-{kind}-{idx}-ubyte{ext}" for stem in stems
                     for ext in (".gz", "")]
            path = next((os.path.join(data_dir, n) for n in names
                         if os.path.isfile(os.path.join(data_dir, n))), None)
            if path is None:
                missing.append(names[0])
            found[split][kind] = path
    if missing:
        raise ValueError(f"missing {', '.join(missing)} in {data_dir!r}")
    return found


def _to_task(pools: dict[str, tuple[np.ndarray, np.ndarray]], partition: partitions.LabelPartition,
             seed: int, name: str) -> FederatedTask:
    """Partitions ``{split: (images uint8 [n, 28, 28], labels [n])}`` into a task."""
    labels = {split: np.asarray(y, np.int64) for split, (_, y) in pools.items()}
    # The partition draws over the classes present, numbered 0..C-1: EMNIST letters'
    # labels 1..26 would otherwise leave a class 0 that takes a share of every client's
    # Dirichlet draw with no example to give. The examples keep their own labels.
    present = np.unique(np.concatenate([labels["train"], labels["test"]]))
    chosen = dict(zip(("train", "test"), partitions.partition_indices(
        partition, np.searchsorted(present, labels["train"]),
        np.searchsorted(present, labels["test"]), len(present), seed)))
    splits = {}
    for split, per_client in (("train", partition.train_per_client),
                              ("test", partition.test_per_client)):
        images, _ = pools[split]
        rows = chosen[split].reshape(-1)
        x = np.asarray(images[rows], np.float32) / 255.0
        y = labels[split][rows].astype(np.int32)
        splits[split] = partitions.fixed_size_split({"x": x, "y": y}, per_client)
    ids = tuple(f"client{i:04d}" for i in range(partition.num_clients))
    return FederatedTask(train=ArrayFederatedData(ids, splits), held_out=None,
                         name=f"{name}_{partition.label}")


def _partition(partition: str, alpha: float, shards_per_client: int, num_clients: int,
               train_per_client: int, test_per_client: int) -> partitions.LabelPartition:
    return partitions.LabelPartition(partition, alpha=alpha, shards_per_client=shards_per_client,
                                     num_clients=num_clients, train_per_client=train_per_client,
                                     test_per_client=test_per_client)


def load_idx_task(*, data_dir: str, name: str = "fashion_mnist", prefix: str = "",
                  partition: str = "dirichlet", alpha: float = 0.1, shards_per_client: int = 2,
                  num_clients: int = 500, train_per_client: int = 100,
                  test_per_client: int = 20, seed: int = 0) -> FederatedTask:
    """The federated task from MNIST-family IDX files in ``data_dir``.

    Args:
      data_dir: folder holding the four files.
      name: dataset name for reports (and the install hint of a missing file).
      prefix: file name prefix, e.g. ``"emnist-balanced-"``.
      partition: ``"dirichlet"`` (label skew ``alpha``) or ``"shards"``
        (``shards_per_client`` label shards per client).
      seed: the partition's seed.

    Raises:
      ValueError: missing or malformed files, or a bad partition value (one line).
    """
    spec = _partition(partition, alpha, shards_per_client, num_clients, train_per_client,
                      test_per_client)
    paths, missing = None, ""
    if data_dir and os.path.isdir(data_dir):
        try:
            paths = idx_paths(data_dir, prefix)
        except ValueError as error:
            # Name what is missing where the folder exists: three files of four is another
            # mistake (a download cut short) than the wrong folder.
            missing = f" ({error})"
    if paths is None:
        hint = _INSTALL_HINTS.get(name, "download them from the dataset's page")
        raise ValueError(f"{name} IDX files not found in data_dir={data_dir!r}{missing}: expected "
                         f"{prefix}train-images-idx3-ubyte.gz, {prefix}train-labels-idx1-ubyte.gz, "
                         f"{prefix}t10k-images-idx3-ubyte.gz, {prefix}t10k-labels-idx1-ubyte.gz "
                         f"(or uncompressed); {hint}, or set --config.data.data_dir")
    pools = {}
    for split, files in paths.items():
        images, labels = read_idx(files["images"]), read_idx(files["labels"])
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise ValueError(f"{files['images']} and {files['labels']}: expected images "
                             f"[n, rows, cols] and labels [n], got {images.shape} and "
                             f"{labels.shape}")
        # The MNIST family is uint8 pixels and labels (type byte 0x08); IDX allows other
        # types, and a float image would be divided by 255 and a float label truncated.
        for path, array in ((files["images"], images), (files["labels"], labels)):
            if array.dtype != np.uint8:
                type_byte = next(b for b, d in IDX_DTYPES.items()
                                 if d.newbyteorder("=") == array.dtype)
                raise ValueError(f"{path}: holds {array.dtype} (IDX type byte "
                                 f"0x{type_byte:02X}); expected uint8 (type byte 0x08), as "
                                 f"the MNIST-family files are")
        pools[split] = (images, labels)
    return _to_task(pools, spec, seed, name)


def load_tfds_task(*, name: str = "fashion_mnist", data_dir: str | None = None,
                   partition: str = "dirichlet", alpha: float = 0.1, shards_per_client: int = 2,
                   num_clients: int = 500, train_per_client: int = 100,
                   test_per_client: int = 20, seed: int = 0) -> FederatedTask:
    """The federated task from TFDS's ``name`` (``mnist``, ``fashion_mnist``, ``emnist``).

    Raises:
      ValueError: an unknown ``name``, a bad partition value, or an image that is not
        uint8 ``[28, 28, 1]`` (one line).
    """
    if name.split("/")[0] not in TFDS_NAMES:
        raise ValueError(f"unknown TFDS name {name!r}; expected one of {list(TFDS_NAMES)} "
                         "(EMNIST configs as emnist/<config>, e.g. emnist/balanced)")
    spec = _partition(partition, alpha, shards_per_client, num_clients, train_per_client,
                      test_per_client)
    pools = {}
    for split, source in prepared_sources(name, ("train", "test"), data_dir).items():
        examples = [source[i] for i in range(len(source))]
        images = [np.asarray(e["image"]) for e in examples]
        # TFDS's images are uint8 [28, 28, 1]; any other shape or type would be reshaped
        # or cast silently (a flat 784 vector reads as an image, floats in [0, 1] as 0).
        bad = next((i for i, image in enumerate(images)
                    if image.shape not in ((28, 28, 1), (28, 28)) or image.dtype != np.uint8),
                   None)
        if bad is not None:
            raise ValueError(f"{name} {split} image {bad}: {images[bad].dtype} of shape "
                             f"{images[bad].shape}; expected uint8 [28, 28, 1] (TFDS's "
                             f"{name.split('/')[0]} images)")
        images = np.stack([image.reshape(28, 28) for image in images])
        pools[split] = (images, np.array([int(e["label"]) for e in examples], np.int64))
    return _to_task(pools, spec, seed, name.replace("/", "_"))


__all__: Sequence[str] = ("TFDS_NAMES", "idx_paths", "load_idx_task", "load_tfds_task")
