r"""The host memory a stateful method's client-state store takes, at its peaks.

  python launch/client_state_memory.py --rows=600 --row_floats=250000 [--store=disk]

Fills a client-state store (``--store=memory``: ``flowjax.core.client_state``'s, the
default; ``disk``: ``flowjax.core.client_state_disk``'s, rows in memory-mapped files)
with ``--rows`` client states of ``--row_floats`` float32 values (the rows the run's
forecast line counts), 50 clients per scatter as rounds do, then writes one checkpoint of
it as a run does (``flowjax.checkpoint.Checkpointer``), then overwrites every row once, as
the rounds up to the next checkpoint may (the disk store first copies each to its undo
log). After each step it prints the process's peak resident memory (Linux reports it in
KiB, ``ru_maxrss``) and, from ``/proc/self/status``, its anonymous resident memory at
that moment: the peak counts the pages of mapped files too, which the kernel drops under
memory pressure; anonymous memory (numpy's arrays) it cannot drop. Each step's wall time
(random rows included) is printed beside it.
"""

from launch import cli
cli.stop_at_once_while_starting(__name__)

import os  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from absl import flags  # noqa: E402

_ROWS = flags.DEFINE_integer("rows", 600, "Clients with a stored state.", lower_bound=1)
_ROW_FLOATS = flags.DEFINE_integer("row_floats", 250_000, "float32 values per client state.",
                                   lower_bound=1)
_STORE = flags.DEFINE_enum("store", "memory", ["memory", "disk"], "Where the rows live.")
_DIR = flags.DEFINE_string("dir", None, "Folder for the checkpoint and the disk store's "
                           "files (default: a temporary folder, removed after).")
cli.define_debug_flag()


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def anonymous_gb() -> float | None:
    """Resident anonymous memory now (None where ``/proc/self/status`` does not say)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return None


def report(step: str, seconds: float | None) -> None:
    """The line of ``step`` done: its wall time, the peak and anonymous memory now."""
    anonymous = anonymous_gb()
    now = "" if anonymous is None else f", {anonymous:,.2f} GB anonymous"
    took = "" if seconds is None else f" ({seconds:,.2f} s)"
    print(f"after {step}{took}: process peak {peak_gb():,.2f} GB{now}", flush=True)


def main(argv):
    del argv
    import jax.numpy as jnp
    import numpy as np

    from flowjax.checkpoint import Checkpointer
    from flowjax.core.client_state import ClientStateStore
    from flowjax.core.client_state_disk import UNDO_LOG, DiskClientStateStore

    rows, width = _ROWS.value, _ROW_FLOATS.value
    if _DIR.value is not None and os.path.exists(_DIR.value) and (
            not os.path.isdir(_DIR.value) or os.listdir(_DIR.value)):
        # Its disk store and checkpoint would overwrite a run's client_states/ rows and
        # checkpoints/ (a workdir given by mistake), which no run could then restore.
        return cli.fail(ValueError(f"--dir={_DIR.value} is not an empty folder; expected a "
                                   f"new or empty folder for this benchmark's files"))
    # Each line as soon as it is known: a run killed for memory (launch/memory_capped.sh)
    # still shows how far it got.
    print(f"rows: {rows:,} client states of {4 * width / 1e6:,.2f} MB = "
          f"{rows * 4 * width / 1e9:,.2f} GB, in {_STORE.value}", flush=True)
    report("imports", None)
    folder = _DIR.value or tempfile.mkdtemp(prefix="client_state_memory-")
    template = {"v": np.zeros(width, np.float32)}
    store = (ClientStateStore(template) if _STORE.value == "memory"
             else DiskClientStateStore(template, os.path.join(folder, "client_states")))
    rng = np.random.default_rng(0)

    def each_row_once():
        for first in range(0, rows, 50):
            ids = np.arange(first, min(first + 50, rows))
            store.scatter(ids, {"v": rng.random((len(ids), width), np.float32)})

    def step(name, fn):
        start = time.perf_counter()
        fn()
        report(name, time.perf_counter() - start)

    def checkpoint():
        checkpointer = Checkpointer(os.path.join(folder, "checkpoints"))
        checkpointer.save(1, {"params": jnp.zeros(1)}, store.state_dict(), {"round": 1})
        checkpointer.close()
        store.committed(1)

    try:
        step("filling the store", each_row_once)
        step("one checkpoint", checkpoint)
        step("overwriting every row", each_row_once)
        if _STORE.value == "disk":
            log = os.path.join(folder, "client_states", UNDO_LOG)
            print(f"undo log: {os.path.getsize(log) / 1e9:,.2f} GB")
    finally:
        if _DIR.value is None:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    cli.run(main)
