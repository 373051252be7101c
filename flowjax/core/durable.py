"""Making written files durable: ``fsync`` of files, folders and whole trees, and a
folder filled beside its path and moved into place.

A rename or a new file is only durable once its folder is synced too; libraries that
write checkpoints (orbax 0.12) rename without either, so a power loss right after a
checkpoint "completed" can leave it empty. Code that then drops the means to recover
the previous state (the disk store's undo log) must first make the new one durable.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import secrets
import shutil
import tempfile
from typing import Iterator

from flowjax.core import file_modes


def fsync_path(path: str) -> None:
    """Flushes the file or folder ``path`` (its data, or its entries) to disk.

    A folder on a file system that cannot sync folders (some FUSE and network mounts
    answer EINVAL) is left as it is: there is nothing more to ask of it.
    """
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    except OSError as error:
        if not (error.errno == errno.EINVAL and os.path.isdir(path)):
            raise
    finally:
        os.close(descriptor)


def _raise(error: OSError) -> None:
    raise error


def fsync_tree(root: str) -> None:
    """``fsync_path`` of every file and folder under the folder ``root``, then of
    ``root``'s parent (which holds ``root``'s own entry). Links are not followed.

    Raises:
      OSError: ``root`` is not a folder, or a folder under it cannot be listed.
    """
    if not os.path.isdir(root):
        raise NotADirectoryError(errno.ENOTDIR, "not a folder to sync", root)
    for folder, _, files in os.walk(root, onerror=_raise):
        for name in files:
            file = os.path.join(folder, name)
            if not os.path.islink(file):
                fsync_path(file)
        fsync_path(folder)
    fsync_path(os.path.dirname(os.path.abspath(root)))


@contextlib.contextmanager
def replacing_folder(path: pathlib.Path) -> Iterator[pathlib.Path]:
    """A new hidden folder beside ``path`` to fill; on leaving the block it replaces
    ``path`` (``replace_folder``), on an error (Ctrl-C included) it is removed.

    It has mkdir's mode under the umask: ``mkdtemp``'s 0700 would hide the data from a
    shared group.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        file_modes.as_if_created(tmp)
        yield tmp
        # The new folder durable before the old one is dropped (a power loss could
        # otherwise leave neither), and its entry in the parent after the move.
        fsync_tree(str(tmp))
        replace_folder(tmp, path)
        fsync_path(str(path.parent))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_folder(new: pathlib.Path, path: pathlib.Path) -> None:
    """Moves the folder ``new`` to ``path``, replacing a folder (or a link) there.

    ``os.replace`` cannot overwrite a non-empty folder, so the old one is moved aside
    under a hidden name of its own first and removed after. Should moving ``new`` in fail
    or be interrupted (Ctrl-C included), the old one is put back; once ``new`` is in
    place, the old one is removed even if that removal is interrupted. Only a kill or a
    power loss between the two renames leaves ``path`` missing, its old folder beside it.
    """
    old = None
    if os.path.lexists(path):
        old = path.with_name(f".{path.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
    try:  # the move aside too: a Ctrl-C right after it must still put the old one back
        if old is not None:
            os.replace(path, old)
        os.replace(new, path)
    except BaseException:
        if old is not None and os.path.lexists(old):
            if os.path.lexists(path):  # the new folder is in place
                _discard(old)
            else:
                os.replace(old, path)
        raise
    if old is not None:
        try:
            _discard(old)
        finally:  # a Ctrl-C in the removal: finish it, the new folder is in place
            if os.path.lexists(old):
                _discard(old)


def _discard(path: pathlib.Path) -> None:
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)
