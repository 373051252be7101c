"""A source file damaged inside, reported as one line naming the file.

h5py and sqlite3 report damage found mid-read (a broken B-tree, a malformed page) in
messages that name no file, and h5py reports some of it as ``KeyError``; a conversion
reads several files at once, so the message must say which one to download again.
"""

from __future__ import annotations

import contextlib
import sqlite3
from typing import Iterator

# sqlite3.DatabaseError's subclasses that say nothing of the file: a misuse (closed
# connection, bad parameter) or the database's state (locked, a disk I/O error).
SQLITE_NOT_DAMAGE = (sqlite3.ProgrammingError, sqlite3.OperationalError)


@contextlib.contextmanager
def reading(name: str, *errors: type[BaseException],
            not_damage: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Re-raises ``errors`` inside the block as a one-line ``ValueError`` naming ``name``.

    Use it only around reads of what the file's own listing says is there: a ``KeyError``
    is then damage, not a missing name. ``not_damage`` errors pass through as they are.
    """
    try:
        yield
    except not_damage:
        raise
    except errors as error:
        # KeyError's str() quotes its message; keep the message itself.
        message = str(error.args[0] if isinstance(error, KeyError) and error.args else error)
        text = next((line for line in message.splitlines() if line.strip()),
                    type(error).__name__)
        raise ValueError(f"{name}: cannot be read ({text}); the file is damaged, download it "
                         "again") from None


def reading_sqlite(name: str) -> contextlib.AbstractContextManager[None]:
    """``reading`` for an SQLite file: a malformed page is damage, a misuse is not."""
    return reading(name, sqlite3.DatabaseError, not_damage=SQLITE_NOT_DAMAGE)
