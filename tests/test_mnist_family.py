"""MNIST-family data: IDX files written here by the format's spec, TFDS through mock_data,
and the label partitions shared with CIFAR."""

import gzip
import os
import struct
import sys

import numpy as np
import pytest
import tensorflow_datasets as tfds

from flowjax.data import load_task
from flowjax.data.idx import parse_idx, read_idx
from flowjax.data.partition import (LabelPartition, dirichlet_partition, label_skew,
                                    majority_baselines, partition_indices, shard_partition)
from tests import forkserver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def idx_bytes(array: np.ndarray) -> bytes:
    """An IDX file of a uint8 array, written from LeCun's description of the format
    (http://yann.lecun.com/exdb/mnist/): magic 0x00000800 | ndim as a big-endian 32-bit
    integer (0x00000803 images, 0x00000801 labels), each dimension as a big-endian 32-bit
    integer, then the bytes in C order."""
    assert array.dtype == np.uint8
    header = struct.pack(">I", 0x0800 | array.ndim)
    header += b"".join(struct.pack(">I", d) for d in array.shape)
    return header + np.ascontiguousarray(array).tobytes()


def pool(num_classes: int, per_class: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Images whose pixels encode their pool index (row 0) and label (row 1), in class order
    shuffled, so a loaded example tells where it came from."""
    labels = np.repeat(np.arange(num_classes), per_class).astype(np.uint8)
    labels = labels[np.random.default_rng(offset).permutation(len(labels))]
    images = np.zeros((len(labels), 28, 28), np.uint8)
    index = np.arange(len(labels))
    images[:, 0, 0], images[:, 0, 1] = index % 256, index // 256
    images[:, 1, :] = labels[:, None]
    return images, labels


def write_files(folder, train, test, *, compress=True, prefix=""):
    ext = ".gz" if compress else ""
    opener = gzip.open if compress else open
    for stem, (images, labels) in (("train", train), ("t10k", test)):
        for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
            with opener(os.path.join(folder, f"{prefix}{stem}-{kind}-ubyte{ext}"), "wb") as out:
                out.write(idx_bytes(array))


def decode(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pool index and label of loaded examples (pixels / 255 back to bytes)."""
    raw = np.rint(x * 255).astype(np.int64)
    return raw[:, 0, 0] + 256 * raw[:, 0, 1], raw[:, 1, 0]


def test_idx_header_is_the_formats_and_parses_back():
    images = np.arange(3 * 28 * 28, dtype=np.int64).reshape(3, 28, 28).astype(np.uint8)
    raw = idx_bytes(images)
    # LeCun's page: magic 0x00000803 (2051), then 32-bit MSB-first counts n, 28 rows, 28 cols;
    # Debian's Fashion-MNIST train images begin 00 00 08 03 00 00 ea 60 00 00 00 1c 00 00 00 1c.
    assert raw[:16] == bytes.fromhex("00000803" "00000003" "0000001c" "0000001c")
    assert len(raw) == 16 + 3 * 784
    np.testing.assert_array_equal(parse_idx(raw), images)
    labels = np.array([7, 0, 9], np.uint8)
    assert idx_bytes(labels)[:8] == bytes.fromhex("00000801" "00000003")
    np.testing.assert_array_equal(parse_idx(idx_bytes(labels)), labels)
    # Multi-byte types are big-endian (type byte 0x0B = short).
    assert parse_idx(bytes.fromhex("00000b01" "00000002" "0102" "fffe")).tolist() == [258, -2]


@pytest.mark.parametrize("raw, message", [
    (b"\x00\x01\x08\x01", "is not an IDX file: magic bytes 00010801"),
    (bytes.fromhex("00000801" "00000005") + b"\x00" * 4, "4 data bytes, expected 5"),
    (bytes.fromhex("00000803" "0000"), "truncated header"),
])
def test_bad_idx_bytes_fail_in_one_line(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_idx(raw, "x.idx")


@pytest.mark.parametrize("compress", [True, False])
def test_dirichlet_task_from_idx_files(tmp_path, compress):
    train, test = pool(10, 40), pool(10, 20, offset=1)
    write_files(tmp_path, train, test, compress=compress)
    options = dict(data_dir=str(tmp_path), alpha=0.1, num_clients=8, train_per_client=30,
                   test_per_client=10, seed=3)
    task = load_task("mnist_family_idx", options)
    assert task.name == "fashion_mnist_dirichlet_0.1" and task.held_out is None
    data = task.train
    np.testing.assert_array_equal(data.num_examples("train"), 30)
    np.testing.assert_array_equal(data.num_examples("test"), 10)
    expected = partition_indices(LabelPartition("dirichlet", 0.1, num_clients=8,
                                                train_per_client=30, test_per_client=10),
                                 train[1].astype(np.int64), test[1].astype(np.int64), 10, 3)
    for split, (images, labels), chosen in zip(("train", "test"), (train, test), expected):
        features = data.splits[split].features
        assert features["x"].dtype == np.float32 and features["x"].shape[1:] == (28, 28)
        assert features["y"].dtype == np.int32
        index, label = decode(features["x"])
        np.testing.assert_array_equal(index, chosen.reshape(-1))  # the partition's examples
        np.testing.assert_array_equal(features["y"], labels[index])  # with their own labels
        np.testing.assert_array_equal(label, labels[index])
        np.testing.assert_array_equal(features["x"], images[index] / np.float32(255))
        assert len(np.unique(index)) == len(index)  # disjoint across clients
    again = load_task("mnist_family_idx", options)  # seeded: the same task
    np.testing.assert_array_equal(again.train.splits["train"].features["x"],
                                  data.splits["train"].features["x"])


def test_labels_that_skip_a_class_partition_as_the_classes_present(tmp_path):
    # EMNIST letters' labels are 1..26: no class 0 may take a share of the Dirichlet draws.
    # Files whose labels are shifted by one give the same examples, with their own labels.
    train, test = pool(5, 40), pool(5, 20, offset=1)
    shifted = tmp_path / "shifted"
    shifted.mkdir()
    write_files(tmp_path, train, test)
    write_files(shifted, (train[0], train[1] + 1), (test[0], test[1] + 1))
    options = dict(alpha=0.1, num_clients=6, train_per_client=20, test_per_client=10, seed=2)
    plain = load_task("mnist_family_idx", dict(data_dir=str(tmp_path), **options))
    moved = load_task("mnist_family_idx", dict(data_dir=str(shifted), **options))
    for split in ("train", "test"):
        ours, theirs = plain.train.splits[split].features, moved.train.splits[split].features
        np.testing.assert_array_equal(theirs["x"], ours["x"])
        np.testing.assert_array_equal(theirs["y"], ours["y"] + 1)


def test_smaller_alpha_gives_more_skewed_clients_and_tests_follow_trains(tmp_path):
    write_files(tmp_path, pool(10, 60), pool(10, 30, offset=1))
    skew = {}
    for alpha in (0.1, 100.0):
        task = load_task("mnist_family_idx", dict(data_dir=str(tmp_path), alpha=alpha,
                                                   num_clients=10, train_per_client=40,
                                                   test_per_client=20))
        ys = {s: [task.train.client(i, s)["y"] for i in range(10)] for s in ("train", "test")}
        skew[alpha] = label_skew(ys["train"])
        # A skewed client's most common train class dominates its test split too.
        tops = [np.bincount(y, minlength=10).argmax() for y in ys["train"]]
        test_share = np.mean([np.mean(y == top) for y, top in zip(ys["test"], tops)])
        assert alpha == 100.0 or test_share > 0.6, (alpha, test_share)
    assert skew[0.1] > 0.6 > 0.4 > skew[100.0], skew


def test_label_shards_give_each_client_its_shards_classes(tmp_path):
    # 10 classes x 10 examples, 5 clients x 20 examples in 2 shards of 10: every shard is
    # exactly one class, so every client sees at most 2 classes, in train and test alike.
    write_files(tmp_path, pool(10, 10), pool(10, 20, offset=1))
    task = load_task("mnist_family_idx", dict(data_dir=str(tmp_path), partition="shards",
                                              shards_per_client=2, num_clients=5,
                                              train_per_client=20, test_per_client=6))
    assert task.name == "fashion_mnist_shards_2"
    seen = set()
    for client in range(5):
        train_y = task.train.client(client, "train")["y"]
        counts = np.bincount(train_y, minlength=10)
        assert sorted(counts[counts > 0]) in ([10, 10], [20])
        assert set(task.train.client(client, "test")["y"]) <= set(train_y)
        seen.update(decode(task.train.client(client, "train")["x"])[0].tolist())
    assert seen == set(range(100))  # the whole pool, each example once


def test_shard_and_dirichlet_partitions_directly():
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(4), 6)
    chosen = shard_partition(labels, num_clients=4, shards_per_client=2, per_client=6, rng=rng)
    assert chosen.shape == (4, 6) and sorted(chosen.reshape(-1)) == list(range(24))
    for row in chosen:  # shards of 3 consecutive sorted labels: one class per shard
        assert len(set(labels[row[:3]])) == 1 and len(set(labels[row[3:]])) == 1
    with pytest.raises(ValueError, match="does not divide per_client=6"):
        shard_partition(labels, 4, 4, 6, rng)
    with pytest.raises(ValueError, match="need 30 examples; the pool has 24"):
        dirichlet_partition(labels, np.full((5, 4), 0.25), 6, rng)


def test_cifar_partition_numbers_are_unchanged_by_the_move():
    # Recorded with flowjax/data/cifar.py's dirichlet_partition before it moved (commit
    # f21fb93): the same generator draws give the same indices.
    rng = np.random.default_rng(7)
    probs = rng.dirichlet(np.full(4, 0.3), size=5)
    chosen = dirichlet_partition(np.arange(60) % 4, probs, 6, rng)
    assert chosen.tolist() == [[1, 53, 24, 40, 33, 41], [4, 7, 56, 16, 32, 28],
                               [52, 36, 15, 44, 8, 20], [48, 0, 12, 49, 17, 43],
                               [51, 47, 39, 59, 55, 19]]


@pytest.mark.parametrize("bad, message", [
    (dict(partition="iid"), "partition='iid': expected one of"),
    (dict(alpha=0.0), "alpha=0.0: expected a finite number > 0"),
    (dict(partition="shards", shards_per_client=3), "shards_per_client=3: expected an integer"),
    (dict(num_clients=0), "num_clients=0: expected an integer >= 1"),
])
def test_bad_partition_values_fail_in_one_line(tmp_path, bad, message):
    write_files(tmp_path, pool(10, 10), pool(10, 5))
    options = {**dict(data_dir=str(tmp_path), num_clients=4, train_per_client=10,
                      test_per_client=5), **bad}
    with pytest.raises(ValueError, match=message):
        load_task("mnist_family_idx", options)


def test_missing_files_name_the_files_and_the_package(tmp_path):
    with pytest.raises(ValueError) as error:
        load_task("mnist_family_idx", dict(data_dir=str(tmp_path / "none")))
    message = str(error.value)
    assert "\n" not in message
    assert "train-images-idx3-ubyte.gz" in message and "t10k-labels-idx1-ubyte.gz" in message
    assert "apt-get install dataset-fashion-mnist" in message
    write_files(tmp_path, pool(10, 10), pool(10, 5))
    os.remove(tmp_path / "t10k-labels-idx1-ubyte.gz")
    with pytest.raises(ValueError) as error:
        load_task("mnist_family_idx", dict(data_dir=str(tmp_path)))
    # Three files of four: the line names the one that is missing.
    assert "\n" not in str(error.value) and str(error.value).startswith(
        f"fashion_mnist IDX files not found in data_dir={str(tmp_path)!r} (missing "
        f"t10k-labels-idx1-ubyte.gz in {str(tmp_path)!r}): expected ")


@pytest.mark.parametrize("kind, type_byte, dtype", [("images-idx3", 0x0D, ">f4"),
                                                    ("labels-idx1", 0x0C, ">i4")])
def test_idx_files_not_uint8_are_refused_not_rescaled_or_truncated(tmp_path, kind,
                                                                    type_byte, dtype):
    """IDX allows other element types (LeCun's page: 0x0D float, 0x0C int); the MNIST
    family is uint8 only, and a float image would be divided by 255 once more."""
    write_files(tmp_path, pool(10, 10), pool(10, 5), compress=False)
    path = tmp_path / f"train-{kind}-ubyte"
    array = read_idx(str(path)).astype(dtype)  # the same values, another type
    # The header as LeCun's page gives it: two zero bytes, the type byte, the dimensions.
    header = bytes([0, 0, type_byte, array.ndim]) + b"".join(
        struct.pack(">I", d) for d in array.shape)
    path.write_bytes(header + array.tobytes())
    with pytest.raises(ValueError) as error:
        load_task("mnist_family_idx", dict(data_dir=str(tmp_path), num_clients=2,
                                           train_per_client=10, test_per_client=5))
    found = np.dtype(dtype).newbyteorder("=").name
    assert str(error.value) == (f"{path}: holds {found} (IDX type byte 0x{type_byte:02X}); "
                                "expected uint8 (type byte 0x08), as the MNIST-family files are")


FASHION_MNIST = "/usr/share/datasets/fashion-mnist"


@pytest.mark.skipif(not os.path.isdir(FASHION_MNIST),
                    reason="Debian's dataset-fashion-mnist is not installed")
def test_the_real_fashion_mnist_files_read_as_a_plain_offset_read_gives_them():
    """Debian's files (zalandoresearch's release), read by ``read_idx`` and by the fixed
    offsets TFDS's MNIST reader uses (16 header bytes for images, 8 for labels)."""
    for stem, n in (("train", 60000), ("t10k", 10000)):
        images = read_idx(f"{FASHION_MNIST}/{stem}-images-idx3-ubyte.gz")
        labels = read_idx(f"{FASHION_MNIST}/{stem}-labels-idx1-ubyte.gz")
        with gzip.open(f"{FASHION_MNIST}/{stem}-images-idx3-ubyte.gz") as f:
            plain = np.frombuffer(f.read()[16:], np.uint8).reshape(n, 28, 28)
        with gzip.open(f"{FASHION_MNIST}/{stem}-labels-idx1-ubyte.gz") as f:
            plain_labels = np.frombuffer(f.read()[8:], np.uint8)
        np.testing.assert_array_equal(images, plain)
        np.testing.assert_array_equal(labels, plain_labels)
        assert np.bincount(labels).tolist() == [n // 10] * 10
    task = load_task("mnist_family_idx", dict(data_dir=FASHION_MNIST))
    assert len(task.train.client_ids) == 500
    assert task.train.num_examples("train").tolist() == [100] * 500


def test_prefixed_files_as_emnist_names_them(tmp_path):
    write_files(tmp_path, pool(4, 10), pool(4, 5), prefix="emnist-balanced-", compress=False)
    task = load_task("mnist_family_idx", dict(data_dir=str(tmp_path), name="emnist",
                                              prefix="emnist-balanced-", num_clients=2,
                                              train_per_client=10, test_per_client=5))
    assert task.name == "emnist_dirichlet_0.1"
    assert read_idx(str(tmp_path / "emnist-balanced-train-labels-idx1-ubyte")).shape == (40,)


@pytest.mark.parametrize("name, classes", [("mnist", 10), ("fashion_mnist", 10),
                                           ("emnist", 62)])
def test_tfds_source_partitions_the_same_way(name, classes):
    with tfds.testing.mock_data(num_examples=400):
        task = load_task("mnist_family_tfds", dict(name=name, alpha=0.6, num_clients=10,
                                                   train_per_client=20, test_per_client=8))
        pools = {}
        for split in ("train", "test"):
            source = tfds.data_source(name, split=split)
            pools[split] = (np.stack([np.asarray(source[i]["image"]).reshape(28, 28)
                                      for i in range(len(source))]),
                            np.array([int(source[i]["label"]) for i in range(len(source))]))
    assert task.name == f"{name}_dirichlet_0.6"
    data = task.train.splits
    assert data["train"].features["y"].shape == (200,)
    assert data["train"].features["x"].shape == (200, 28, 28)
    # The same partition as the IDX path: the indices partition_indices picks.
    num_classes = int(max(pools["train"][1].max(), pools["test"][1].max())) + 1
    assert num_classes <= classes
    chosen = partition_indices(LabelPartition("dirichlet", 0.6, num_clients=10,
                                              train_per_client=20, test_per_client=8),
                               pools["train"][1], pools["test"][1], num_classes, 0)
    for split, rows in zip(("train", "test"), chosen):
        images, labels = pools[split]
        np.testing.assert_array_equal(data[split].features["x"],
                                      images[rows.reshape(-1)] / np.float32(255))
        np.testing.assert_array_equal(data[split].features["y"], labels[rows.reshape(-1)])


@pytest.mark.parametrize("image, found", [
    (np.zeros((14, 56, 1), np.uint8), "uint8 of shape (14, 56, 1)"),
    (np.zeros(784, np.uint8), "uint8 of shape (784,)"),
    (np.full((28, 28, 1), 0.5, np.float32), "float32 of shape (28, 28, 1)")])
def test_tfds_images_not_uint8_28x28_are_refused_not_reshaped_or_cast(image, found):
    def data_source(builder, split, *args, **kwargs):
        good = {"image": np.zeros((28, 28, 1), np.uint8), "label": 1}
        return [good, good, {"image": image, "label": 3}, good]

    with tfds.testing.mock_data(as_data_source_fn=data_source):
        with pytest.raises(ValueError) as error:
            load_task("mnist_family_tfds", dict(name="fashion_mnist", num_clients=2,
                                                train_per_client=2, test_per_client=1))
    assert str(error.value) == (f"fashion_mnist train image 2: {found}; expected uint8 "
                                "[28, 28, 1] (TFDS's fashion_mnist images)")


def test_fashion_mnist_config_without_files_exits_2_in_one_line(tmp_path):
    command = [sys.executable, "launch/train.py", "--config=configs/fashion_mnist.py:mini_0.1",
               f"--config.data.data_dir={tmp_path}", f"--workdir={tmp_path / 'run'}"]
    done = forkserver.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("error: fashion_mnist IDX files not found in data_dir="), lines
    assert "apt-get install dataset-fashion-mnist" in lines[-1]
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.parametrize("variant", ["dirichlet_0.1", "dirichlet_0.6", "mini_0.1", "mini_0.6"])
def test_fashion_mnist_configs_are_valid_for_every_method(variant):
    from configs import fashion_mnist
    from flowjax.paper.plan import MAIN
    from flowjax.validation import validate_config

    for method in MAIN:
        config = fashion_mnist.get_config(variant)
        config.algorithm = method
        validate_config(config)
    config = fashion_mnist.get_config(variant)
    assert config.data.alpha == float(variant.split("_")[1])
    # The paper's EMNIST settings (Appendix B), whatever the scale.
    assert (config.sgd.epochs, config.sgd.batch_size, config.sgd.learning_rate,
            config.methods.flow.gamma, config.clients_per_round) == (3, 20, 0.01, 1e-2, 10)
    with pytest.raises(ValueError, match="unknown fashion_mnist config variant 'mini'"):
        fashion_mnist.get_config("mini")


# The offline CPU runs' data path (mini_reproduction.sh, gain_source.sh): about 25 s.
# CI time: the config and its data path are the method's; Flow on the CNN (its routed
# programs) is test_flow.py's and test_flow_reference.py's, so Flow here runs with -m slow.
@pytest.mark.parametrize("method", ["fedavg", pytest.param("flow", marks=pytest.mark.slow)])
def test_fashion_mnist_mini_config_trains_on_generated_files(tmp_path, method):
    from configs import fashion_mnist
    from flowjax import config as run_config
    from flowjax import experiment

    write_files(tmp_path, pool(10, 20), pool(10, 10, offset=1))
    config = fashion_mnist.get_config("mini_0.1")
    config.data.update(data_dir=str(tmp_path), num_clients=4, train_per_client=20,
                       test_per_client=5)
    config.update(algorithm=method, num_rounds=1, clients_per_round=2)
    config.eval.every = 0
    result = experiment.run(run_config.build_simulation(config))
    assert result.summaries["train_clients"].num_clients == 4


def test_majority_baselines_score_the_pooled_and_each_clients_most_common_train_label():
    train = [np.array([1, 1, 2]), np.array([2, 2, 2, 0]), np.array([1])]  # pooled majority: 2
    test = [np.array([1, 2, 2, 0]), np.array([2, 0]), np.array([0, 1, 1])]
    floors = majority_baselines(train, test)
    assert floors["global_majority"] == np.mean([2 / 4, 1 / 2, 0 / 3])
    assert floors["client_majority"] == np.mean([1 / 4, 1 / 2, 2 / 3])
    with pytest.raises(ValueError, match=r"labels of shape \(2, 3\) .* one integer class"):
        majority_baselines([np.zeros((2, 3), np.int32)], [np.zeros((2, 3), np.int32)])


def test_label_baselines_launcher_prints_the_floors_of_a_configs_clients(tmp_path):
    write_files(tmp_path, pool(10, 20), pool(10, 10, offset=1))
    config = ["--config=configs/fashion_mnist.py:mini_0.1", f"--config.data.data_dir={tmp_path}",
              "--config.data.num_clients=4", "--config.data.train_per_client=20",
              "--config.data.test_per_client=5"]
    done = forkserver.run([sys.executable, "launch/label_baselines.py", *config], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    data = load_task("mnist_family_idx", dict(data_dir=str(tmp_path), alpha=0.1, num_clients=4,
                                              train_per_client=20, test_per_client=5)).train
    floors = majority_baselines(*([data.client(i, split)["y"] for i in range(4)]
                                  for split in ("train", "test")))
    assert (f"global majority label (floor for Acc_g): {100 * floors['global_majority']:.2f}%"
            in done.stdout)
    assert (f"each client's majority train label (floor for Acc_p): "
            f"{100 * floors['client_majority']:.2f}%" in done.stdout)
    bad = forkserver.run([sys.executable, "launch/label_baselines.py", *config, "--label=z"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "error: --label='z': not a feature of mnist_family_idx; expected one of ['x', 'y']")
