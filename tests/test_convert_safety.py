"""``launch/convert.py`` under bad input: one line, exit 2, and no file of the user's lost.

The cases live in ``tests/bad_input_cases.py`` (``CONVERT_CASES``), which also prints them
into ``docs/bad-inputs.md``.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("h5py")

from tests import forkserver  # noqa: E402
from tests.bad_input_cases import CONVERT_CASES, run_convert  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "convert.py")


def _tree(root):
    files = {}
    for folder, dirs, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, root)] = f.read()
        for name in dirs:
            files[os.path.relpath(os.path.join(folder, name), root) + "/"] = b""
    return files


@pytest.mark.parametrize("case", CONVERT_CASES, ids=[c.input for c in CONVERT_CASES])
def test_convert_exits_2_with_one_line_and_loses_nothing(case, tmp_path):
    folder = tmp_path / "work"
    folder.mkdir()
    before = {}

    def setup(path):
        args = case.setup(path)
        before.update(_tree(path))
        return args

    done = run_convert(type(case)(case.input, setup, case.expected), str(folder))
    err = done.stderr.strip()
    assert done.returncode == 2, err[-2000:]
    assert err.splitlines() == [err] and err.startswith(case.expected), err
    assert "Traceback" not in done.stderr + done.stdout
    # Every file and folder is as it was (the source, thesis.tex, notes.txt, an earlier
    # conversion), and nothing new is left behind (no half-written output, no temp file).
    assert _tree(folder) == before


def test_overwrite_replaces_an_earlier_conversion(tmp_path):
    source = os.path.join(ROOT, "tests", "fixtures", "tff_sqlite")
    out = tmp_path / "emnist"

    def run(*extra):
        return forkserver.run([sys.executable, SCRIPT, "--dataset=emnist", f"--source={source}",
                               f"--out={out}", *extra], capture_output=True, text=True,
                              timeout=120)

    first = run()
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines()[0] == f"found TFF SQLite emnist_all.sqlite.lzma in {source}"
    (out / "train" / "train.y.npy").write_bytes(b"stale")
    again = run("--overwrite")
    assert again.returncode == 0, again.stderr
    assert (out / "train" / "train.y.npy").read_bytes() != b"stale"
    assert sorted(os.listdir(tmp_path)) == ["emnist"]  # no temp or old copy left behind


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_a_conversion_is_as_readable_as_the_umask_allows(tmp_path, umask):
    # Written in temporary folders (mkdtemp: 0700) and moved into place: a dataset folder
    # shared by a group must still be readable by it.
    source = os.path.join(ROOT, "tests", "fixtures", "tff_h5")
    # A group's shared folder: setgid, so folders made in it inherit the bit and files its group.
    os.chmod(tmp_path, 0o2770)
    out = tmp_path / "emnist"
    done = subprocess.run(["/bin/sh", "-c", f"umask {umask:03o} && exec \"$@\"", "sh",
                           sys.executable, SCRIPT, "--dataset=emnist", f"--source={source}",
                           f"--out={out}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    modes = {os.path.relpath(os.path.join(folder, name), tmp_path): os.stat(
                 os.path.join(folder, name)).st_mode & 0o7777
             for folder, dirs, names in os.walk(out) for name in dirs + names}
    modes["emnist"] = out.stat().st_mode & 0o7777
    folders = {"emnist", os.path.join("emnist", "train")}
    assert folders <= set(modes) and len(modes) > len(folders)
    assert modes == {path: 0o2000 | 0o777 & ~umask if path in folders else 0o666 & ~umask
                     for path in modes}
    groups = {os.stat(os.path.join(folder, name)).st_gid
              for folder, dirs, names in os.walk(out) for name in dirs + names}
    assert groups == {tmp_path.stat().st_gid}


def _proc_reports_umask() -> bool:
    try:
        with open("/proc/self/status", "rb") as status:
            return any(line.startswith(b"Umask:") for line in status)
    except OSError:
        return False


@pytest.mark.skipif(not _proc_reports_umask(), reason="needs Linux 4.7+ /proc/self/status")
@pytest.mark.parametrize("thread_name", [None, "café-py".encode()])
def test_the_umask_is_read_without_setting_it(monkeypatch, thread_name):
    # Setting it to read it would let another thread (orbax's checkpoint writers) create
    # world-writable files meanwhile; /proc/self/status's Name: line holds the thread's
    # name as it was set, bytes in no particular encoding.
    import ctypes

    from flowjax.core import file_modes
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    with open("/proc/thread-self/comm", "rb") as f:
        name_before = f.read().rstrip(b"\n")
    before = os.umask(0o027)
    try:
        if thread_name is not None:
            assert prctl(15, ctypes.c_char_p(thread_name), 0, 0, 0) == 0  # PR_SET_NAME
        monkeypatch.setattr(os, "umask", lambda mask: pytest.fail(f"os.umask({mask:o}) called"))
        assert file_modes.umask() == 0o027
    finally:
        monkeypatch.undo()
        os.umask(before)
        prctl(15, ctypes.c_char_p(name_before), 0, 0, 0)


def test_write_store_replaces_only_a_store(tmp_path):
    import numpy as np

    from flowjax.data.client_store import ClientStore, StoreError, write_store

    spec = {"x": ((2,), np.int32), "y": ((), np.int32)}
    clients = [("a", {"train": {"x": np.ones((1, 2), np.int32), "y": np.array([3])}})]
    folder = tmp_path / "thesis"
    folder.mkdir()
    (folder / "thesis.tex").write_text("\\documentclass{article}")
    with pytest.raises(StoreError, match=r"thesis is not a client store \(no meta.json"):
        write_store(folder, clients, spec, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thesis"]
    assert (folder / "thesis.tex").read_text() == "\\documentclass{article}"
    store = write_store(tmp_path / "s", clients, spec)
    write_store(store, [("b", {})], spec, overwrite=True)
    assert list(ClientStore(store).client_ids) == ["b"]


@pytest.mark.parametrize("fault", [KeyboardInterrupt, OSError])
def test_a_store_replacement_that_fails_puts_the_old_store_back(tmp_path, monkeypatch, fault):
    """``write_store(overwrite=True)`` moves the old store aside, then the new one in;
    should the second move fail, the old store is back where it was, nothing else left."""
    import numpy as np

    from flowjax.data.client_store import ClientStore, write_store

    spec = {"y": ((), np.int32)}
    store = write_store(tmp_path / "s", [("a", {"train": {"y": np.array([3])}})], spec)
    before = _tree(tmp_path)
    real_replace = os.replace

    def failing_replace(src, dst):
        if ".tmp" in os.path.basename(str(src)):  # the new store moving into place
            raise fault("the move failed")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(fault):
        write_store(store, [("b", {})], spec, overwrite=True)
    monkeypatch.undo()
    assert _tree(tmp_path) == before
    assert list(ClientStore(store).client_ids) == ["a"]


def test_a_ctrl_c_while_the_old_store_is_removed_leaves_no_copy_behind(tmp_path, monkeypatch):
    import shutil

    import numpy as np

    from flowjax.core import durable
    from flowjax.data.client_store import ClientStore, write_store

    spec = {"y": ((), np.int32)}
    store = write_store(tmp_path / "s", [("a", {"train": {"y": np.array([3])}})], spec)
    real_rmtree, calls = shutil.rmtree, []

    def interrupted_rmtree(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 1 and ".old-" in str(path):
            raise KeyboardInterrupt
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(durable.shutil, "rmtree", interrupted_rmtree)
    with pytest.raises(KeyboardInterrupt):
        write_store(store, [("b", {})], spec, overwrite=True)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
    assert list(ClientStore(store).client_ids) == ["b"]


def test_ctrl_c_while_replacing_a_task_directory_puts_the_old_one_back(tmp_path, monkeypatch):
    """``--overwrite`` moves the old task directory aside before moving the new one in;
    an interruption between the two moves restores the old one."""
    from flowjax.data import tff_h5

    out = tmp_path / "task"

    def build(contents):
        def write(tmp):
            (tmp / "vocab.json").write_text(contents)
            return {"dataset": "stackoverflow", "populations": []}
        return write

    tff_h5._write_task_dir(out, build("old"), overwrite=False)
    before = _tree(tmp_path)
    real_replace = os.replace

    def interrupted_replace(src, dst):
        if ".tmp-" in os.path.basename(str(src)):  # the new directory moving into place
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(tff_h5.os, "replace", interrupted_replace)
    with pytest.raises(KeyboardInterrupt):
        tff_h5._write_task_dir(out, build("new"), overwrite=True)
    assert _tree(tmp_path) == before
