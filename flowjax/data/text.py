"""Text values of federated sources (snippets, sentences) as the bytes they tokenize to."""

from __future__ import annotations

from typing import Any

import numpy as np


def text_bytes(value: Any, what: str = "text") -> bytes:
    """``value`` as bytes: UTF-8 for ``str``, itself for ``bytes``-like values.

    TFF's h5 and SQLite files store text as bytes; a number where text belongs (a numeric
    ``tokens`` or ``snippets`` feature) is refused, since ``bytes(5)`` would silently read
    as five NUL bytes.

    Raises:
      ValueError: ``value`` is not text, in one line naming it (``what`` says what it is).
    """
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    raise ValueError(f"{what} {shown} ({type(value).__name__}): expected text (bytes or str)")


def text_rows(values: Any, feature: str) -> np.ndarray:
    """A client's text feature as its 1-D array of rows (one snippet or sentence each).

    TFF's h5 files hold one text per row (``HDF5ClientData`` slices each feature along
    its first axis, and the tokenizers take one string per element); a feature of
    another shape is refused rather than flattened, which would read a ``[2, 2]`` array
    as four sentences.

    Raises:
      ValueError: ``values`` is not 1-D, in one line naming ``feature`` and its shape.
    """
    rows = np.asarray(values)
    if rows.ndim != 1:
        raise ValueError(f"{feature!r} of shape {rows.shape}: expected one text per row, "
                         "shape [n] (TFF's layout)")
    return rows
