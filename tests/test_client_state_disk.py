"""The disk-backed client-state store: the memory store's rows, byte for byte, and the
rows of the newest checkpoint back after any crash (``flowjax/core/client_state_disk.py``).

A "crash" here drops a store without flushing or committing anything and opens a new one
on the same folder, as a resumed process does. The rows a killed process wrote through
its memory maps are in the files for the new one to read (the page cache outlives the
process), which is the case the undo log exists for: those rows are already overwritten.
Kills of real ``launch/train.py`` runs are in ``test_resume.py``.
"""

import os

import jax
import ml_dtypes
import numpy as np
import pytest

from flowjax.core.client_state import ClientStateStore
from flowjax.core.client_state_disk import (UNDO_HEADER_BYTES, UNDO_LOG, DiskClientStateStore,
                                            leaf_file)

# Leaves of several dtypes and ranks, a scalar among them, and a bf16 one.
TEMPLATE = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "step": np.int32(-1),
            "h": np.full((4,), 0.5, ml_dtypes.bfloat16)}


def states(rng, n):
    """``n`` stacked random states shaped like ``TEMPLATE``."""
    return {"w": rng.normal(size=(n, 2, 3)).astype(np.float32),
            "step": rng.integers(0, 1000, size=n).astype(np.int32),
            "h": rng.normal(size=(n, 4)).astype(ml_dtypes.bfloat16)}


def rounds(seed, count, population=40, cohort=5):
    """``count`` cohorts of client ids (padding ids of -1 among them) with their states."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        ids = rng.choice(population, cohort, replace=False)
        ids[rng.random(cohort) < 0.2] = -1
        yield ids, states(rng, cohort)


def all_rows(store, population=40):
    return jax.tree.map(np.copy, store.gather(np.arange(-1, population)))


def assert_rows_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def reopened(folder, saved, rounds_done):
    """A new process's store, resumed from the checkpoint that saved ``saved``."""
    store = DiskClientStateStore(TEMPLATE, str(folder))
    store.load_state_dict(saved, rounds_done)
    return store


def test_it_holds_what_the_memory_store_holds_byte_for_byte(tmp_path):
    memory, disk = ClientStateStore(TEMPLATE), DiskClientStateStore(TEMPLATE, str(tmp_path))
    for ids, new in rounds(0, 30):  # 40 clients: the files grow past 8, 16 and 32 rows
        memory.scatter(ids, new)
        disk.scatter(ids, new)
        assert_rows_equal(all_rows(disk), all_rows(memory))
    assert len(disk) == len(memory) > 32
    assert disk.state_dict()["ids"].tolist() == memory.state_dict()["ids"].tolist()
    assert disk.nbytes == memory.nbytes
    # Each file holds a whole number of rows, its capacity doubled from 8 as rows came.
    capacities = {os.path.getsize(leaf_file(str(tmp_path), i)) / leaf.nbytes
                  for i, leaf in enumerate(jax.tree.leaves(TEMPLATE))}
    assert capacities == {64}  # doubled from 8 rows


@pytest.mark.parametrize("rounds_after", [1, 4])
def test_a_crash_after_a_checkpoint_resumes_to_its_rows(tmp_path, rounds_after):
    store = DiskClientStateStore(TEMPLATE, str(tmp_path))
    cohorts = list(rounds(1, 8 + rounds_after))
    for ids, new in cohorts[:8]:
        store.scatter(ids, new)
    saved = store.state_dict()
    store.committed(8)
    expected = all_rows(store)
    for ids, new in cohorts[8:]:  # overwrites checkpointed rows and adds new ones
        store.scatter(ids, new)
    assert os.path.getsize(tmp_path / UNDO_LOG) > UNDO_HEADER_BYTES  # overwrites logged
    resumed = reopened(tmp_path, saved, 8)
    assert len(resumed) == len(saved["ids"])
    assert_rows_equal(all_rows(resumed), expected)
    # It goes on as the store that never crashed: the same rounds give the same rows.
    for ids, new in cohorts[8:]:
        resumed.scatter(ids, new)
    assert_rows_equal(all_rows(resumed), all_rows(store))


def test_every_process_resumes_from_the_checkpoint_process_0_wrote(tmp_path):
    # A multi-host run: each process keeps all rows in its own folder and the checkpoint
    # records process 0's ids and token, so the stores must share the chain's token.
    token = bytes(range(16))
    folders = [tmp_path / f"process_{i}" for i in range(2)]
    stores = [DiskClientStateStore(TEMPLATE, str(f), chain_token=token) for f in folders]
    cohorts = list(rounds(8, 10))
    for ids, new in cohorts[:6]:
        for store in stores:
            store.scatter(ids, new)
    saved = [store.state_dict() for store in stores][0]
    for store in stores:
        store.committed(6)
    expected = all_rows(stores[0])
    for ids, new in cohorts[6:]:  # then killed
        for store in stores:
            store.scatter(ids, new)
    for folder in folders:
        assert_rows_equal(all_rows(reopened(folder, saved, 6)), expected)
    # Started without a shared token, process 1's rows are refused as another chain's.
    stranger = DiskClientStateStore(TEMPLATE, str(tmp_path / "random"))
    for ids, new in cohorts[:6]:
        stranger.scatter(ids, new)
    stranger.state_dict()
    stranger.committed(6)
    with pytest.raises(ValueError, match="rewritten by an attempt that started the run over"):
        reopened(tmp_path / "random", saved, 6)


def test_each_row_is_logged_once_between_checkpoints(tmp_path):
    store = DiskClientStateStore(TEMPLATE, str(tmp_path))
    rng = np.random.default_rng(2)
    store.scatter(np.array([3, 4]), states(rng, 2))
    store.state_dict()
    store.committed(1)
    header = os.path.getsize(tmp_path / UNDO_LOG)
    record = 16 + 6 * 4 + 4 + 4 * 2  # row, checksum, padding; then w, step and h
    for _ in range(3):
        store.scatter(np.array([3, 9]), states(rng, 2))  # 9 is new: nothing to undo
    assert os.path.getsize(tmp_path / UNDO_LOG) == header + record
    store.state_dict()
    store.committed(2)  # a new checkpoint starts an empty log
    assert os.path.getsize(tmp_path / UNDO_LOG) == header


def test_a_crash_between_the_checkpoint_and_its_log_keeps_the_flushed_rows(tmp_path):
    store = DiskClientStateStore(TEMPLATE, str(tmp_path))
    cohorts = list(rounds(3, 10))
    for ids, new in cohorts[:4]:
        store.scatter(ids, new)
    store.state_dict()
    store.committed(4)
    for ids, new in cohorts[4:]:
        store.scatter(ids, new)
    saved = store.state_dict()  # checkpoint 10 written; killed before committed(10)
    resumed = reopened(tmp_path, saved, 10)  # the log is still round 4's: not applied
    assert_rows_equal(all_rows(resumed), all_rows(store))


def test_a_crash_during_the_first_checkpoint_keeps_the_flushed_rows(tmp_path):
    # Ctrl-C is held while a checkpoint is written and delivered before committed():
    # the first checkpoint is complete, its log not yet started.
    store = DiskClientStateStore(TEMPLATE, str(tmp_path))
    for ids, new in rounds(7, 3):
        store.scatter(ids, new)
    saved = store.state_dict()
    assert_rows_equal(all_rows(reopened(tmp_path, saved, 3)), all_rows(store))


def test_rows_an_attempt_started_over_on_are_refused_not_restored(tmp_path):
    cohorts = list(rounds(8, 8))
    first = DiskClientStateStore(TEMPLATE, str(tmp_path))
    for ids, new in cohorts[:4]:
        first.scatter(ids, new)
    saved = first.state_dict()
    first.committed(4)
    # An attempt without checkpoints (checkpoint_every=0) starts over in the same folder
    # and overwrites rows unlogged; the checkpoint of round 4 cannot get them back.
    again = DiskClientStateStore(TEMPLATE, str(tmp_path))
    for ids, new in cohorts[4:]:
        again.scatter(ids, new)
    with pytest.raises(ValueError, match=r"were rewritten by an attempt that started the run "
                                         r"over after the checkpoint of round 4") as error:
        reopened(tmp_path, saved, 4)
    assert "\n" not in str(error.value)


def test_a_state_without_bytes_opens_and_resumes(tmp_path):
    empty = {"w": np.zeros((0, 3), np.float32)}
    store = DiskClientStateStore(empty, str(tmp_path))
    store.scatter(np.array([4, 1]), {"w": np.zeros((2, 0, 3), np.float32)})
    saved = store.state_dict()
    store.committed(1)
    resumed = DiskClientStateStore(empty, str(tmp_path))
    resumed.load_state_dict(saved, 1)
    assert resumed._ids().tolist() == [4, 1] and resumed.gather([1])["w"].shape == (1, 0, 3)


def test_a_torn_last_log_record_is_not_applied(tmp_path):
    store = DiskClientStateStore(TEMPLATE, str(tmp_path))
    rng = np.random.default_rng(4)
    store.scatter(np.arange(4), states(rng, 4))
    saved = store.state_dict()
    store.committed(1)
    expected = all_rows(store)
    store.scatter(np.array([0, 1]), states(rng, 2))
    record_size = 16 + 6 * 4 + 4 + 4 * 2
    with open(tmp_path / UNDO_LOG, "rb") as log:
        data = log.read()
    # A crash while row 2's record was appended: its bytes half written (row 2 itself
    # never changed, its overwrite waits for the log's fsync) ...
    torn = bytearray(data[-record_size:])
    torn[0] = 2
    torn[20:] = b"\xff" * (record_size - 20)
    with open(tmp_path / UNDO_LOG, "ab") as log:
        log.write(bytes(torn) + b"\x00" * 7)  # ... then a partial record
    assert_rows_equal(all_rows(reopened(tmp_path, saved, 1)), expected)


def test_rows_that_cannot_be_the_checkpoints_are_refused_in_one_line(tmp_path):
    store = DiskClientStateStore(TEMPLATE, str(tmp_path))
    store.scatter(np.arange(3), states(np.random.default_rng(5), 3))
    saved = store.state_dict()
    store.committed(6)
    with pytest.raises(ValueError, match=r"are of round 6, after the newest checkpoint's "
                                         r"round 4 \(was a checkpoint deleted\?\)") as error:
        reopened(tmp_path, saved, 4)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"undo.log of round 6 is for 3 rows; expected the "
                                         r"2 its checkpoint names"):
        reopened(tmp_path, {**saved, "ids": saved["ids"][:2]}, 6)
    os.remove(tmp_path / UNDO_LOG)
    with pytest.raises(ValueError, match=r"no undo.log, so the rows cannot be matched to "
                                         r"round 6"):
        reopened(tmp_path, saved, 6)
    (tmp_path / UNDO_LOG).write_bytes(b"not a log at all, long enough")
    with pytest.raises(ValueError, match="is not a flowjax undo log"):
        reopened(tmp_path, saved, 6)


def test_a_memory_checkpoint_resumes_on_disk_and_not_the_other_way(tmp_path):
    memory = ClientStateStore(TEMPLATE)
    cohorts = list(rounds(6, 12))
    for ids, new in cohorts[:6]:
        memory.scatter(ids, new)
    disk = reopened(tmp_path, memory.state_dict(), 6)  # a run out of memory, moved to disk
    assert_rows_equal(all_rows(disk), all_rows(memory))
    expected = all_rows(disk)
    for ids, new in cohorts[6:]:  # a crash before its first disk checkpoint: the memory
        disk.scatter(ids, new)      # checkpoint's rows are written over them again
    assert_rows_equal(all_rows(reopened(tmp_path, memory.state_dict(), 6)), expected)
    with pytest.raises(ValueError, match=r"expected --config.client_states=disk to resume it"):
        ClientStateStore(TEMPLATE).load_state_dict(disk_ids(memory), 6)


def disk_ids(store):
    """What a disk store's checkpoint holds of ``store``: the ids alone."""
    return {"ids": store.state_dict()["ids"], "leaves": []}


# ----------------------------------------------------------------- durability, scale


def test_a_long_undo_log_is_applied_without_reading_it_whole(tmp_path):
    import tracemalloc
    wide = {"w": np.zeros(16384, np.float32)}  # 64 KiB rows
    store = DiskClientStateStore(wide, str(tmp_path))
    rng = np.random.default_rng(7)
    store.scatter(np.arange(160), {"w": rng.normal(size=(160, 16384)).astype(np.float32)})
    saved = store.state_dict()
    store.committed(1)
    expected = jax.tree.map(np.copy, store.gather(np.arange(160)))
    store.scatter(np.arange(160), {"w": rng.normal(size=(160, 16384)).astype(np.float32)})
    log_bytes = os.path.getsize(tmp_path / UNDO_LOG)
    assert log_bytes > 160 * 65536  # every row was logged
    resumed = DiskClientStateStore(wide, str(tmp_path))
    tracemalloc.start()
    try:
        resumed.load_state_dict(saved, 1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < log_bytes / 20, (peak, log_bytes)  # a few rows at a time, not 10 MiB
    assert_rows_equal(resumed.gather(np.arange(160)), expected)


def test_every_checkpoint_is_durable_before_its_undo_log_replaces_the_last(tmp_path,
                                                                             monkeypatch):
    """Orbax renames a checkpoint into place without an fsync: after a power loss it could
    stand empty while the log that restores the one before is gone. So every file and
    folder of checkpoint L (and its entry in ``checkpoints/``) is synced before
    ``committed(L)``, through a real run."""
    from flowjax import runner
    from tests.helpers import small_synthetic_config
    synced, fsync = [], os.fsync

    def recording_fsync(descriptor):
        synced.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        fsync(descriptor)

    committed = DiskClientStateStore.committed

    def recording_committed(self, rounds_done):
        synced.append(("committed", rounds_done))
        committed(self, rounds_done)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(DiskClientStateStore, "committed", recording_committed)
    config = small_synthetic_config(algorithm="ditto", num_rounds=3, checkpoint_every=1,
                                    client_states="disk")
    runner.run_config_to_workdir(config, str(tmp_path / "run"), progress=False)
    checkpoints = tmp_path / "run" / "checkpoints"
    kept = sorted(int(name) for name in os.listdir(checkpoints))
    assert kept == [2, 3]  # max_to_keep=2
    for rounds_done in kept:
        before = synced[:synced.index(("committed", rounds_done))]
        folder = checkpoints / str(rounds_done)
        paths = {str(checkpoints), str(folder)}
        for parent, folders, files in os.walk(folder):
            paths.update(os.path.join(parent, name) for name in folders + files)
        assert len(paths) > 5
        assert paths <= set(before), sorted(paths - set(before))
        # The folder's entry in checkpoints/ is durable only from a sync of checkpoints/
        # after the folder was renamed into place, i.e. after the folder's own sync.
        after_folder = before[max(i for i, p in enumerate(before) if p == str(folder)):]
        assert str(checkpoints) in after_folder


def test_a_checkpoint_orbax_skips_is_an_error_not_a_commit(tmp_path):
    """Orbax's save returns False for a round at or before its newest; the store would
    then be told of a checkpoint that does not exist and drop the newest one's log."""
    from flowjax.checkpoint import Checkpointer
    checkpointer = Checkpointer(str(tmp_path / "checkpoints"))
    checkpointer.save(2, {"w": np.zeros(2)}, None, {"round": 2})
    with pytest.raises(RuntimeError, match=r"checkpoints/1 was not written \(newest: 2\); "
                                           r"expected a round after the newest"):
        checkpointer.save(1, {"w": np.ones(2)}, None, {"round": 1})
    checkpointer.close()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]


def test_new_rows_get_their_disk_blocks_before_they_are_written(tmp_path, monkeypatch):
    """Each round's new rows are reserved (posix_fallocate, exactly their bytes in each
    leaf's file) before any is written: on a full disk the reservation raises ENOSPC and
    no row changes, where a write through the map into a sparse hole would be SIGBUS."""
    import errno
    reserved, full = [], []
    fallocate = os.posix_fallocate

    def recording_fallocate(descriptor, offset, length):
        reserved.append((os.path.basename(os.readlink(f"/proc/self/fd/{descriptor}")),
                         offset, length))
        if full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fallocate(descriptor, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", recording_fallocate)
    store = DiskClientStateStore(TEMPLATE, str(tmp_path))
    rng = np.random.default_rng(0)
    store.scatter(np.array([7, -1, 3]), states(rng, 3))
    sizes = [leaf.nbytes for leaf in jax.tree.leaves(TEMPLATE)]  # rows of h, step, w
    files = [os.path.basename(leaf_file(str(tmp_path), i)) for i in range(3)]
    assert reserved == [(f, 0, 2 * size) for f, size in zip(files, sizes)]
    reserved.clear()
    # A known client and two new ones: rows 2 and 3 only.
    store.scatter(np.array([3, 11, 12]), states(rng, 3))
    assert reserved == [(f, 2 * size, 2 * size) for f, size in zip(files, sizes)]
    before = all_rows(store)
    reserved.clear()
    full.append(True)
    with pytest.raises(OSError, match="No space left on device"):
        store.scatter(np.array([3, 20]), states(rng, 2))  # 3 is known, 20 new
    assert len(reserved) == 1  # the first leaf's reservation failed, nothing was written
    assert_rows_equal(all_rows(store), before)
    full.clear()
    # A checkpoint's rows restored into the files are reserved as well.
    memory = ClientStateStore(TEMPLATE)
    memory.scatter(np.array([5, 6]), states(rng, 2))
    reserved.clear()
    DiskClientStateStore(TEMPLATE, str(tmp_path / "restored")).load_state_dict(
        memory.state_dict(), 1)
    assert [(offset, length) for _, offset, length in reserved] == [(0, 2 * s) for s in sizes]


_FULL_DISK_CHILD = """
import errno, sys
import numpy as np
from flowjax.core.client_state_disk import DiskClientStateStore
store = DiskClientStateStore({"w": np.zeros(4096, np.float32)}, sys.argv[1])  # 16 KiB rows
written = []
try:
    for client in range(64):  # 1 MiB of rows on a 256 KiB disk
        store.scatter(np.array([client]), {"w": np.full((1, 4096), client, np.float32)})
        written.append(client)
except OSError as error:
    assert error.errno == errno.ENOSPC, error
    rows = store.gather(np.array(written))["w"]
    assert all((rows[i] == c).all() for i, c in enumerate(written)), "a row changed"
    print(f"ENOSPC after {len(written)} rows, every row intact")
"""


def test_a_full_disk_is_an_error_not_sigbus(tmp_path):
    """On a real full filesystem (a 256 KiB tmpfs in a private mount namespace): the
    store raises ENOSPC with its rows intact; it wrote through its maps into the sparse
    files' holes before, and the kernel killed the process with SIGBUS."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    mount = tmp_path / "small"
    mount.mkdir()
    script = (f'mount -t tmpfs -o size=256k tmpfs "{mount}" || exit 77; '
              f'exec "{sys.executable}" -c \'{_FULL_DISK_CHILD}\' "{mount}/states"')
    try:
        done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                               script], capture_output=True, text=True, cwd=root,
                              env=dict(os.environ, PYTHONPATH=root), timeout=120)
    except FileNotFoundError:
        pytest.skip("no unshare(1) to mount a small filesystem")
    if done.returncode == 77 or "unshare:" in done.stderr:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith("ENOSPC after ") and "every row intact" in done.stdout
