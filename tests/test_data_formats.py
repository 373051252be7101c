"""The dataset files users download convert to identical stores, whatever their format.

The fixtures under ``tests/fixtures/`` were written by each format's own tool (see
``tests/fixtures/README.md``): TFF SQLite with TensorFlow's ``tf.train.Example``, FedJAX
SQLite with FedJAX 0.0.17's ``SQLiteFederatedDataBuilder``, TFF h5 with h5py, all from
``tests/fixtures/content.py``.
"""

import json
import lzma
import os
import shutil
import sqlite3
import struct

import numpy as np
import pytest

pytest.importorskip("h5py")

from flowjax.data import load_task, shakespeare  # noqa: E402
from flowjax.data import tff_sqlite  # noqa: E402
from flowjax.data.fedjax_sqlite import write_sqlite  # noqa: E402
from flowjax.data.tff_sqlite import ProtoError, fixed_len, parse_example  # noqa: E402
from flowjax.models import get_model  # noqa: E402
from flowjax.validation import validate_task  # noqa: E402
from launch.convert import convert, detect_format  # noqa: E402
from tests.fixtures import content  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
FORMATS = ("tff_sqlite", "tff_h5", "fedjax_sqlite")
DATASETS = ("emnist", "shakespeare", "stackoverflow")
SO_OPTIONS = {"vocab_size": 12, "max_sentences": 2}


def _convert(dataset, fmt, out, **options):
    if dataset == "stackoverflow":
        options = {**SO_OPTIONS, **options}
    return convert(dataset, os.path.join(FIXTURES, fmt), out, fmt, **options)


def _tree(root):
    """``{relative path: bytes}`` of every file under ``root``."""
    files = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, root)] = f.read()
    return files


def _without_origin(tree):
    """The tree with the provenance fields (which name the source folder) taken out."""
    out = dict(tree)
    for path, data in tree.items():
        if path.endswith(".json") and path != "vocab.json":
            meta = json.loads(data)
            meta.pop("origin", None)
            meta.get("source", {}).pop("origin", None)
            out[path] = json.dumps(meta, sort_keys=True).encode()
    return out


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    return {(d, f): _convert(d, f, root / f / d) for d in DATASETS for f in FORMATS}


@pytest.mark.parametrize("dataset", DATASETS)
def test_every_format_gives_byte_identical_stores(stores, dataset):
    reference = _tree(stores[dataset, "tff_sqlite"])
    assert any(p.endswith(".npy") for p in reference)
    for fmt in ("tff_h5", "fedjax_sqlite"):
        other = _tree(stores[dataset, fmt])
        assert sorted(other) == sorted(reference)
        for path in reference:
            if path.endswith(".npy") or path == "vocab.json":
                assert other[path] == reference[path], (fmt, path)  # byte for byte
        assert _without_origin(other) == _without_origin(reference)


def _rows(task, client_id, split):
    return task.train.client(list(task.train.client_ids).index(client_id), split)


def test_emnist_store_holds_the_pixels_and_labels_as_downloaded(stores):
    task = load_task("emnist_tff", {"store_dir": str(stores["emnist", "tff_sqlite"])})
    assert list(task.train.client_ids) == list(content.EMNIST["train"])  # TFF's sorted order
    for split in ("train", "test"):
        for client_id in content.EMNIST["train"]:
            rows = _rows(task, client_id, split)
            raw = content.EMNIST[split][client_id]
            np.testing.assert_array_equal(rows["x"], raw["pixels"])  # 1.0 = background, as TFF
            np.testing.assert_array_equal(rows["y"], raw["label"])
    meta = json.loads((stores["emnist", "tff_sqlite"] / "task.json").read_text())
    assert meta["test_only_clients"] == 1  # f0003_33
    validate_task(task, get_model("emnist_cnn"))


def test_shakespeare_and_stackoverflow_use_the_h5_preprocessing(stores):
    task = load_task("shakespeare_tff", {"store_dir": str(stores["shakespeare", "tff_sqlite"])})
    for client_id, features in content.SHAKESPEARE["train"].items():
        pairs = [shakespeare.snippet_to_sequences(s) for s in features["snippets"]]
        rows = _rows(task, client_id, "train")
        np.testing.assert_array_equal(rows["x"], np.concatenate([x for x, _ in pairs]))
        np.testing.assert_array_equal(rows["y"], np.concatenate([y for _, y in pairs]))
    so_dir = stores["stackoverflow", "tff_sqlite"]
    vocab = json.loads((so_dir / "vocab.json").read_text())
    # Train counts: list 4, a 3, is 2, sort 2 (a tie broken by byte order).
    assert vocab["words"][:4] == ["list", "a", "is", "sort"]
    task = load_task("stackoverflow_tff", {"store_dir": str(so_dir)})
    assert list(task.held_out.client_ids) == ["00000030"]  # TFF's "heldout" split
    np.testing.assert_array_equal(task.train.num_examples("train"), [2, 2])  # capped at 2
    words = {w: i + 1 for i, w in enumerate(vocab["words"])}
    first = _rows(task, "00000010", "train")["x"][0]
    expected = [vocab["bos"]] + [words.get(w, vocab["oov"]) for w in
                                 "how do i sort a list".split()] + [vocab["eos"]]
    np.testing.assert_array_equal(first[:len(expected)], expected)


@pytest.mark.parametrize("fmt", FORMATS)
def test_emnist_digits_only_in_every_format(fmt, tmp_path, stores):
    out = _convert("emnist", fmt, tmp_path / "digits", only_digits=True)
    task = load_task("emnist_tff", {"store_dir": str(out)})
    assert list(task.train.client_ids) == list(content.EMNIST_DIGITS["train"])
    np.testing.assert_array_equal(_rows(task, "f0002_07", "train")["y"],
                                  content.EMNIST_DIGITS["train"]["f0002_07"]["label"])
    validate_task(task, get_model("emnist_cnn", num_classes=10))
    reference = _convert("emnist", "tff_sqlite", tmp_path / "reference", only_digits=True)
    assert _without_origin(_tree(out)) == _without_origin(_tree(reference))


def _decompress(name, folder):
    with lzma.open(os.path.join(FIXTURES, "tff_sqlite", name + ".lzma")) as f:
        (folder / name).write_bytes(f.read())
    return folder / name


def test_decompressed_sqlite_equals_the_lzma_download_and_source_is_untouched(stores, tmp_path):
    before = _tree(os.path.join(FIXTURES, "tff_sqlite"))
    source = tmp_path / "cache"
    source.mkdir()
    _decompress("emnist_all.sqlite", source)
    fmt, line = detect_format("emnist", source)
    assert (fmt, line) == ("tff_sqlite", f"found TFF SQLite emnist_all.sqlite in {source}")
    out = convert("emnist", source, tmp_path / "out")
    assert _without_origin(_tree(out)) == _without_origin(_tree(stores["emnist", "tff_sqlite"]))
    # The .lzma was decompressed next to the output, then removed; the source is as it was.
    assert _tree(os.path.join(FIXTURES, "tff_sqlite")) == before
    assert sorted(os.listdir(tmp_path)) == ["cache", "out"]


def _copy_tff_sqlite(src, dst, order):
    """A TFF SQLite file with ``src``'s rows (real tf.train.Example blobs) inserted client by
    client in ``order``."""
    with sqlite3.connect(src) as a, sqlite3.connect(dst) as b:
        for (sql,) in a.execute("SELECT sql FROM sqlite_master WHERE sql IS NOT NULL"):
            b.execute(sql)
        for client_id in order:
            b.executemany("INSERT INTO examples VALUES (?, ?, ?)", a.execute(
                "SELECT * FROM examples WHERE client_id = ? ORDER BY rowid", (client_id,)))
            b.executemany("INSERT INTO client_metadata VALUES (?, ?, ?)", a.execute(
                "SELECT * FROM client_metadata WHERE client_id = ?", (client_id,)))
    a.close()
    b.close()


def test_client_order_follows_the_source(tmp_path, stores):
    # TFF lists a split's clients sorted, whatever the rows' order in the file.
    original = _decompress("emnist_all.sqlite", tmp_path)
    shuffled = tmp_path / "shuffled"
    shuffled.mkdir()
    _copy_tff_sqlite(original, shuffled / "emnist_all.sqlite",
                     ["f0002_07", "f0000_14", "f0003_33", "f0001_41"])
    out = convert("emnist", shuffled, tmp_path / "tff_out")
    assert _without_origin(_tree(out)) == _without_origin(_tree(stores["emnist", "tff_sqlite"]))
    # FedJAX lists them ORDER BY rowid: the order they were written in.
    fedjax = tmp_path / "fedjax"
    fedjax.mkdir()
    order = ["f0002_07", "f0000_14", "f0001_41"]
    for split in ("train", "test"):
        write_sqlite(fedjax / f"federated_emnist_{split}.sqlite",
                     {c: content.EMNIST[split][c] for c in order if c in content.EMNIST[split]})
    task = load_task("emnist_tff", {"store_dir": str(convert("emnist", fedjax,
                                                             tmp_path / "fedjax_out"))})
    assert list(task.train.client_ids) == order
    np.testing.assert_array_equal(_rows(task, "f0002_07", "train")["y"],
                                  content.EMNIST["train"]["f0002_07"]["label"])


_FEDJAX_ROWS = ("SELECT client_id, typeof(client_id), data, num_examples FROM federated_data "
                "ORDER BY rowid")


@pytest.mark.parametrize("name", [*content.fedjax_files(), "edge_cases.sqlite"])
def test_flowjax_fedjax_writer_writes_the_rows_fedjax_0_0_17_writes(tmp_path, name):
    # The loaders' tests write their FedJAX files with flowjax's writer; these files come
    # from FedJAX's SQLiteFederatedDataBuilder (make_fedjax_sqlite.py), the edge cases
    # among them: a client with no examples, a non-ASCII id.
    edge = name == "edge_cases.sqlite"
    theirs = os.path.join(FIXTURES, "fedjax_edge" if edge else "fedjax_sqlite", name)
    clients = content.EDGE_CASES if edge else content.fedjax_files()[name]
    write_sqlite(tmp_path / name, clients)
    with sqlite3.connect(theirs) as a, sqlite3.connect(tmp_path / name) as b:
        expected, got = a.execute(_FEDJAX_ROWS).fetchall(), b.execute(_FEDJAX_ROWS).fetchall()
    a.close()
    b.close()
    assert [row[0] for row in expected] == [c.encode("utf-8") for c in clients]
    assert got == expected  # ids, their BLOB type, zlib(msgpack) blobs, counts: byte for byte


# --- tf.train.Example wire format ---------------------------------------------------

def _varint(n):
    n &= (1 << 64) - 1
    out = b""
    while True:
        byte, n = n & 0x7F, n >> 7
        out += bytes([byte | (0x80 if n else 0)])
        if not n:
            return out


def _len(field, payload):
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _example(features):
    entries = b"".join(_len(1, _len(1, k.encode()) + _len(2, v)) for k, v in features.items())
    return _len(1, entries)


def test_wire_decoder_packed_unpacked_negative_and_unknown_fields():
    packed_floats = _len(2, _len(1, struct.pack("<3f", 0.5, 1.0, -2.25)))
    unpacked_floats = _len(2, b"".join(_varint(1 << 3 | 5) + struct.pack("<f", v)
                                       for v in (0.5, 1.0)))
    packed_ints = _len(3, _len(1, _varint(7) + _varint(-3)))
    unpacked_ints = _len(3, _varint(1 << 3 | 0) + _varint(-1))
    bytes_list = _len(1, _len(1, b"to be") + _len(1, "ü".encode()))
    unknown = _varint(9 << 3 | 0) + _varint(5)  # a field the decoder does not know
    blob = _example({"a": packed_floats, "b": unpacked_floats, "c": packed_ints,
                     "d": unpacked_ints, "e": bytes_list}) + unknown
    parsed = parse_example(blob)
    assert parsed["a"][0] == "float"
    np.testing.assert_array_equal(parsed["a"][1], np.array([0.5, 1.0, -2.25], np.float32))
    np.testing.assert_array_equal(parsed["b"][1], np.array([0.5, 1.0], np.float32))
    assert parsed["c"][0] == "int64" and parsed["c"][1].tolist() == [7, -3]
    assert parsed["d"][1].tolist() == [-1]
    assert parsed["e"] == ("bytes", [b"to be", "ü".encode()])
    spec = {"a": ("float", (3,)), "c": ("int64", (2,))}
    assert fixed_len(parsed, spec)["c"].tolist() == [7, -3]
    with pytest.raises(ProtoError, match="feature 'a' is 3 float value"):
        fixed_len(parsed, {"a": ("float", (28, 28))})
    with pytest.raises(ProtoError, match="no feature 'pixels'"):
        fixed_len(parsed, {"pixels": ("float", (28, 28))})
    with pytest.raises(ProtoError, match="truncated"):
        parse_example(blob[:20])
    # Malformed in ways a parser must name, not trip over: a Feature list sent as a varint,
    # a map key that is not UTF-8 (protobuf's string fields are UTF-8).
    with pytest.raises(ProtoError, match=r"^Feature field 3 with wire type 0: expected a "
                                         r"length-delimited list$"):
        parse_example(_example({"a": _varint(3 << 3 | 0) + _varint(5)}))
    with pytest.raises(ProtoError, match=r"^feature map key b'\\xff\\xfe' is not UTF-8$"):
        parse_example(_len(1, _len(1, _len(1, b"\xff\xfe") + _len(2, b""))))
    # An unknown field of a Feature, of any wire type, is skipped.
    assert parse_example(_example({"a": _varint(9 << 3 | 0) + _varint(5) + packed_ints})
                         )["a"][1].tolist() == [7, -3]


def test_wire_decoder_reads_every_tensorflow_serialized_fixture_row(tmp_path):
    db = tff_sqlite.open_database(_decompress("stackoverflow.sqlite", tmp_path))
    rows = db.execute("SELECT split_name, client_id, serialized_example_proto FROM examples "
                      "ORDER BY rowid").fetchall()
    db.close()
    splits = {"train": "train", "test": "test", "heldout": "held_out"}
    seen = {}
    for split_name, client_id, blob in rows:
        k = seen.setdefault((split_name, client_id), 0)
        seen[split_name, client_id] = k + 1
        expected = content.STACKOVERFLOW[splits[split_name]][client_id]
        parsed = parse_example(blob)
        assert sorted(parsed) == sorted(expected)
        for name, values in expected.items():
            kind, got = parsed[name]
            assert kind == ("int64" if name == "score" else "bytes")
            assert list(got) == [values[k]]
    assert len(rows) == sum(len(c["tokens"]) for s in content.STACKOVERFLOW.values()
                            for c in s.values())


def test_detect_format_prefers_tff_sqlite_and_says_so(tmp_path):
    for fmt in ("tff_h5", "tff_sqlite"):
        for name in os.listdir(os.path.join(FIXTURES, fmt)):
            if name.startswith(("fed_emnist_train", "fed_emnist_test", "emnist_all")):
                shutil.copy(os.path.join(FIXTURES, fmt, name), tmp_path)
    fmt, line = detect_format("emnist", tmp_path)
    assert fmt == "tff_sqlite"
    assert line == (f"found TFF SQLite emnist_all.sqlite.lzma in {tmp_path} (also complete: "
                    "TFF h5; --format picks another)")
    assert detect_format("emnist", tmp_path, "tff_h5")[0] == "tff_h5"
    with pytest.raises(ValueError, match=r"^FedJAX SQLite emnist files in .*: found none, "
                                         r"missing federated_emnist_train.sqlite"):
        detect_format("emnist", tmp_path, "fedjax_sqlite")


def test_readme_names_every_file_convert_reads():
    import re

    from launch.convert import expected_files

    with open(os.path.join(os.path.dirname(FIXTURES), os.pardir, "README.md")) as f:
        readme = f.read()
    # `shakespeare_{train,test}.sqlite` names both files.
    names = set(re.findall(r"`([\w.*]+)`", readme))
    for head, choices, tail in re.findall(r"([\w.]*)\{([\w,]+)\}([\w.]*)", readme):
        names.update(head + c + tail for c in choices.split(","))
    for dataset in DATASETS:
        for fmt in FORMATS:
            for options in expected_files(dataset, fmt) + expected_files(dataset, fmt, True):
                assert any(n in names or n in readme for n in options), (fmt, options)
