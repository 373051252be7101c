r"""The host memory a stateful method's client-state store takes, at its peaks.

  python launch/client_state_memory.py --rows=600 --row_floats=250000

Fills a ``flowjax.core.client_state.ClientStateStore`` with ``--rows`` client states of
``--row_floats`` float32 values (the rows the run's forecast line counts), 50 clients per
scatter as rounds do, then writes one checkpoint of it as a run does
(``flowjax.checkpoint.Checkpointer``), and prints the process's peak resident memory
after each step: the store's doubling growth and the checkpoint's writing each add to
what the rows themselves take. Linux reports the peak in KiB (``ru_maxrss``).
"""

from launch import cli

import resource  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

from absl import flags  # noqa: E402

_ROWS = flags.DEFINE_integer("rows", 600, "Clients with a stored state.", lower_bound=1)
_ROW_FLOATS = flags.DEFINE_integer("row_floats", 250_000, "float32 values per client state.",
                                   lower_bound=1)
_DIR = flags.DEFINE_string("dir", None, "Folder for the checkpoint (default: a temporary "
                           "folder, removed after).")
cli.define_debug_flag()


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def main(argv):
    del argv
    import jax.numpy as jnp
    import numpy as np

    from flowjax.checkpoint import Checkpointer
    from flowjax.core.client_state import ClientStateStore

    rows, width = _ROWS.value, _ROW_FLOATS.value
    after_imports = peak_gb()
    store = ClientStateStore({"v": np.zeros(width, np.float32)})
    rng = np.random.default_rng(0)
    for first in range(0, rows, 50):
        ids = np.arange(first, min(first + 50, rows))
        store.scatter(ids, {"v": rng.random((len(ids), width), np.float32)})
    after_filling = peak_gb()
    folder = _DIR.value or tempfile.mkdtemp(prefix="client_state_memory-")
    try:
        checkpointer = Checkpointer(folder)
        checkpointer.save(1, {"params": jnp.zeros(1)}, store.state_dict(), {"round": 1})
        checkpointer.close()
    finally:
        if _DIR.value is None:
            shutil.rmtree(folder, ignore_errors=True)
    after_checkpoint = peak_gb()
    print(f"rows: {rows:,} client states of {4 * width / 1e6:,.2f} MB = "
          f"{store.nbytes / 1e9:,.2f} GB")
    print(f"process peak: {after_imports:,.2f} GB after imports, {after_filling:,.2f} GB "
          f"after filling the store, {after_checkpoint:,.2f} GB after one checkpoint")
    return 0


if __name__ == "__main__":
    cli.run(main)
