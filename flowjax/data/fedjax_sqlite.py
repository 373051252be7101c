"""Reads FedJAX's SQLite federated files and converts them into client stores.

FedJAX's schema: ``federated_data(client_id BLOB PRIMARY KEY, data BLOB, num_examples
INTEGER)``; ``data`` is ``zlib.compress(msgpack(dict of numpy arrays))``
(FedJAX 0.0.17, ``fedjax/core/sqlite_federated_data.py`` lines 31-52, the
``SQLiteFederatedData`` docstring, and 246-260, ``SQLiteFederatedDataBuilder.add_many``).
Clients are read in FedJAX's order, ``ORDER BY rowid`` (line 134, its ``client_ids()``),
i.e. the order they were written in. Ids are BLOBs as FedJAX writes them; TEXT ids, which
its reader passes on unchanged, read the same.

The stored keys are the raw ones (``fedjax/datasets/emnist.py`` lines 40-74, ``load_split``:
``pixels`` ``float32 [N, 28, 28]`` and ``label`` ``int32``; ``shakespeare.py``:
``snippets``; ``stackoverflow.py``: ``tokens``, ``title``, ``tags``, ``type``,
``creation_date``, ``score``). FedJAX's ``x``/``y`` exist only after its
``preprocess_batch`` (EMNIST lines 119-125: ``x = 1 - pixels``): the raw keys are read here and go
through the same encoders as TFF's files, so a FedJAX file and a TFF file holding the same
clients under the same ids give the same store. FedJAX's own EMNIST and Shakespeare files
carry a hash prefix on each id (``<16 hex>:f0000_14``,
``tests/fixtures/make_fedjax_sqlite.py``), so their clients are listed, and a seed samples
them, in another order than TFF's. File names: ``federated_emnist_{train,test}.sqlite``
(``federated_emnist_digitsonly_*`` digits only), ``shakespeare_{train,test}.sqlite``,
``stackoverflow_{train,held_out,test}.sqlite``.

The msgpack ndarray encoding implemented here (FedJAX follows flax's):

* a numeric array ``a`` is ``ExtType(1, packb((a.shape, a.dtype.name,
  a.tobytes('C'))))``, ``use_bin_type=True``;
* an object array of byte strings (text features such as ``tokens``) is
  ``ExtType(4, packb((a.shape, [bytes, ...])))``, items in C order; ``str`` items are
  stored as UTF-8 bytes;
* a numpy scalar is ``ExtType(3, ...)``, same payload as code 1, zero-dimensional;
* dict keys are ``str``.

A fixed-width string array (numpy ``S``/``U``) is refused: its ``dtype.name``
(``bytes48``) is no name ``np.dtype`` reads back, in FedJAX's reader as in ours, so a file
holding one could be written but never read; text goes in an object array of bytes.
:func:`encode_client` and :func:`decode_client` are inverses; ``decode_client`` also
reads dict keys stored as bytes.
"""

from __future__ import annotations

import functools
import os
import pathlib
import sqlite3
import zlib
from typing import Any, Iterator, Mapping

import msgpack
import numpy as np

from flowjax.data import source_damage, tff_h5

EXT_NDARRAY = 1
EXT_NPSCALAR = 3
EXT_OBJECT_NDARRAY = 4

# FedJAX's stored keys, keyed by TFF's names (the names the encoders read).
DEFAULT_FEATURE_MAPS: dict[str, dict[str, str]] = {
    "emnist": {"pixels": "pixels", "label": "label"},
    "shakespeare": {"snippets": "snippets"},
    "stackoverflow": {"tokens": "tokens"},
}


def _pack_ndarray(a: np.ndarray) -> bytes:
    return msgpack.packb((list(a.shape), a.dtype.name, a.tobytes("C")), use_bin_type=True)


def _default(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, np.ndarray) and obj.dtype == object:
        items = [x.encode("utf-8") if isinstance(x, str) else bytes(x) for x in obj.reshape(-1)]
        return msgpack.ExtType(EXT_OBJECT_NDARRAY,
                               msgpack.packb((list(obj.shape), items), use_bin_type=True))
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "SU":
        raise ValueError(f"cannot FedJAX-encode a {obj.dtype} array: its dtype name "
                         f"{obj.dtype.name!r} does not read back; expected a numeric array, "
                         "or text as an object array of bytes")
    if isinstance(obj, np.ndarray):
        return msgpack.ExtType(EXT_NDARRAY, _pack_ndarray(obj))
    if isinstance(obj, np.generic):
        return msgpack.ExtType(EXT_NPSCALAR, _pack_ndarray(np.asarray(obj)))
    raise TypeError(f"cannot msgpack-encode {type(obj).__name__}")


def _ext_hook(code: int, data: bytes) -> Any:
    if code in (EXT_NDARRAY, EXT_NPSCALAR):
        # raw=True as FedJAX reads it: a payload packed without bin types (msgpack < 1.0
        # defaults) holds the array bytes as a msgpack str, which must not be UTF-8 decoded.
        shape, name, raw = msgpack.unpackb(data, raw=True)
        name = name.decode() if isinstance(name, bytes) else name
        array = np.frombuffer(raw, np.dtype(name)).reshape(shape).copy()
        return array[()] if code == EXT_NPSCALAR else array
    if code == EXT_OBJECT_NDARRAY:
        shape, items = msgpack.unpackb(data, raw=True)
        array = np.empty(len(items), object)
        array[:] = [bytes(x) for x in items]
        return array.reshape(shape)
    raise ValueError(f"unknown msgpack ext type {code}")


def encode_client(arrays: Mapping[str, np.ndarray]) -> bytes:
    """``zlib(msgpack(arrays))`` in the encoding described in the module docstring."""
    return zlib.compress(msgpack.packb(dict(arrays), default=_default, use_bin_type=True))


def decode_client(blob: bytes) -> dict[str, np.ndarray]:
    """The inverse of :func:`encode_client`."""
    data = msgpack.unpackb(zlib.decompress(blob), ext_hook=_ext_hook, raw=False,
                           strict_map_key=False)
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in data.items()}


def write_sqlite(path: str | os.PathLike, clients: Mapping[str, Mapping[str, np.ndarray]]) -> None:
    """Writes a FedJAX-schema file (used by tests and to export small datasets)."""
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE federated_data (client_id BLOB NOT NULL PRIMARY KEY, "
                   "data BLOB NOT NULL, num_examples INTEGER NOT NULL)")
        for client_id, arrays in clients.items():
            n = len(next(iter(arrays.values()))) if arrays else 0
            db.execute("INSERT INTO federated_data VALUES (?, ?, ?)",
                       (client_id.encode("utf-8"), encode_client(arrays), n))
    db.close()


def _id_values(client_id: str) -> tuple[bytes, str]:
    """The id as a BLOB and as TEXT: SQLite never finds one by the other."""
    return client_id.encode("utf-8"), client_id


def _decoded_id(file: str, raw: bytes) -> str:
    """A BLOB client id as text; FedJAX's ids are UTF-8 (its writer encodes str ids)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{file}: client id {raw!r} is not UTF-8 text; expected the UTF-8 "
                         f"ids FedJAX writes") from None


class SqliteSource:
    """One FedJAX SQLite file as a ``ClientSource``; reads one row per client."""

    def __init__(self, path: str | os.PathLike, feature_map: Mapping[str, str]):
        self.name = str(path)
        if not pathlib.Path(path).is_file():
            raise FileNotFoundError(f"no such SQLite file: {path}")
        self._db = sqlite3.connect(pathlib.Path(path).resolve().as_uri() + "?mode=ro", uri=True)
        self._feature_map = dict(feature_map)
        # A malformed page found mid-read; sqlite3's message names no file.
        self._intact = functools.partial(source_damage.reading_sqlite, self.name)
        try:
            self._db.execute("SELECT client_id, data FROM federated_data LIMIT 1").fetchall()
        except sqlite3.DatabaseError as e:
            self._db.close()
            raise ValueError(f"{path}: not a FedJAX federated_data file ({e})") from None

    def client_ids(self) -> Iterator[str]:
        # Its own cursor, so that reads by id can interleave with this listing.
        with self._intact():
            for (client_id,) in self._db.cursor().execute(
                    "SELECT client_id FROM federated_data ORDER BY rowid"):
                # FedJAX writes BLOB ids; its reader passes on TEXT ones as they are, so a
                # file written with TEXT ids is read here too.
                yield (client_id if isinstance(client_id, str)
                       else _decoded_id(self.name, bytes(client_id)))

    def __contains__(self, client_id: str) -> bool:
        with self._intact():
            return self._db.execute("SELECT 1 FROM federated_data WHERE client_id IN (?, ?)",
                                    _id_values(client_id)).fetchone() is not None

    def read(self, client_id: str) -> dict[str, np.ndarray]:
        with self._intact():
            row = self._db.execute("SELECT data FROM federated_data WHERE client_id IN (?, ?)",
                                   _id_values(client_id)).fetchone()
        if row is None:
            raise KeyError(f"{self.name}: no client {client_id!r}")
        try:
            arrays = decode_client(row[0])
        except (zlib.error, ValueError, TypeError, msgpack.UnpackException) as e:
            raise ValueError(f"{self.name}: client {client_id!r}: corrupt data blob "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                             "download the file again") from None
        missing = [v for v in self._feature_map.values() if v not in arrays]
        if missing:
            raise ValueError(f"{self.name}: client {client_id!r} lacks features {missing} "
                             f"(has {sorted(arrays)}): not FedJAX's {list(self._feature_map)} "
                             "layout")
        return {tff_name: arrays[name] for tff_name, name in self._feature_map.items()}

    def close(self) -> None:
        self._db.close()


def fedjax_file_names(kind: str, only_digits: bool = False) -> dict[str, str]:
    """``{split: file name}`` as FedJAX downloads them (see the module docstring)."""
    if kind == "emnist":
        stem = "federated_emnist_digitsonly" if only_digits else "federated_emnist"
        return {s: f"{stem}_{s}.sqlite" for s in ("train", "test")}
    if kind == "shakespeare":
        return {s: f"shakespeare_{s}.sqlite" for s in ("train", "test")}
    if kind == "stackoverflow":
        return {s: f"stackoverflow_{s}.sqlite" for s in ("train", "test", "held_out")}
    raise ValueError(f"unknown dataset {kind!r}; expected one of {list(tff_h5.KINDS)}")


def fedjax_sqlite_files(kind: str, path: str | os.PathLike,
                        only_digits: bool = False) -> dict[str, pathlib.Path]:
    """The FedJAX file of each split in directory ``path``: ``*<split>.sqlite``.

    EMNIST files with ``digit`` in their name are the digits-only variant.
    """
    splits = ("train", "test", "held_out") if kind == "stackoverflow" else ("train", "test")
    found = {}
    for split in splits:
        candidates = [p for p in sorted(pathlib.Path(path).glob(f"*{split}.sqlite"))
                      if kind in p.name and not (split == "test" and "held_out" in p.name)
                      and (kind != "emnist" or ("digit" in p.name) == only_digits)]
        if len(candidates) != 1:
            raise FileNotFoundError(f"expected one {kind} {split} file '*{kind}*{split}.sqlite' "
                                    f"in {path}, found {[p.name for p in candidates]}")
        found[split] = candidates[0]
    return found


def convert_fedjax_sqlite(kind: str, path: str | os.PathLike, out_dir: str | os.PathLike,
                          feature_map: Mapping[str, str] | None = None, *,
                          only_digits: bool = False, **options: Any) -> pathlib.Path:
    """Converts FedJAX's SQLite files of ``kind`` in directory ``path`` to a task directory.

    Args:
      kind: ``emnist``, ``shakespeare`` or ``stackoverflow``.
      path: directory holding e.g. ``shakespeare_train.sqlite`` and ``shakespeare_test.sqlite``.
      out_dir: the task directory to create.
      feature_map: TFF feature name -> FedJAX key (default :data:`DEFAULT_FEATURE_MAPS`).
      only_digits: EMNIST: the digits-only files.
      **options: passed to :func:`flowjax.data.tff_h5.convert_sources`.
    """
    if kind not in tff_h5.KINDS:
        raise ValueError(f"unknown dataset {kind!r}; expected one of {list(tff_h5.KINDS)}")
    feature_map = dict(feature_map or DEFAULT_FEATURE_MAPS[kind])
    files = fedjax_sqlite_files(kind, path, only_digits)
    with tff_h5.opened(lambda file: SqliteSource(file, feature_map), files) as sources:
        return tff_h5.convert_sources(kind, sources, out_dir, origin=f"fedjax_sqlite:{path}",
                                      num_classes=tff_h5.EMNIST_DIGITS if only_digits else None,
                                      **options)
