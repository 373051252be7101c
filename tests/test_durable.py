"""``flowjax/core/durable.py``: which paths ``fsync_tree`` syncs."""

import errno
import os

import pytest

from flowjax.core import durable


def test_fsync_tree_syncs_every_file_and_folder_and_the_roots_entry(tmp_path, monkeypatch):
    root = tmp_path / "checkpoint"
    (root / "state" / "d").mkdir(parents=True)
    for name in ("meta", "state/manifest", "state/d/chunk"):
        (root / name).write_text(name)
    (tmp_path / "elsewhere").write_text("not part of the tree")
    os.symlink(tmp_path / "elsewhere", root / "link")
    synced = []
    monkeypatch.setattr(durable, "fsync_path", synced.append)
    durable.fsync_tree(str(root))
    assert sorted(synced) == sorted(str(p) for p in (
        tmp_path, root, root / "meta", root / "state", root / "state" / "manifest",
        root / "state" / "d", root / "state" / "d" / "chunk"))


def test_fsync_path_syncs_files_and_folders(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    synced, fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                 fsync(fd)))
    durable.fsync_path(str(tmp_path / "file"))
    durable.fsync_path(str(tmp_path))
    assert synced == [str(tmp_path / "file"), str(tmp_path)]


def test_fsync_tree_refuses_what_it_cannot_sync_instead_of_syncing_nothing(tmp_path,
                                                                           monkeypatch):
    with pytest.raises(NotADirectoryError):
        durable.fsync_tree(str(tmp_path / "7"))  # a checkpoint that was never written
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        durable.fsync_tree(str(tmp_path / "file"))
    (tmp_path / "tree" / "locked").mkdir(parents=True)
    listdir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path: (_ for _ in ()).throw(
        PermissionError(errno.EACCES, "denied", path)) if str(path).endswith("locked")
        else listdir(path))
    with pytest.raises(PermissionError):
        durable.fsync_tree(str(tmp_path / "tree"))


def test_a_folder_a_file_system_cannot_sync_is_left_but_a_file_is_not(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")

    def einval(descriptor):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "fsync", einval)
    durable.fsync_path(str(tmp_path))  # some FUSE and network mounts: nothing to do
    with pytest.raises(OSError):
        durable.fsync_path(str(tmp_path / "file"))


def test_a_replacing_folder_is_synced_before_the_old_one_is_dropped(tmp_path, monkeypatch):
    """Else a power loss after the swap could leave neither the old store nor the new."""
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "old").write_text("old")
    events = []
    monkeypatch.setattr(durable, "fsync_path", lambda p: events.append(("sync", str(p))))
    real_replace = durable.replace_folder
    monkeypatch.setattr(durable, "replace_folder", lambda new, path: (
        events.append(("replace", str(path))), real_replace(new, path))[-1])
    with durable.replacing_folder(tmp_path / "store") as tmp:
        (tmp / "rows").write_text("new")
    replaced = events.index(("replace", str(tmp_path / "store")))
    assert ("sync", str(tmp / "rows")) in events[:replaced]
    assert ("sync", str(tmp_path)) in events[:replaced]  # the temporary folder's entry
    assert events[replaced + 1:] == [("sync", str(tmp_path))]  # the moved entry
    assert (tmp_path / "store" / "rows").read_text() == "new"
    assert not (tmp_path / "store" / "old").exists()
