"""A source file damaged inside, reported as one line naming the file.

h5py and sqlite3 report damage found mid-read (a broken B-tree, a malformed page) in
messages that name no file, and h5py reports some of it as ``KeyError``; a conversion
reads several files at once, so the message must say which one to download again.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from flowjax.core.checks import first_line


@contextlib.contextmanager
def reading(name: str, *errors: type[BaseException]) -> Iterator[None]:
    """Re-raises ``errors`` inside the block as a one-line ``ValueError`` naming ``name``.

    Use it only around reads of what the file's own listing says is there: a ``KeyError``
    is then damage, not a missing name.
    """
    try:
        yield
    except errors as error:
        # KeyError's str() quotes its message; keep the message itself.
        text = (str(error.args[0]).splitlines()[0] if isinstance(error, KeyError) and error.args
                and str(error.args[0]) else first_line(error))
        raise ValueError(f"{name}: cannot be read ({text}); the file is damaged, download it "
                         "again") from None
