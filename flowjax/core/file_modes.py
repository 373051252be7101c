"""Permissions of files written through a temporary name.

``tempfile.mkstemp`` creates 0600 files and ``mkdtemp`` 0700 folders, private to their
owner. A result moved into place (a ``results.json``, a converted task directory) should
be as open as a plain ``open()`` or ``mkdir()`` would have made it under the umask, so a
group sharing a dataset folder can read it.
"""

from __future__ import annotations

import os


def umask() -> int:
    """The process's umask.

    Read from ``/proc/self/status`` (Linux 4.7+) where it can be: setting the umask to
    read it opens a window in which another thread (orbax's checkpoint writers) would
    create world-writable files. Elsewhere, set and set back.
    """
    try:
        with open("/proc/self/status", "rb") as status:  # its Name: line may be any bytes
            for line in status:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def as_if_created(path: str | os.PathLike) -> None:
    """Gives the file or folder ``path`` the permissions ``open()`` (0666) or ``mkdir()``
    (0777) would have given it under the umask, keeping its special bits: a folder made
    in a setgid folder inherits the bit (and with it the shared group its files get)."""
    base = 0o777 if os.path.isdir(path) else 0o666
    os.chmod(path, (os.stat(path).st_mode & 0o7000) | (base & ~umask()))
