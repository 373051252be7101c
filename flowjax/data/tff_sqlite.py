"""Reads TFF's SQLite federated files (what ``tff.simulation.datasets`` downloads since 2021).

``tff.simulation.datasets.{emnist,shakespeare,stackoverflow}.load_data()`` download
``emnist_all.sqlite.lzma``, ``shakespeare.sqlite.lzma`` and ``stackoverflow.sqlite.lzma``
(the whole SQLite file, LZMA-compressed; TFF decompresses it into its cache as
``<name>.sqlite``) and read them with ``SqlClientData``. Both the ``.lzma`` as downloaded
and the decompressed ``.sqlite`` are read here, without TensorFlow.

Checked against TFF's source (``google-parfait/tensorflow-federated`` at commit
``63f73da486b2``, ``tensorflow_federated/python/simulation/datasets/``):

* ``sql_client_data_utils.py`` lines 202-210: the tables
  ``examples(split_name TEXT, client_id TEXT, serialized_example_proto BLOB)`` and
  ``client_metadata(client_id TEXT, split_name TEXT, num_examples INTEGER)``; lines 39-54:
  each row of ``examples`` is one serialized ``tf.train.Example``, floats as a
  ``float_list``, integers as an ``int64_list``, strings as a one-item ``bytes_list``.
* ``sql_client_data.py`` lines 83-86 and 130-131: a split's client ids are the sorted
  distinct ``client_id`` of ``client_metadata`` with that ``split_name``; lines 141-148:
  a client's examples are ``SELECT serialized_example_proto FROM examples WHERE
  client_id = ? AND split_name = ?`` (read here ``ORDER BY rowid``, the order SQLite
  returns them in, as FedJAX's ``TFFSQLiteClientsIterator`` does).
* ``emnist.py`` lines 31-32 and 107-122: ``pixels`` ``FixedLenFeature((28, 28), float32)``
  (1.0 = background), ``label`` ``FixedLenFeature((), int64)``; splits ``all_train`` /
  ``all_test`` (62 classes) and ``digits_only_train`` / ``digits_only_test``.
* ``shakespeare.py`` lines 29 and 81-88: ``snippets`` ``FixedLenFeature((), string)``;
  splits ``train`` / ``test``.
* ``stackoverflow.py`` lines 33-38 and 118-130: ``tokens`` (and ``title``, ``tags``,
  ``type``, ``creation_date``) ``FixedLenFeature((), string)``, ``score`` int64; splits
  ``train`` / ``heldout`` / ``test``.

``tf.train.Example`` is decoded from the protobuf wire format by :func:`parse_example`
(``tensorflow/core/example/example.proto`` and ``feature.proto``): ``Example.features = 1``;
``Features.feature = 1`` a ``map<string, Feature>`` (entries: key = 1, value = 2);
``Feature`` oneof ``bytes_list = 1``, ``float_list = 2``, ``int64_list = 3``; each list's
``value = 1`` (floats and int64s packed, unpacked also accepted as protobuf parsers do).
The decoded examples go through the same per-dataset encoders as TFF's h5 files
(:mod:`flowjax.data.tff_h5`), so both sources give identical stores.
"""

from __future__ import annotations

import contextlib
import functools
import lzma
import os
import pathlib
import shutil
import sqlite3
import tempfile
from typing import Any, Iterator, Mapping

import numpy as np

from flowjax.data import source_damage, tff_h5

# dataset -> (file stem, {our split: TFF split_name}); EMNIST's depends on only_digits.
FILE_STEMS = {"emnist": "emnist_all", "shakespeare": "shakespeare",
              "stackoverflow": "stackoverflow"}
# FixedLenFeature specs of the features we read: name -> (kind, shape).
FEATURES: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {
    "emnist": {"pixels": ("float", (28, 28)), "label": ("int64", ())},
    "shakespeare": {"snippets": ("bytes", ())},
    "stackoverflow": {"tokens": ("bytes", ())},
}


def split_names(kind: str, only_digits: bool = False) -> dict[str, str]:
    """``{our split: TFF split_name}`` of ``kind`` (see the module docstring)."""
    if kind == "emnist":
        prefix = "digits_only" if only_digits else "all"
        return {"train": f"{prefix}_train", "test": f"{prefix}_test"}
    if kind == "shakespeare":
        return {"train": "train", "test": "test"}
    if kind == "stackoverflow":
        return {"train": "train", "test": "test", "held_out": "heldout"}
    raise ValueError(f"unknown dataset {kind!r}; expected one of {list(tff_h5.KINDS)}")


# ------------------------------------------------------------ protobuf wire format


class ProtoError(ValueError):
    """A blob that is not a well-formed serialized ``tf.train.Example``."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise ProtoError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise ProtoError("varint longer than 10 bytes")


def _fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """``(field number, wire type, value)`` of every field of one message; the value is
    an int (varint), bytes (length-delimited, fixed32, fixed64)."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
            if len(value) != size:
                raise ProtoError("truncated length-delimited field")
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, pos = buf[pos:pos + size], pos + size
            if len(value) != size:
                raise ProtoError("truncated fixed-width field")
        else:
            raise ProtoError(f"unsupported wire type {wire}")
        yield number, wire, value


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _packed_varints(buf: bytes) -> list[int]:
    values, pos = [], 0
    while pos < len(buf):
        value, pos = _varint(buf, pos)
        values.append(_signed64(value))
    return values


def _feature(buf: bytes) -> tuple[str, Any]:
    """One ``Feature``: ``("bytes", [bytes])``, ``("float", float32 [n])`` or
    ``("int64", int64 [n])``; an empty ``Feature`` is ``("none", [])``."""
    kind, value = "none", []
    for number, outer_wire, payload in _fields(buf):
        if number not in (1, 2, 3):
            continue  # a field this decoder does not know, skipped as protobuf does
        if outer_wire != 2:
            raise ProtoError(f"Feature field {number} with wire type {outer_wire}: expected "
                             "a length-delimited list")
        items_bytes, floats, ints = [], [], []
        for inner, wire, item in _fields(payload):
            if inner != 1:
                continue
            if number == 1 and wire == 2:
                items_bytes.append(bytes(item))
            elif number == 2 and wire == 2:
                floats.append(np.frombuffer(item, "<f4"))
            elif number == 2 and wire == 5:
                floats.append(np.frombuffer(item, "<f4"))
            elif number == 3 and wire == 2:
                ints.extend(_packed_varints(item))
            elif number == 3 and wire == 0:
                ints.append(_signed64(item))
            else:
                raise ProtoError(f"Feature field {number} with wire type {wire}")
        if number == 1:
            kind, value = "bytes", items_bytes
        elif number == 2:
            kind = "float"
            value = (np.concatenate(floats) if floats else np.zeros(0, "<f4")).astype(np.float32)
        elif number == 3:
            kind, value = "int64", np.array(ints, np.int64)
    return kind, value


def parse_example(blob: bytes) -> dict[str, tuple[str, Any]]:
    """A serialized ``tf.train.Example`` as ``{feature name: (kind, values)}``.

    Raises:
      ProtoError: the blob is not a well-formed ``Example``.
    """
    features: dict[str, tuple[str, Any]] = {}
    for number, wire, payload in _fields(bytes(blob)):
        if number != 1 or wire != 2:
            continue
        for entry_number, entry_wire, entry in _fields(payload):
            if entry_number != 1 or entry_wire != 2:
                continue
            key, value = None, ("none", [])
            for field, field_wire, item in _fields(entry):
                if field == 1 and field_wire == 2:
                    try:
                        key = bytes(item).decode("utf-8")
                    except UnicodeDecodeError:
                        raise ProtoError(f"feature map key {bytes(item)[:40]!r} is not "
                                         "UTF-8") from None
                elif field == 2 and field_wire == 2:
                    value = _feature(item)
            if key is None:
                raise ProtoError("feature map entry without a key")
            features[key] = value  # a repeated map key: the last one wins, as in protobuf
    return features


def fixed_len(features: Mapping[str, tuple[str, Any]],
              spec: Mapping[str, tuple[str, tuple[int, ...]]]) -> dict[str, Any]:
    """``tf.io.FixedLenFeature`` semantics: each spec'd feature present, of its kind,
    with ``prod(shape)`` values; returns numpy arrays (one bytes object for a
    ``bytes`` scalar)."""
    out = {}
    for name, (kind, shape) in spec.items():
        if name not in features:
            raise ProtoError(f"no feature {name!r} (has {sorted(features)})")
        got_kind, values = features[name]
        size = int(np.prod(shape))
        if got_kind != kind or len(values) != size:
            raise ProtoError(f"feature {name!r} is {len(values)} {got_kind} value(s), "
                             f"expected {size} {kind}")
        out[name] = values[0] if kind == "bytes" else np.asarray(values).reshape(shape)
    return out


# ------------------------------------------------------------------ the files


def open_database(path: str | os.PathLike) -> sqlite3.Connection:
    """``path`` opened read-only; one-line ``ValueError`` unless it has TFF's tables."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such SQLite file: {path}")
    db = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True)
    try:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        columns = {r[1] for r in db.execute("PRAGMA table_info(examples)")}
    except sqlite3.DatabaseError as e:
        db.close()
        raise ValueError(f"{path}: not a SQLite file ({e})") from None
    needed = {"split_name", "client_id", "serialized_example_proto"}
    if not {"examples", "client_metadata"} <= tables or not needed <= columns:
        db.close()
        raise ValueError(f"{path}: not a TFF SQLite file: expected tables 'examples' "
                         f"{sorted(needed)} and 'client_metadata', found tables {sorted(tables)}")
    return db


class TffSqliteSource:
    """One split of a TFF SQLite file as a ``ClientSource`` (see ``tff_h5.ClientSource``).

    Clients are listed as TFF lists them (sorted distinct ids of the split in
    ``client_metadata``); a client's examples are decoded into TFF's feature names.
    """

    def __init__(self, db: sqlite3.Connection, path: str | os.PathLike, split_name: str,
                 spec: Mapping[str, tuple[str, tuple[int, ...]]]):
        self.name = f"{path}[{split_name}]"
        self._db, self._split, self._spec = db, split_name, dict(spec)
        # A malformed page found mid-read; sqlite3's message names no file.
        self._intact = functools.partial(source_damage.reading_sqlite, self.name)

    def client_ids(self) -> Iterator[str]:
        with self._intact():
            rows = self._db.execute("SELECT DISTINCT client_id FROM client_metadata "
                                    "WHERE split_name = ?", (self._split,)).fetchall()
        yield from sorted(str(r[0]) for r in rows)

    def __contains__(self, client_id: str) -> bool:
        with self._intact():
            return self._db.execute("SELECT 1 FROM client_metadata WHERE split_name = ? AND "
                                    "client_id = ? LIMIT 1", (self._split, client_id)
                                    ).fetchone() is not None

    def read(self, client_id: str) -> dict[str, np.ndarray]:
        with self._intact():
            rows = self._db.execute(
                "SELECT serialized_example_proto FROM examples WHERE split_name = ? AND "
                "client_id = ? ORDER BY rowid", (self._split, client_id)).fetchall()
        if not rows and client_id not in self:  # a listed client may hold no examples
            raise KeyError(f"{self.name}: no client {client_id!r}")
        parsed = []
        for k, (blob,) in enumerate(rows):
            try:
                parsed.append(fixed_len(parse_example(blob), self._spec))
            except ProtoError as e:
                raise ValueError(f"{self.name}: client {client_id!r} example {k}: not a valid "
                                 f"tf.train.Example ({e})") from None
        out = {}
        for name, (kind, shape) in self._spec.items():
            if kind == "bytes":
                column = np.empty(len(parsed), object)
                column[:] = [p[name] for p in parsed]
            else:
                dtype = np.float32 if kind == "float" else np.int64
                column = (np.stack([p[name] for p in parsed]) if parsed
                          else np.zeros((0,) + shape, dtype))
            out[name] = column
        return out


def tff_sqlite_file(kind: str, source_dir: str | os.PathLike) -> pathlib.Path:
    """``<stem>.sqlite`` in ``source_dir``, else ``<stem>.sqlite.lzma``."""
    if kind not in FILE_STEMS:
        raise ValueError(f"unknown dataset {kind!r}; expected one of {list(tff_h5.KINDS)}")
    source_dir = pathlib.Path(source_dir)
    for name in (f"{FILE_STEMS[kind]}.sqlite", f"{FILE_STEMS[kind]}.sqlite.lzma"):
        if (source_dir / name).is_file():
            return source_dir / name
    raise FileNotFoundError(f"missing TFF SQLite file: {source_dir / FILE_STEMS[kind]}.sqlite "
                            f"or .sqlite.lzma")


@contextlib.contextmanager
def decompressed(path: pathlib.Path, scratch_dir: pathlib.Path) -> Iterator[pathlib.Path]:
    """``path`` itself, or for a ``.lzma`` file its decompressed copy in a temporary
    folder under ``scratch_dir``, removed afterwards (the source folder is never written)."""
    if path.suffix != ".lzma":
        yield path
        return
    scratch_dir.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".lzma-", dir=scratch_dir))
    try:
        target = tmp / path.stem
        try:
            with lzma.open(path) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (lzma.LZMAError, EOFError) as e:
            raise ValueError(f"{path}: not a complete LZMA file ({e})") from None
        yield target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert_tff_sqlite(kind: str, source_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                       only_digits: bool = False, **options: Any) -> pathlib.Path:
    """Converts TFF's SQLite file of ``kind`` in ``source_dir`` into a task directory.

    Args:
      kind: ``emnist``, ``shakespeare`` or ``stackoverflow``.
      source_dir: directory holding e.g. ``emnist_all.sqlite.lzma`` or ``emnist_all.sqlite``.
      out_dir: the task directory to create.
      only_digits: EMNIST: the ``digits_only_*`` splits.
      **options: passed to :func:`flowjax.data.tff_h5.convert_sources`.
    """
    path = tff_sqlite_file(kind, source_dir)
    splits = split_names(kind, only_digits)
    out_dir = pathlib.Path(out_dir)
    with decompressed(path, out_dir.parent) as database:
        db = open_database(database)
        try:
            with source_damage.reading_sqlite(str(path)):
                known = {r[0] for r in db.execute(
                    "SELECT DISTINCT split_name FROM client_metadata")}
            missing = [s for s in splits.values() if s not in known]
            if missing:
                raise ValueError(f"{path}: no split {missing[0]!r} in client_metadata "
                                 f"(has {sorted(known)})")
            sources = {ours: TffSqliteSource(db, path, theirs, FEATURES[kind])
                       for ours, theirs in splits.items()}
            return tff_h5.convert_sources(kind, sources, out_dir, origin=f"tff_sqlite:{source_dir}",
                                          num_classes=tff_h5.EMNIST_DIGITS if only_digits else None,
                                          **options)
        finally:
            db.close()
