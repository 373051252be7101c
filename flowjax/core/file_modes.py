"""Permissions of files written through a temporary name.

``tempfile.mkstemp`` creates 0600 files and ``mkdtemp`` 0700 folders, private to their
owner. A result moved into place (a ``results.json``, a converted task directory) should
be as open as a plain ``open()`` or ``mkdir()`` would have made it under the umask, so a
group sharing a dataset folder can read it.
"""

from __future__ import annotations

import os


def umask() -> int:
    """The process's umask (read by setting it and setting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def as_if_created(path: str | os.PathLike) -> None:
    """Gives the file or folder ``path`` the permissions ``open()`` (0666) or ``mkdir()``
    (0777) would have given it under the umask, keeping its special bits: a folder made
    in a setgid folder inherits the bit (and with it the shared group its files get)."""
    base = 0o777 if os.path.isdir(path) else 0o666
    os.chmod(path, (os.stat(path).st_mode & 0o7000) | (base & ~umask()))
