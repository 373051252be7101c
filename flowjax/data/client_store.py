"""An on-disk per-client store: random access to any client without loading the others.

Layout of a store directory (format ``flowjax-client-store``, version 1):

* ``meta.json``: ``format``, ``version``, ``splits`` (ordered), ``features``
  (``{name: {"dtype": numpy dtype string, "shape": per-example shape}}``), ``num_clients``,
  ``num_rows`` (per split), ``source`` (free-form provenance), ``value_ranges``
  (``{split: {feature: {"min", "max", "nonfinite", "integral"}}}``: the smallest and
  largest finite value, the count of NaN/inf values and whether every value is a whole
  number, taken while writing, so that loaders check a store against a model in O(1);
  stores written before it existed lack the key). Written last, so a store without it
  is incomplete.
* ``client_ids.npy``: ``S<width>`` UTF-8 ids in store order.
* ``client_order.npy``: ``int64 [num_clients]``, the argsort of the ids (lookup by id).
* ``offsets.npy``: ``int64 [num_splits, num_clients + 1]``; in split ``s`` (position in
  ``splits``) client ``i`` owns rows ``offsets[s, i]:offsets[s, i + 1]``.
* ``<split>.<feature>.npy``: every client's rows of that feature, concatenated.

Every array is a plain ``.npy`` opened with ``np.load(mmap_mode='r')``, so opening reads
headers only and a client read touches just its own rows.
"""

from __future__ import annotations

import array
import bisect
import collections.abc
import json
import os
import pathlib
import struct
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from flowjax.core import durable
from flowjax.data.federated import SPLITS

FORMAT = "flowjax-client-store"
VERSION = 1

Spec = Mapping[str, tuple[tuple[int, ...], np.dtype]]
# One client as the writer receives it: (client id, {split: {feature: rows}}).
ClientRecord = tuple[str, Mapping[str, Mapping[str, np.ndarray]]]

# Feature files are written before their row count is known, so each reserves a fixed
# header that is rewritten in place at the end; 256 bytes fit any shape we produce and
# keep the data 64-byte aligned as numpy's own writer does.
_HEADER_BYTES = 256
_NPY_MAGIC = b"\x93NUMPY\x01\x00"


class StoreError(ValueError):
    """A store directory is missing, incomplete or inconsistent."""


def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    text = repr({"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                 "fortran_order": False, "shape": tuple(int(s) for s in shape)})
    body_len = _HEADER_BYTES - len(_NPY_MAGIC) - 2
    if len(text) + 1 > body_len:
        raise ValueError(f"npy header for shape {shape} does not fit {_HEADER_BYTES} bytes")
    return _NPY_MAGIC + struct.pack("<H", body_len) + (text.ljust(body_len - 1) + "\n").encode(
        "latin1")


class _Range:
    """Running min, max, non-finite count and integrality of one feature's values."""

    def __init__(self) -> None:
        self.low: Any = None
        self.high: Any = None
        self.nonfinite, self.integral = 0, True

    def update(self, rows: np.ndarray) -> None:
        values = np.asarray(rows).reshape(-1)
        if np.issubdtype(values.dtype, np.floating):
            finite = np.isfinite(values)
            self.nonfinite += int(values.size - np.count_nonzero(finite))
            values = values[finite]
            self.integral = self.integral and bool(np.all(values == np.round(values)))
        if values.size:
            low, high = values.min().item(), values.max().item()
            self.low = low if self.low is None else min(self.low, low)
            self.high = high if self.high is None else max(self.high, high)

    def as_json(self) -> dict[str, Any]:
        return {"min": self.low, "max": self.high, "nonfinite": self.nonfinite,
                "integral": self.integral}


class _GrowingNpy:
    """A ``.npy`` file appended to row by row; the header is fixed up on close."""

    def __init__(self, path: pathlib.Path, shape: tuple[int, ...], dtype: np.dtype):
        self.path, self.shape, self.dtype, self.rows = path, tuple(shape), np.dtype(dtype), 0
        self.file = open(path, "wb")
        self.file.write(_npy_header(self.dtype, (0,) + self.shape))

    def append(self, rows: np.ndarray) -> np.ndarray:
        """Writes ``rows`` in the file's dtype; returns them as written.

        Raises:
          ValueError: a shape other than the file's, or values the dtype cannot hold (a
            fraction or an out-of-range integer for an integer dtype, a finite value that
            overflows a float one): a silent cast would store other data than given.
        """
        given = np.asarray(rows)
        with np.errstate(over="ignore", invalid="ignore"):  # refused below, in one line
            stored = np.ascontiguousarray(given.astype(self.dtype, casting="unsafe"))
        if stored.shape[1:] != self.shape:
            raise ValueError(f"{self.path.name}: rows of shape {stored.shape[1:]}, "
                             f"expected {self.shape}")
        changed = None  # where the cast changed a value
        if given.dtype != self.dtype and self.dtype.kind in "biu":
            changed = stored != given
        elif (given.dtype != self.dtype and self.dtype.kind in "fc"
              and given.dtype.kind in "fciub"):
            changed = np.isfinite(given) & ~np.isfinite(stored)
        if changed is not None and changed.any():
            value = given[changed][0].item()
            raise ValueError(f"{self.path.name}: value {value!r} cannot be stored as "
                             f"{self.dtype} without changing it; expected values that "
                             f"dtype holds")
        self.file.write(stored.tobytes())
        self.rows += len(stored)
        return stored

    def close(self) -> None:
        self.file.seek(0)
        self.file.write(_npy_header(self.dtype, (self.rows,) + self.shape))
        self.file.close()


def _rows_of(client_id: str, split: str, features: Mapping[str, np.ndarray],
             spec: Spec) -> int:
    counts = {name: len(features[name]) for name in spec if name in features}
    if counts and (len(counts) != len(spec) or len(set(counts.values())) != 1):
        raise ValueError(f"client {client_id!r} split {split!r}: features {sorted(spec)} "
                         f"must all be present with equal row counts, got {counts}")
    return next(iter(counts.values())) if counts else 0


def _write_ids(tmp: pathlib.Path, ids_file: pathlib.Path, count: int, width: int) -> None:
    ids = np.lib.format.open_memmap(tmp / "client_ids.npy", mode="w+",
                                    dtype=f"S{max(width, 1)}", shape=(count,))
    with open(ids_file, "rb") as f:
        for i in range(count):
            (n,) = struct.unpack("<I", f.read(4))
            ids[i] = f.read(n)
    ids.flush()
    order = np.argsort(ids, kind="stable").astype(np.int64)
    if len(order) > 1 and np.any(ids[order[1:]] == ids[order[:-1]]):
        raise ValueError("client ids must be unique")
    np.save(tmp / "client_order.npy", order)
    del ids


def write_store(path: str | os.PathLike, clients: Iterable[ClientRecord], spec: Spec, *,
                splits: Sequence[str] = SPLITS, source: Mapping[str, Any] | None = None,
                overwrite: bool = False) -> pathlib.Path:
    """Streams clients into a new store at ``path``, atomically.

    Memory holds one client plus eight bytes per client and split for the offsets:
    rows go straight to disk, and the store appears at ``path`` only once complete.

    Args:
      path: the store directory to create.
      clients: ``(client_id, {split: {feature: rows}})`` in the order to store; a
        missing split or an empty dict means no rows.
      spec: ``{feature: (per-example shape, dtype)}``.
      splits: the split names, in order.
      source: provenance recorded in ``meta.json``.
      overwrite: replace an existing directory at ``path``.

    Returns:
      The store path.
    """
    path = pathlib.Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists (pass overwrite=True to replace it)")
    if path.exists():  # only ever replace a store: anything else is left alone
        try:
            read_meta(path)
        except StoreError as e:
            raise StoreError(f"{path} is not a client store ({e}): refusing to replace "
                             "it") from None
    with durable.replacing_folder(path) as tmp:
        _fill_store(tmp, clients, spec, splits, source or {})
    return path


def _fill_store(tmp: pathlib.Path, clients: Iterable[ClientRecord], spec: Spec,
                splits: Sequence[str], source: Mapping[str, Any]) -> None:
    spec = {name: (tuple(shape), np.dtype(dtype)) for name, (shape, dtype) in spec.items()}
    files = {(s, n): _GrowingNpy(tmp / f"{s}.{n}.npy", shape, dtype)
             for s in splits for n, (shape, dtype) in spec.items()}
    sizes = {s: array.array("q") for s in splits}
    ranges = {(s, n): _Range() for s in splits for n in spec}
    count, width = 0, 0
    ids_file = tmp / "ids.tmp"
    try:
        with open(ids_file, "wb") as ids_out:
            for client_id, per_split in clients:
                unknown = set(per_split) - set(splits)
                if unknown:
                    raise ValueError(f"client {client_id!r}: unknown splits {sorted(unknown)}")
                for split in splits:
                    features = per_split.get(split, {})
                    sizes[split].append(_rows_of(client_id, split, features, spec))
                    for name in spec:
                        if name in features:
                            try:
                                stored = files[split, name].append(features[name])
                            except ValueError as error:
                                raise ValueError(f"client {client_id!r}: {error}") from None
                            # The ranges of what is stored, which loaders check.
                            ranges[split, name].update(stored)
                encoded = str(client_id).encode("utf-8")
                ids_out.write(struct.pack("<I", len(encoded)) + encoded)
                count, width = count + 1, max(width, len(encoded))
    finally:  # on an error too: the temporary folder is then removed whole
        for f in files.values():
            f.close()
    _write_ids(tmp, ids_file, count, width)
    ids_file.unlink()
    offsets = np.zeros((len(splits), count + 1), np.int64)
    for k, split in enumerate(splits):
        np.cumsum(np.frombuffer(sizes[split], np.int64), out=offsets[k, 1:])
    np.save(tmp / "offsets.npy", offsets)
    meta = {"format": FORMAT, "version": VERSION, "splits": list(splits),
            "features": {n: {"dtype": d.str, "shape": list(s)} for n, (s, d) in spec.items()},
            "num_clients": count,
            "num_rows": {s: int(offsets[k, -1]) for k, s in enumerate(splits)},
            "value_ranges": {s: {n: ranges[s, n].as_json() for n in spec} for s in splits},
            "source": dict(source)}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))


class ClientIds(collections.abc.Sequence):
    """Client ids read lazily from a memory-mapped ``S<width>`` array."""

    def __init__(self, encoded: np.ndarray):
        self._encoded = encoded

    def __len__(self) -> int:
        return len(self._encoded)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [bytes(b).decode("utf-8") for b in self._encoded[index]]
        return bytes(self._encoded[index]).decode("utf-8")


class _SortedIds(collections.abc.Sequence):
    """The ids in sorted order, as a sequence ``bisect`` can search."""

    def __init__(self, encoded: np.ndarray, order: np.ndarray):
        self._encoded, self._order = encoded, order

    def __len__(self) -> int:
        return len(self._order)

    def __getitem__(self, k: int) -> bytes:
        return bytes(self._encoded[self._order[k]])


def _load(path: pathlib.Path) -> np.ndarray:
    if not path.is_file():
        raise StoreError(f"missing {path.name}")
    try:
        return np.load(path, mmap_mode="r")
    except (ValueError, OSError) as e:
        raise StoreError(f"unreadable {path.name}: {e}") from None


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``meta.json`` of a store; raises ``StoreError`` if it is not one."""
    meta_path = pathlib.Path(path) / "meta.json"
    if not meta_path.is_file():
        raise StoreError(f"no meta.json in {path}")
    try:
        meta = json.loads(meta_path.read_text())
    except (ValueError, OSError) as e:
        raise StoreError(f"unreadable meta.json: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise StoreError(f"meta.json is not a {FORMAT}")
    if meta.get("version") != VERSION:
        raise StoreError(f"store version {meta.get('version')}, this reader needs {VERSION}")
    return meta


class ClientStore:
    """A store opened read-only; implements ``FederatedData``.

    Opening reads ``meta.json`` and ``.npy`` headers only; ``num_examples`` reads the
    offsets (eight bytes per client); ``client`` reads that client's rows.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        self.meta = read_meta(self.path)
        self.split_names: tuple[str, ...] = tuple(self.meta["splits"])
        self._spec = {name: (tuple(f["shape"]), np.dtype(f["dtype"]))
                      for name, f in self.meta["features"].items()}
        encoded = _load(self.path / "client_ids.npy")
        self._order = _load(self.path / "client_order.npy")
        self._offsets = _load(self.path / "offsets.npy")
        self.client_ids = ClientIds(encoded)
        self._sorted_ids = _SortedIds(encoded, self._order)
        self._features = {(s, n): _load(self.path / f"{s}.{n}.npy")
                          for s in self.split_names for n in self._spec}
        self._check_consistent()

    def _check_consistent(self) -> None:
        n = int(self.meta["num_clients"])
        if (len(self.client_ids) != n or len(self._order) != n
                or self._offsets.shape != (len(self.split_names), n + 1)):
            raise StoreError(f"index files disagree with meta.json ({n} clients)")
        for k, split in enumerate(self.split_names):
            rows = int(self._offsets[k, -1])
            for name, (shape, dtype) in self._spec.items():
                a = self._features[split, name]
                if a.shape != (rows,) + shape or a.dtype != dtype:
                    raise StoreError(f"{split}.{name}.npy is {a.dtype} {a.shape}, "
                                     f"expected {dtype} {(rows,) + shape}")

    def __len__(self) -> int:
        return len(self.client_ids)

    @property
    def value_ranges(self) -> dict[str, Any] | None:
        """``meta.json``'s value ranges (see the module docstring); None for a store
        written before they were recorded."""
        return self.meta.get("value_ranges")

    @property
    def example_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return dict(self._spec)

    def _split_index(self, split: str) -> int:
        if split not in self.split_names:
            raise KeyError(f"unknown split {split!r}; expected one of {list(self.split_names)}")
        return self.split_names.index(split)

    def num_rows(self, split: str) -> int:
        """Total rows of ``split``, from the offsets alone."""
        return int(self._offsets[self._split_index(split), -1])

    def num_examples(self, split: str) -> np.ndarray:
        return np.diff(self._offsets[self._split_index(split)]).astype(np.int64)

    def client(self, index: int, split: str) -> dict[str, np.ndarray]:
        k = self._split_index(split)
        if not -len(self) <= index < len(self):
            raise IndexError(f"client index {index} out of range for {len(self)} clients")
        index %= len(self)
        lo, hi = int(self._offsets[k, index]), int(self._offsets[k, index + 1])
        # A copy, so callers never hold the memory map open through a returned array.
        return {name: np.array(self._features[split, name][lo:hi]) for name in self._spec}

    def index_of(self, client_id: str) -> int:
        """The store index of ``client_id`` (binary search on the sorted ids)."""
        key = client_id.encode("utf-8")
        k = bisect.bisect_left(self._sorted_ids, key)
        if k == len(self._sorted_ids) or self._sorted_ids[k] != key:
            raise KeyError(f"no client {client_id!r} in {self.path}")
        return int(self._order[k])


class _MappedIds(collections.abc.Sequence):
    def __init__(self, ids: Sequence[str], indices: np.ndarray):
        self._ids, self._indices = ids, indices

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._ids[int(i)] for i in self._indices[index]]
        return self._ids[int(self._indices[index])]


class StoreView:
    """Some clients of a store, optionally capped per split; implements ``FederatedData``.

    Args:
      store: the underlying store.
      indices: store indices of the clients, in view order (default: all).
      caps: ``{split: n}`` keeps each client's first ``n`` rows of that split.
    """

    def __init__(self, store: ClientStore, indices: Sequence[int] | None = None,
                 caps: Mapping[str, int | None] | None = None):
        self.store = store
        self._indices = (np.arange(len(store), dtype=np.int64) if indices is None
                         else np.asarray(indices, np.int64))
        self._caps = {s: int(c) for s, c in (caps or {}).items() if c is not None}
        for split, cap in self._caps.items():
            if cap < 1:
                raise ValueError(f"cap of split {split!r} must be >= 1, got {cap}")
        self.client_ids = _MappedIds(store.client_ids, self._indices)

    @property
    def example_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return self.store.example_spec

    @property
    def value_ranges(self) -> dict[str, Any] | None:
        """The whole store's value ranges (a superset of this view's)."""
        return self.store.value_ranges

    def num_examples(self, split: str) -> np.ndarray:
        sizes = self.store.num_examples(split)[self._indices]
        cap = self._caps.get(split)
        return sizes if cap is None else np.minimum(sizes, cap)

    def client(self, index: int, split: str) -> dict[str, np.ndarray]:
        rows = self.store.client(int(self._indices[index]), split)
        cap = self._caps.get(split)
        return rows if cap is None else {n: a[:cap] for n, a in rows.items()}
