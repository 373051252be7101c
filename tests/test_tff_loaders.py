"""TFF h5 / FedJAX SQLite conversion into client stores, and the ``*_tff`` tasks.

Fixtures write tiny files in the real formats (TFF's h5 layout, FedJAX's SQLite schema),
convert them through ``launch/convert.py``'s functions and load them via ``load_task``. The
FedJAX files come from flowjax's ``write_sqlite``, which ``tests/test_data_formats.py``
checks against files FedJAX's own builder wrote, empty clients and non-ASCII ids included.
"""

import importlib
import json
import os
import shutil
import sqlite3
import sys
import zlib

import msgpack
import numpy as np
import pytest

h5py = pytest.importorskip("h5py")

from flowjax.config import build_task  # noqa: E402
from flowjax.core.cohort import assemble_cohort  # noqa: E402
from flowjax.data import load_task, shakespeare, tff_tasks  # noqa: E402
from flowjax.data.client_store import ClientStore, write_store  # noqa: E402
from flowjax.data.fedjax_sqlite import decode_client, encode_client, write_sqlite  # noqa: E402
from flowjax.validation import validate_config  # noqa: E402
from launch.convert import convert  # noqa: E402
from tests import forkserver  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RNG = np.random.default_rng(0)

EMNIST_TRAIN = {"f0001_00": 3, "f0002_11": 0, "f0003_22": 2}
EMNIST_TEST = {"f0001_00": 1, "f0003_22": 2, "f9999_99": 1}  # f9999_99: test only
EMNIST = {split: {c: (RNG.random((n, 28, 28), dtype=np.float32),
                      RNG.integers(0, 62, n).astype(np.int32)) for c, n in sizes.items()}
          for split, sizes in (("train", EMNIST_TRAIN), ("test", EMNIST_TEST))}

SHAKESPEARE = {
    "train": {"ALL_S_WELL_HELENA": ["O, were that all! I think not on my father;",
                                    "Ünïcødé — naïve café"],
              "JULIETTE_É": ["What's in a name?" * 3],
              "SILENT_LORD": []},
    "test": {"ALL_S_WELL_HELENA": ["Our remedies oft in ourselves do lie,"],
             "JULIETTE_É": ["ça"]},
}

LONG = " ".join(["the"] * 25)
SO = {
    "train": {"00001": ["the cat sat", "the dog cat", LONG],
              "00002": ["dog the", "the", "sat sat", "the the", "cat"],
              "00003": []},
    "test": {"00001": ["cat unseen"], "00002": []},
    "held_out": {"00010": ["the", "cat", "sat", "dog", "the cat"]},
}
# Train word counts: the 31, cat 3, sat 3, dog 2: with 3 words the tie cat/sat is
# broken by byte order, and dog is out of vocabulary.
SO_WORDS = ["the", "cat", "sat"]
THE, CAT, SAT, OOV, BOS, EOS = 1, 2, 3, 4, 5, 6


def _text_dataset(group, name, texts):
    group.create_dataset(name, data=np.array([t.encode("utf-8") for t in texts], dtype=object),
                         dtype=h5py.special_dtype(vlen=bytes), shape=(len(texts),))


def _write_h5(path, clients, write_client):
    with h5py.File(path, "w") as f:
        examples = f.create_group("examples")
        for client_id, data in clients.items():
            write_client(examples.create_group(client_id), data)


def _emnist_client(group, data):
    group.create_dataset("pixels", data=data[0])
    group.create_dataset("label", data=data[1])


@pytest.fixture(scope="module")
def tff_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tff")
    for split in ("train", "test"):
        _write_h5(d / f"fed_emnist_{split}.h5", EMNIST[split], _emnist_client)
        _write_h5(d / f"shakespeare_{split}.h5", SHAKESPEARE[split],
                  lambda g, texts: _text_dataset(g, "snippets", texts))
    for split, clients in SO.items():
        def so_client(group, texts):
            _text_dataset(group, "tokens", texts)
            _text_dataset(group, "title", ["t"] * len(texts))
        _write_h5(d / f"stackoverflow_{split}.h5", clients, so_client)
    return d


@pytest.fixture(scope="module")
def sqlite_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fedjax")
    for split in ("train", "test"):
        # FedJAX stores the raw keys (fedjax/datasets/emnist.py load_split): pixels, label.
        write_sqlite(d / f"federated_emnist_{split}.sqlite",
                     {c: {"pixels": px, "label": lb} for c, (px, lb) in EMNIST[split].items()})
        write_sqlite(d / f"shakespeare_{split}.sqlite",
                     {c: {"snippets": np.array([t.encode() for t in s], object)}
                      for c, s in SHAKESPEARE[split].items()})
    for split, clients in SO.items():
        write_sqlite(d / f"stackoverflow_{split}.sqlite",
                     {c: {"tokens": np.array([t.encode() for t in s], object),
                          "score": np.arange(len(s), dtype=np.int64)}
                      for c, s in clients.items()})
    return d


@pytest.fixture(scope="module", params=["tff_h5", "fedjax_sqlite"])
def converted(request, tff_dir, sqlite_dir, tmp_path_factory):
    source = tff_dir if request.param == "tff_h5" else sqlite_dir
    out = tmp_path_factory.mktemp(request.param)
    return {
        "emnist": convert("emnist", source, out / "emnist", request.param),
        "shakespeare": convert("shakespeare", source, out / "shakespeare", request.param),
        "stackoverflow": convert("stackoverflow", source, out / "so", request.param,
                                 vocab_size=3, max_sentences=3),
    }


def _client(data, client_id, split):
    return data.client(list(data.client_ids).index(client_id), split)


def _sentence(*ids):
    row = np.zeros(21, np.int32)
    row[:len(ids)] = ids
    return row[:-1], row[1:]


# --- EMNIST ----------------------------------------------------------------------

def test_emnist_arrays_ids_and_counts(converted):
    task = load_task("emnist_tff", {"store_dir": str(converted["emnist"])})
    assert task.name == "emnist_tff" and task.held_out is None
    assert list(task.train.client_ids) == sorted(EMNIST_TRAIN)
    np.testing.assert_array_equal(task.train.num_examples("train"), [3, 0, 2])
    np.testing.assert_array_equal(task.train.num_examples("test"), [1, 0, 2])
    for split in ("train", "test"):
        for client_id, (pixels, labels) in EMNIST[split].items():
            if client_id not in EMNIST_TRAIN:
                continue
            rows = _client(task.train, client_id, split)
            assert rows["x"].dtype == np.float32 and rows["x"].shape == (len(labels), 28, 28)
            np.testing.assert_array_equal(rows["x"], pixels)
            np.testing.assert_array_equal(rows["y"], labels)
            assert rows["y"].dtype == np.int32
    meta = json.loads((converted["emnist"] / "task.json").read_text())
    assert meta["test_only_clients"] == 1


def test_fedjax_files_with_text_client_ids_convert_as_blob_ones(sqlite_dir, tmp_path):
    # FedJAX writes BLOB ids and its reader passes TEXT ones on as they are; SQLite itself
    # rewrites the fixture's ids as TEXT here.
    for split in ("train", "test"):
        name = f"federated_emnist_{split}.sqlite"
        shutil.copy(sqlite_dir / name, tmp_path / name)
        with sqlite3.connect(tmp_path / name) as db:
            db.execute("UPDATE federated_data SET client_id = CAST(client_id AS TEXT)")
            assert {t for (t,) in db.execute("SELECT typeof(client_id) FROM federated_data")} == {"text"}
    text = load_task("emnist_tff", {"store_dir": str(
        convert("emnist", tmp_path, tmp_path / "text_out", "fedjax_sqlite"))})
    blob = load_task("emnist_tff", {"store_dir": str(
        convert("emnist", sqlite_dir, tmp_path / "blob_out", "fedjax_sqlite"))})
    assert list(text.train.client_ids) == list(blob.train.client_ids) == sorted(EMNIST_TRAIN)
    for index in range(len(blob.train.client_ids)):
        for split in ("train", "test"):
            for key, value in blob.train.client(index, split).items():
                np.testing.assert_array_equal(text.train.client(index, split)[key], value)


def test_a_fedjax_client_id_that_is_not_utf8_is_one_line_and_nothing_is_written(sqlite_dir,
                                                                                 tmp_path):
    for split in ("train", "test"):
        name = f"federated_emnist_{split}.sqlite"
        shutil.copy(sqlite_dir / name, tmp_path / name)
    train = tmp_path / "federated_emnist_train.sqlite"
    with sqlite3.connect(train) as db:
        db.execute("UPDATE federated_data SET client_id = x'ff3030' WHERE rowid = "
                   "(SELECT MIN(rowid) FROM federated_data)")
    db.close()
    with pytest.raises(ValueError) as error:
        convert("emnist", tmp_path, tmp_path / "out", "fedjax_sqlite")
    assert str(error.value) == (f"{train}: client id b'\\xff00' is not UTF-8 text; expected "
                                "the UTF-8 ids FedJAX writes")
    assert not (tmp_path / "out").exists()


def test_emnist_held_out_fraction_and_caps(converted):
    task = load_task("emnist_tff", {"store_dir": str(converted["emnist"]),
                                    "held_out_fraction": 0.34, "max_train_examples": 2})
    ids = list(task.train.client_ids) + list(task.held_out.client_ids)
    assert sorted(ids) == sorted(EMNIST_TRAIN) and len(task.held_out.client_ids) == 1
    assert task.train.num_examples("train").max() <= 2
    cohort = assemble_cohort(task.train, "train", [0, 1], num_clients=3, padded_examples=2,
                             batch_size=1)
    assert cohort.x.shape == (3, 2, 1, 28, 28)


@pytest.mark.parametrize("spec", ["emnist.py:paper", "shakespeare.py:tff"])
def test_paired_configs_hold_out_clients_on_request(converted, spec):
    """The configs' ``data.held_out_fraction`` (None: none, as the paper's EMNIST) reaches
    the loader: a seeded share of the clients becomes the held-out population."""
    file, variant = spec.split(":")
    config = importlib.import_module(f"configs.{file[:-3]}").get_config(variant)
    config.data.store_dir = str(converted[file.split(".")[0]])
    validate_config(config)
    assert config.data.held_out_fraction is None and build_task(config).held_out is None
    config.data.held_out_fraction = 0.34
    validate_config(config)
    task = build_task(config)
    dataset = file.split(".")[0]
    stored = tff_tasks.open_task_dir(dataset, converted[dataset])[1]["train"]
    assert 1 <= len(task.held_out.client_ids) == max(round(0.34 * len(stored)), 1) < len(stored)
    assert sorted(list(task.train.client_ids) + list(task.held_out.client_ids)) == sorted(
        stored.client_ids)


# --- Shakespeare -----------------------------------------------------------------

def test_shakespeare_matches_embedded_preprocessing(converted):
    task = load_task("shakespeare_tff", {"store_dir": str(converted["shakespeare"])})
    assert list(task.train.client_ids) == sorted(SHAKESPEARE["train"])
    for split in ("train", "test"):
        for client_id in SHAKESPEARE["train"]:
            snippets = SHAKESPEARE[split].get(client_id, [])
            pairs = [shakespeare.snippet_to_sequences(s.encode("utf-8")) for s in snippets]
            rows = _client(task.train, client_id, split)
            expected_x = (np.concatenate([x for x, _ in pairs]) if pairs
                          else np.zeros((0, 80), np.int32))
            np.testing.assert_array_equal(rows["x"], expected_x)
            if pairs:
                np.testing.assert_array_equal(rows["y"], np.concatenate([y for _, y in pairs]))
    helena = _client(task.train, "ALL_S_WELL_HELENA", "train")["x"]
    assert shakespeare.OOV in helena  # non-ASCII bytes map to the OOV id


# --- Stack Overflow --------------------------------------------------------------

def test_stackoverflow_vocabulary_truncation_and_cap(converted):
    so_dir = converted["stackoverflow"]
    vocab = json.loads((so_dir / "vocab.json").read_text())
    assert vocab["words"] == SO_WORDS
    assert (vocab["pad"], vocab["oov"], vocab["bos"], vocab["eos"], vocab["size"]) == (
        0, OOV, BOS, EOS, 7)
    task = load_task("stackoverflow_tff", {"store_dir": str(so_dir)})
    assert task.token_ids == 7  # what validate_task holds the model's vocab_size to
    assert list(task.train.client_ids) == ["00001", "00002", "00003"]
    np.testing.assert_array_equal(task.train.num_examples("train"), [3, 3, 0])
    np.testing.assert_array_equal(task.train.num_examples("test"), [1, 0, 0])
    c1 = _client(task.train, "00001", "train")
    expected = [_sentence(BOS, THE, CAT, SAT, EOS), _sentence(BOS, THE, OOV, CAT, EOS),
                (np.array([BOS] + [THE] * 19), np.array([THE] * 20))]
    for row, (x, y) in enumerate(expected):
        np.testing.assert_array_equal(c1["x"][row], x)
        np.testing.assert_array_equal(c1["y"][row], y)
    assert c1["x"].shape == (3, 20) and c1["x"].dtype == np.int32
    c2 = _client(task.train, "00002", "train")  # first 3 of 5 sentences kept
    np.testing.assert_array_equal(c2["x"][:, :4], [[BOS, OOV, THE, EOS], [BOS, THE, EOS, 0],
                                                   [BOS, SAT, SAT, EOS]])
    x, _ = _sentence(BOS, CAT, OOV, EOS)
    np.testing.assert_array_equal(_client(task.train, "00001", "test")["x"][0], x)
    # Held-out users: the first 80% of their sentences personalize, the rest test.
    assert list(task.held_out.client_ids) == ["00010"]
    assert task.held_out.num_examples("train")[0] == 3  # 4 sentences, capped at 3
    assert task.held_out.num_examples("test")[0] == 1
    capped = load_task("stackoverflow_tff", {"store_dir": str(so_dir), "max_train_examples": 2,
                                             "held_out": False})
    assert capped.held_out is None
    np.testing.assert_array_equal(capped.train.num_examples("train"), [2, 2, 0])
    np.testing.assert_array_equal(_client(capped.train, "00002", "train")["x"], c2["x"][:2])


# --- the store ---------------------------------------------------------------------

def test_train_clients_with_test_keeps_the_authors_population(converted):
    """``train_clients="with_test"``: only the train clients with test rows, the population
    the authors' code trains Stack Overflow on (train ids that are also test ids); the
    default keeps every train client, as the paper counts them."""
    so_dir = str(converted["stackoverflow"])
    every = load_task("stackoverflow_tff", {"store_dir": so_dir})
    for option in ("all", None):
        same = load_task("stackoverflow_tff", {"store_dir": so_dir, "train_clients": option})
        assert list(same.train.client_ids) == list(every.train.client_ids)
    paired = load_task("stackoverflow_tff", {"store_dir": so_dir, "train_clients": "with_test"})
    assert list(paired.train.client_ids) == ["00001"]  # 00002's test split is empty
    np.testing.assert_array_equal(paired.train.num_examples("train"), [3])
    np.testing.assert_array_equal(paired.train.client(0, "train")["x"],
                                  _client(every.train, "00001", "train")["x"])
    assert list(paired.held_out.client_ids) == ["00010"]  # another population: unchanged
    # EMNIST: f0002_11 has no test rows; held-out clients are drawn among those kept.
    emnist = load_task("emnist_tff", {"store_dir": str(converted["emnist"]),
                                      "train_clients": "with_test"})
    assert list(emnist.train.client_ids) == ["f0001_00", "f0003_22"]
    held = load_task("emnist_tff", {"store_dir": str(converted["emnist"]),
                                    "train_clients": "with_test", "held_out_fraction": 0.5})
    assert sorted([*held.train.client_ids, *held.held_out.client_ids]) == ["f0001_00",
                                                                           "f0003_22"]
    # From the paper config, as a run loads it (`--config.data.train_clients=with_test`).
    import importlib

    from flowjax import config as run_config
    config = importlib.import_module("configs.stackoverflow").get_config("paper")
    config.data.store_dir = so_dir
    assert list(run_config.build_task(config).train.client_ids) == ["00001", "00002", "00003"]
    config.data.train_clients = "with_test"
    assert list(run_config.build_task(config).train.client_ids) == ["00001"]
    with pytest.raises(ValueError, match=r"^train_clients='paired': expected one of "
                       r"\['all', 'with_test'\]$"):
        load_task("stackoverflow_tff", {"store_dir": so_dir, "train_clients": "paired"})


def test_store_opens_from_headers_and_offsets_only(converted, monkeypatch):
    calls = []
    real_load = np.load

    def spy(path, *args, **kwargs):
        calls.append(kwargs.get("mmap_mode"))
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(np, "load", spy)
    store = ClientStore(converted["stackoverflow"] / "train")
    assert calls and all(mode == "r" for mode in calls)
    assert store.num_rows("train") == 6 and store.num_rows("test") == 1
    assert store.index_of("00002") == 1
    with pytest.raises(KeyError):
        store.index_of("nobody")


def test_write_store_round_trip_and_atomicity(tmp_path):
    spec = {"x": ((2,), np.int32), "y": ((), np.int32)}
    clients = [("b", {"train": {"x": np.ones((2, 2), np.int32), "y": np.arange(2)}}),
               ("a", {"test": {"x": np.zeros((1, 2), np.int32), "y": [7]}}),
               ("é", {})]
    store = ClientStore(write_store(tmp_path / "s", clients, spec))
    assert list(store.client_ids) == ["b", "a", "é"] and store.index_of("a") == 1
    np.testing.assert_array_equal(store.client(1, "test")["y"], [7])
    assert store.client(2, "train")["x"].shape == (0, 2)

    def failing():
        yield clients[0]
        raise RuntimeError("source broke")

    with pytest.raises(RuntimeError):
        write_store(tmp_path / "t", failing(), spec)
    assert sorted(os.listdir(tmp_path)) == ["s"]  # no half-written store left behind


@pytest.mark.parametrize("x, y, message", [
    ([0.5, 1e39], [3, 4], "train.x.npy: value 1e+39 cannot be stored as float32"),
    ([0.5, 1.0], [3.7, 4], "train.y.npy: value 3.7 cannot be stored as int32"),
    ([0.5, 1.0], [2**32 + 1, 4], "train.y.npy: value 4294967297 cannot be stored as int32"),
    ([0.5, 1.0], [np.nan, 4], "train.y.npy: value nan cannot be stored as int32"),
])
def test_values_the_dtype_cannot_hold_are_refused_not_cast(tmp_path, x, y, message):
    """A silent cast stored 3 for 3.7, wrapped 2**32 + 1 and overflowed 1e39 to inf,
    while meta.json's value ranges (what loaders check) described the values given."""
    spec = {"x": ((), np.float32), "y": ((), np.int32)}
    good = ("a", {"train": {"x": np.array([0.25]), "y": np.array([1])}})
    with pytest.raises(ValueError) as refused:
        write_store(tmp_path / "s", [good, ("b", {"train": {"x": np.array(x),
                                                            "y": np.array(y)}})], spec)
    assert str(refused.value) == f"client 'b': {message} without changing it; expected " \
                                 "values that dtype holds"
    assert os.listdir(tmp_path) == []
    # Values a dtype holds are cast (float64 to float32 rounds), and the ranges are the
    # stored values'.
    store = write_store(tmp_path / "s", [good, ("b", {"train": {"x": np.array([0.1, 2.0]),
                                                                "y": np.array([3.0, 4])}})],
                        spec)
    meta = json.loads((store / "meta.json").read_text())["value_ranges"]["train"]
    assert meta["x"] == {"min": float(np.float32(0.1)), "max": 2.0, "nonfinite": 0,
                         "integral": False}
    assert meta["y"] == {"min": 1, "max": 4, "nonfinite": 0, "integral": True}


def test_missing_or_corrupt_store_is_one_line_error(converted, tmp_path):
    with pytest.raises(ValueError, match="convert.py --dataset=emnist") as info:
        load_task("emnist_tff", {"store_dir": str(tmp_path / "nope")})
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="holds 'emnist'"):
        load_task("shakespeare_tff", {"store_dir": str(converted["emnist"])})
    broken = tmp_path / "broken"
    convert("emnist", _source_of(converted), broken, _format_of(converted))
    with open(broken / "train" / "train.x.npy", "r+b") as f:
        f.truncate(300)
    with pytest.raises(ValueError, match="not a converted store") as info:
        load_task("emnist_tff", {"store_dir": str(broken)})
    assert "\n" not in str(info.value)
    (broken / "train" / "meta.json").write_text("{")
    with pytest.raises(ValueError, match="unreadable meta.json"):
        load_task("emnist_tff", {"store_dir": str(broken)})


def _source_of(converted):
    return json.loads((converted["emnist"] / "task.json").read_text())["origin"].split(":", 1)[1]


def _format_of(converted):
    return json.loads((converted["emnist"] / "task.json").read_text())["origin"].split(":", 1)[0]


def test_msgpack_codec_round_trip():
    arrays = {"x": RNG.random((2, 3), dtype=np.float32), "y": np.array([1, 2], np.int64),
              "tokens": np.array([b"a b", "ü".encode()], object), "n": np.int32(4)}
    back = decode_client(encode_client(arrays))
    assert sorted(back) == sorted(arrays)
    for name, value in arrays.items():
        assert np.asarray(back[name]).dtype == np.asarray(value).dtype
        np.testing.assert_array_equal(back[name], value)


@pytest.mark.parametrize("array", [np.array([b"ab", b"c"]), np.array(["ab", "c"])],
                         ids=["S2", "U2"])
def test_msgpack_codec_refuses_fixed_width_strings_it_could_not_read_back(array, tmp_path):
    """Their dtype name (``bytes16``) is no name ``np.dtype`` reads, in FedJAX's reader
    (``serialization._dtype_from_name``) as in ours: refused in one line, so no client is
    stored that could not be read."""
    with pytest.raises(TypeError, match="not understood"):
        np.dtype(array.dtype.name)
    with pytest.raises(ValueError) as error:
        encode_client({"tokens": array})
    message = str(error.value)
    assert len(message.splitlines()) == 1
    assert f"a {array.dtype} array" in message and "object array of bytes" in message
    with pytest.raises(ValueError, match="cannot FedJAX-encode"):
        write_sqlite(tmp_path / "x.sqlite", {"c": {"tokens": np.array([b"ab"])}})


def test_msgpack_codec_reads_payloads_packed_without_bin_types():
    """msgpack before 1.0 packed bytes as its str type unless told otherwise; FedJAX's
    reader (serialization.py) unpacks the array payloads with raw=True, and so do we."""
    x = np.array([[0.5, -1.0], [2.0, 255.0]], np.float32)  # bytes that are not UTF-8
    tokens = np.array([b"a b", "\u00fc".encode()], object)

    def legacy(code, payload):
        return msgpack.ExtType(code, msgpack.packb(payload, use_bin_type=False))

    blob = zlib.compress(msgpack.packb(
        {"x": legacy(1, (list(x.shape), x.dtype.name, x.tobytes("C"))),
         "tokens": legacy(4, (list(tokens.shape), list(tokens)))}, use_bin_type=False))
    back = decode_client(blob)
    np.testing.assert_array_equal(back["x"], x)
    assert back["x"].dtype == np.float32
    assert list(back["tokens"]) == list(tokens)


def test_h5_clients_are_in_tffs_sorted_order_whatever_the_files_creation_order(tmp_path):
    """TFF's HDF5ClientData sorts the ids of ``examples``; h5py lists a group written with
    ``track_order=True`` in creation order instead, so the reader must sort too."""
    for split in ("train", "test"):
        with h5py.File(tmp_path / f"fed_emnist_{split}.h5", "w") as f:
            examples = f.create_group("examples", track_order=True)
            for client_id in ("f0003_22", "f0001_00", "f0002_11"):
                _emnist_client(examples.create_group(client_id),
                               EMNIST["train"].get(client_id, EMNIST["train"]["f0001_00"]))
        with h5py.File(tmp_path / f"fed_emnist_{split}.h5", "r") as f:
            assert list(f["examples"]) == ["f0003_22", "f0001_00", "f0002_11"]  # as written
    out = convert("emnist", tmp_path, tmp_path / "store", "tff_h5")
    task = load_task("emnist_tff", {"store_dir": str(out)})
    assert list(task.train.client_ids) == ["f0001_00", "f0002_11", "f0003_22"]
    np.testing.assert_array_equal(task.train.num_examples("train"), [3, 0, 2])


def test_h5_read_of_an_unlisted_client_is_no_client_not_damage(tmp_path):
    """Only a name the file lists reads as damage when h5py cannot find it."""
    from flowjax.data.tff_h5 import H5Source
    path = tmp_path / "fed_emnist_train.h5"
    with h5py.File(path, "w") as f:
        _emnist_client(f.create_group("examples").create_group("f0001_00"),
                       EMNIST["train"]["f0001_00"])
    source = H5Source(path, ("label", "pixels"))
    try:
        assert list(source.client_ids()) == ["f0001_00"]
        assert source.read("f0001_00")["label"].shape == (3,)
        with pytest.raises(KeyError, match=r"fed_emnist_train.h5: no client 'f9999_99'"):
            source.read("f9999_99")
    finally:
        source.close()


def test_sqlite_sources_tell_a_missing_client_and_a_misuse_from_damage(tmp_path):
    """An unlisted id is 'no client' and a closed connection is sqlite3's own error: only
    a malformed file reads as 'damaged, download it again'."""
    import lzma

    from flowjax.data import fedjax_sqlite, tff_sqlite

    fixtures = os.path.join(ROOT, "tests", "fixtures")
    fedjax = fedjax_sqlite.SqliteSource(
        os.path.join(fixtures, "fedjax_sqlite", "shakespeare_train.sqlite"),
        fedjax_sqlite.DEFAULT_FEATURE_MAPS["shakespeare"])
    listed = next(fedjax.client_ids())
    with pytest.raises(KeyError, match=r"shakespeare_train.sqlite: no client 'nobody'"):
        fedjax.read("nobody")
    fedjax.close()
    with pytest.raises(sqlite3.ProgrammingError, match="closed database"):
        fedjax.read(listed)

    path = tmp_path / "shakespeare.sqlite"
    with lzma.open(os.path.join(fixtures, "tff_sqlite", "shakespeare.sqlite.lzma")) as f:
        path.write_bytes(f.read())
    db = tff_sqlite.open_database(path)
    tff = tff_sqlite.TffSqliteSource(db, path, "train", tff_sqlite.FEATURES["shakespeare"])
    listed = next(tff.client_ids())
    assert len(tff.read(listed)["snippets"]) > 0
    with pytest.raises(KeyError, match=r"shakespeare.sqlite\[train\]: no client 'nobody'"):
        tff.read("nobody")
    db.close()
    with pytest.raises(sqlite3.ProgrammingError, match="closed database"):
        tff.read(listed)


def test_sources_opened_before_one_that_fails_to_open_are_closed():
    from flowjax.data.tff_h5 import opened

    closed = []

    class Source:
        def __init__(self, path):
            if path == "bad":
                raise ValueError("bad: cannot be read")
            self.path = path

        def close(self):
            closed.append(self.path)

    with pytest.raises(ValueError, match="bad: cannot be read"):
        with opened(Source, {"train": "a", "test": "bad"}):
            pass
    assert closed == ["a"]
    with opened(Source, {"train": "b", "test": "c"}) as sources:
        assert [s.path for s in sources.values()] == ["b", "c"] and closed == ["a"]
    assert sorted(closed) == ["a", "b", "c"]


def test_test_split_of_other_clients_is_refused_and_nothing_is_written(tmp_path):
    """A test file sharing no client with the train file (another download, or ids written
    differently) would leave every client without test rows: one line, no task directory."""
    _write_h5(tmp_path / "fed_emnist_train.h5", EMNIST["train"], _emnist_client)
    _write_h5(tmp_path / "fed_emnist_test.h5", {"g0001_00": EMNIST["test"]["f0001_00"]},
              _emnist_client)
    with pytest.raises(ValueError) as error:
        convert("emnist", tmp_path, tmp_path / "store", "tff_h5")
    message = str(error.value)
    assert len(message.splitlines()) == 1
    assert message.startswith(f"{tmp_path / 'fed_emnist_test.h5'}: none of its 1 clients is a "
                              f"client of {tmp_path / 'fed_emnist_train.h5'}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fed_emnist_test.h5",
                                                          "fed_emnist_train.h5"]


def test_convert_cli(tff_dir, tmp_path):
    script = os.path.join(ROOT, "launch", "convert.py")
    out = tmp_path / "emnist"
    done = forkserver.run([sys.executable, script, "--dataset=emnist", f"--source={tff_dir}",
                           f"--out={out}"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert len(load_task("emnist_tff", {"store_dir": str(out)}).train.client_ids) == 3
    # f9999_99 is in the test file only: said, not silently dropped.
    assert "test clients left out: 1, with no train rows" in done.stdout
    failed = forkserver.run([sys.executable, script, "--dataset=emnist", f"--source={tmp_path}",
                             f"--out={tmp_path / 'x'}"], capture_output=True, text=True,
                            timeout=60)
    assert failed.returncode == 2
    # --format=auto names each format's files when none is there.
    assert failed.stderr.strip().startswith(f"error: no emnist files in {tmp_path}: expected "
                                            "TFF SQLite: emnist_all.sqlite or ")
    assert len(failed.stderr.strip().splitlines()) == 1


def paper_config_on(converted, dataset):
    """configs/<dataset>.py's paper variant on a converted store, one tiny round."""
    import importlib
    config = importlib.import_module(f"configs.{dataset}").get_config("paper")
    config.data.store_dir = str(converted[dataset])
    config.num_rounds = 1
    config.clients_per_round = 2
    config.sgd.update(batch_size=2, epochs=1)
    config.eval.clients = 2
    if dataset == "stackoverflow":  # a narrow LSTM keeps the compile short
        config.model_options.update(embed_dim=8, hidden=16, dense=8)
    return config


def test_a_vocab_size_other_than_the_stores_is_refused(converted):
    from flowjax import config as run_config
    config = paper_config_on(converted, "stackoverflow")
    # The store's 3 words + pad, oov, bos, eos; the paper's 10,004 is refused.
    with pytest.raises(ValueError, match=r"^config.model_options.vocab_size=10004: "
                                         r"expected 7, the token ids stackoverflow_tff "
                                         r"was converted with \(3 words"):
        run_config.build_simulation(config)


# Stack Overflow's run with -m slow (16 s alone): CI keeps its store read client by client
# (test_stackoverflow_*), its vocabulary check above and a Flow client update of the Stack
# Overflow LSTM (test_parity's Stack Overflow check).
@pytest.mark.parametrize("dataset", ["emnist", pytest.param("stackoverflow",
                                                            marks=pytest.mark.slow)])
def test_paper_configs_train_on_converted_files(converted, dataset):
    """configs/<dataset>.py runs end to end on a converted store (one tiny round)."""
    from flowjax import config as run_config
    from flowjax import experiment

    if _format_of(converted) != "tff_h5":
        pytest.skip("one source format is enough for the end-to-end run")
    config = paper_config_on(converted, dataset)
    if dataset == "stackoverflow":
        config.model_options.vocab_size = 7
    result = experiment.run(run_config.build_simulation(config))
    summary = result.summaries["train_clients"]
    assert 0 <= summary.acc_g <= 1 and 0 <= summary.acc_p <= 1
    assert [h["kind"] for h in result.history][0] == "train"


def test_stackoverflow_vocab_size_below_one_is_refused_before_anything_is_written(
        tff_dir, tmp_path):
    out = tmp_path / "so"
    with pytest.raises(ValueError, match=r"^vocab_size must be >= 1 \(the number of "
                                         r"vocabulary words\), got -2$"):
        convert("stackoverflow", tff_dir, out, "tff_h5", vocab_size=-2)
    assert not out.exists()


def test_stackoverflow_vocab_size_above_the_train_words_is_refused(tff_dir, tmp_path):
    """Counted from the train split, a vocabulary is never silently smaller than asked for
    (the store's task.json would record a size its vocab.json does not have)."""
    out = tmp_path / "so"
    with pytest.raises(ValueError, match=r": its train split holds (\d+) distinct words; "
                                         r"expected at least --vocab_size=10000 \(pass "
                                         r"--vocab_size=\1 or fewer, or TFF's "
                                         r"stackoverflow.word_count as --vocab_file\)$"):
        convert("stackoverflow", tff_dir, out, "tff_h5", vocab_size=10000)
    assert not out.exists()


@pytest.mark.parametrize("fraction", [1.5, -3.0, 0.0, 1.0, float("nan")])
def test_stackoverflow_held_out_train_fraction_outside_0_1_is_refused(tff_dir, tmp_path,
                                                                      fraction):
    out = tmp_path / "so"
    with pytest.raises(ValueError, match=r"^held_out_train_fraction must be in \(0, 1\) \(the "
                                         rf"share .* personalization\), got {fraction}$"):
        convert("stackoverflow", tff_dir, out, "tff_h5", held_out_train_fraction=fraction)
    assert not out.exists()


def test_stackoverflow_vocabulary_is_tffs_word_count_file_when_it_is_in_the_source(
        tff_dir, tmp_path):
    """TFF's stackoverflow.word_count (TFF, FedJAX and Reddi et al. take its first V lines)
    sets the vocabulary in file order, not the train split's own counts."""
    import shutil

    source = tmp_path / "src"
    source.mkdir()
    for split in ("train", "test", "held_out"):
        shutil.copy(tff_dir / f"stackoverflow_{split}.h5", source)
    (source / "stackoverflow.word_count").write_text("sat 9\ncat 5\nthe 3\ndog 1\n")
    out = convert("stackoverflow", source, tmp_path / "so", "tff_h5", vocab_size=3)
    vocab = json.loads((out / "vocab.json").read_text())
    assert vocab["words"] == ["sat", "cat", "the"]
    assert vocab["source"] == "first words of stackoverflow.word_count"
    task = load_task("stackoverflow_tff", {"store_dir": str(out)})
    x, _ = _sentence(BOS, 3, 2, 1, EOS)  # "the cat sat" under the file's ids
    np.testing.assert_array_equal(_client(task.train, "00001", "train")["x"][0], x)
    # A file that is not TFF's format fails in one line before anything is written.
    (source / "stackoverflow.word_count").write_text("sat 9\nnot a count line\n")
    with pytest.raises(ValueError, match=r"stackoverflow.word_count:2: 'not a count line' "
                                         r"is not 'word count'"):
        convert("stackoverflow", source, tmp_path / "so2", "tff_h5", vocab_size=3)
    assert not (tmp_path / "so2").exists()


def test_stackoverflow_words_are_split_on_single_spaces_as_tff_does():
    """tf.strings.split(sep=' '): an empty word (two spaces, an empty sentence) is out of
    vocabulary, and a tab is part of a word."""
    from flowjax.data.tff_h5 import WordIds

    ids = WordIds(["a"])  # a = 1, oov 2, bos 3, eos 4
    np.testing.assert_array_equal(ids.sentence(b"a  a", length=5), [3, 1, 2, 1, 4, 0])
    np.testing.assert_array_equal(ids.sentence(b"", length=5), [3, 2, 4, 0, 0, 0])
    np.testing.assert_array_equal(ids.sentence(b"a\ta", length=5), [3, 2, 4, 0, 0, 0])


def test_another_vocabulary_size_is_a_command_line_override():
    """README: a store converted with --vocab_size=V needs --config.model_options.vocab_size=V+4."""
    from launch import cli
    assert cli.config_args_error(["train.py", "--config=configs/stackoverflow.py:paper",
                                  "--config.model_options.vocab_size=7"]) is None
