"""Reading IDX files, the format of MNIST, Fashion-MNIST, KMNIST and EMNIST downloads.

The format, as LeCun's MNIST page (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE
FORMAT") defines it: a magic number of four bytes, the first two 0, the third the data
type (0x08 unsigned byte, 0x09 signed byte, 0x0B short, 0x0C int, 0x0D float, 0x0E
double), the fourth the number of dimensions; then one 4-byte size per dimension, MSB
first (big-endian); then the data in C order, multi-byte values big-endian. Image files
are ``0x00000803`` (``uint8 [n, rows, cols]``), label files ``0x00000801`` (``uint8
[n]``). Files may be gzip-compressed (``.gz``), as distributed.
"""

from __future__ import annotations

import gzip
import os

import numpy as np

# Type byte -> big-endian numpy dtype.
DTYPES = {0x08: np.dtype(">u1"), 0x09: np.dtype(">i1"), 0x0B: np.dtype(">i2"),
          0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def parse_idx(raw: bytes, where: str = "<bytes>") -> np.ndarray:
    """The array an IDX file's bytes hold (native byte order).

    Raises:
      ValueError: a bad magic number, or fewer or more data bytes than the header says
        (one line naming ``where``).
    """
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in DTYPES:
        raise ValueError(f"{where} is not an IDX file: magic bytes {raw[:4].hex() or 'none'}, "
                         "expected 0000 then a type byte (08 = uint8) and a dimension count")
    dtype, ndim = DTYPES[raw[2]], raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{where}: truncated header ({len(raw)} bytes, expected {header})")
    shape = tuple(int(d) for d in np.frombuffer(raw, ">u4", ndim, offset=4))
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(f"{where}: {len(raw) - header} data bytes, expected {expected} for "
                         f"shape {shape} of {dtype.name}")
    return np.frombuffer(raw, dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def read_idx(path: str) -> np.ndarray:
    """The array of an IDX file, gzip-compressed when its name ends in ``.gz``."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as handle:
            raw = handle.read()
    except (OSError, EOFError) as error:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"cannot read {path}: {error}") from None
    return parse_idx(raw, os.path.basename(path))


__all__ = ["DTYPES", "parse_idx", "read_idx"]
