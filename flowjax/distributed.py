"""Several processes (hosts) running one simulation: JAX's multi-controller model.

Every process runs the same program on the same inputs: the sampler, the cohorts and
every PRNG key derive from (seed, round, client id), so each host assembles the same
cohort and ``device_put`` keeps the shards of its own devices. The clients axis is then
sharded over the devices of all hosts (``core.mapping``), the server state is replicated,
and only the primary process writes files.

Launch (one command per host; see the README):

  python launch/train.py --config=... --workdir=SHARED_DIR \
      --config.mapping.num_devices=<all devices> \
      --coordinator_address=HOST0:PORT --num_processes=N --process_id=<this host's index>
"""

from __future__ import annotations

import contextlib
import hashlib
import signal
import threading
import uuid
from typing import Any, Callable, Iterator, Sequence, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

PyTree = Any
T = TypeVar("T")


def check_single_process(coordinator_address: str | None, num_processes: int,
                         process_id: int) -> None:
    """Raises ValueError when the multi-host flags of a run that joins no others
    (``num_processes`` <= 1) ask for one: each host would then run alone as process 0,
    all writing the same workdir."""
    if num_processes < 1:
        raise ValueError(f"--num_processes={num_processes}; expected 1 (one process) or "
                         f">= 2 (a multi-host run)")
    if process_id != 0 or coordinator_address:
        given = (f"--process_id={process_id}" if process_id != 0
                 else f"--coordinator_address={coordinator_address}")
        raise ValueError(f"{given} with --num_processes=1; expected --num_processes >= 2 "
                         f"for a multi-host run (the same on every host), or neither flag")


def initialize(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """Joins this process to the others (call before any JAX computation).

    On CPU the cross-process collectives run over gloo, JAX's default; GPUs and TPUs
    use their own interconnect.
    """
    if num_processes < 2:
        raise ValueError(f"num_processes must be >= 2 for a multi-process run, got "
                         f"{num_processes}")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, {num_processes - 1}], got {process_id}")
    if not coordinator_address or ":" not in coordinator_address:
        raise ValueError(f"coordinator_address must be HOST:PORT, got {coordinator_address!r}")
    # JAX's preemption service would take SIGTERM for itself (a C handler, in place
    # whenever ours are not: before and after the run loop) and only mark a "preemption
    # sync point" for orbax, so the run went on to its end and exited 0 (measured: two
    # processes, SIGTERM to one after loading). The run loop has its own agreed stop
    # (signals_agreed), and the launchers' SIGTERM handler covers the rest.
    jax.config.update("jax_enable_preemption_service", False)
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
    _STATE["joined"] = True


# This process's standing among the others (set by initialize and signals_agreed; read by
# the launchers when a process stops, without touching JAX's backends).
_STATE = {"joined": False, "stopped_together": False}


def stops_alone() -> bool:
    """Whether this process, stopping now, leaves the other processes of a multi-host run
    behind: it joined them (``initialize``) and no agreed stop (``signals_agreed``) told
    them all to stop with it. Such a process should leave at once (``launch/cli.py``):
    JAX's exit handler would wait in its shutdown barrier for processes that go on, and
    they, at their next collective, for it; leaving makes that collective fail for them
    (``ProcessLost``)."""
    return _STATE["joined"] and not _STATE["stopped_together"]


def joined() -> bool:
    """Whether this process joined others (``initialize``), asked without starting JAX's
    backend."""
    return _STATE["joined"]


def multiprocess() -> bool:
    return jax.process_count() > 1


class ProcessLost(RuntimeError):
    """A step all processes take together failed: another process has stopped (killed,
    out of memory, its host gone) or cannot be reached.

    The launchers exit on it at once (``launch/cli.py``): JAX's exit handler would wait
    in its shutdown barrier for the lost process until the heartbeat timeout (100 s) and
    then abort with a C++ stack trace. The other live processes fail the same way at
    their next collective, and the same command on every host resumes from the newest
    checkpoint.
    """


# How the XLA runtime's errors begin (absl status codes) when a cross-process collective
# fails: gloo's "Connection reset by peer" arrives as ``ValueError: UNKNOWN: ...``.
_RUNTIME_STATUSES = ("UNKNOWN", "INTERNAL", "UNAVAILABLE", "ABORTED", "CANCELLED",
                     "DEADLINE_EXCEEDED", "DATA_LOSS", "FAILED_PRECONDITION")


def _together(collective: Callable[[], T]) -> T:
    """``collective()``, a step every process takes at the same point; in a multi-process
    run, its runtime failure is raised as ``ProcessLost`` (an error of ours, such as a bad
    argument, is raised as it is)."""
    try:
        return collective()
    except (ValueError, jax.errors.JaxRuntimeError) as error:
        status = str(error).split(":", 1)[0].strip()
        if not multiprocess() or status not in _RUNTIME_STATUSES:
            raise
        raise ProcessLost(
            f"process {jax.process_index()}: a step all {jax.process_count()} processes take "
            f"together failed ({' '.join(str(error).split())}); another process has stopped "
            f"(its output or the scheduler's log says why): the same command on every host "
            f"resumes from the newest checkpoint") from error


def is_primary() -> bool:
    """Whether this process writes the run's files (process 0)."""
    return jax.process_index() == 0


def fetch(tree: PyTree) -> PyTree:
    """``jax.device_get(tree)``, gathering arrays whose shards live on other hosts."""
    def one(leaf):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        return jax.device_get(leaf)
    # A round's cross-host collectives fail here too: the host waits for them in the fetch.
    return _together(lambda: jax.tree.map(one, tree))


def replicate(tree: PyTree, mesh: Mesh) -> PyTree:
    """``tree`` replicated on every device of ``mesh`` (each host passes the same values)."""
    return jax.device_put(fetch(tree), NamedSharding(mesh, PartitionSpec()))


def shared_token() -> bytes:
    """16 random bytes, the same in every process (process 0's, broadcast): a name for
    something all processes start together, such as a chain of client-state files."""
    token = np.frombuffer(uuid.uuid4().bytes, np.uint8)
    if multiprocess():
        token = np.asarray(_together(lambda: multihost_utils.broadcast_one_to_all(token)),
                           np.uint8)
    return token.tobytes()


def gathered(words: Sequence[int]) -> np.ndarray:
    """Every process's ``words`` (int32), a row per process in process order. A
    collective: every process calls it at the same point with as many words."""
    row = np.asarray(words, np.int32).reshape(1, -1)
    if not multiprocess():
        return row
    return np.asarray(_together(lambda: multihost_utils.process_allgather(row[0]))).reshape(
        jax.process_count(), -1)


def stop_together(error: Exception | None, where: str, same: bytes = b"") -> None:
    """Raises ``error`` on its process and a one-line error on every other one, if any
    process has an error or a ``same`` other than process 0's (what must agree across
    processes: their config, flags, the workdir they see); returns on all otherwise.

    A collective: every process calls it at the same point.
    """
    digest = np.frombuffer(hashlib.sha256(same).digest()[:16], np.int32)
    rows = gathered([error is not None, *digest])
    if error is not None:
        raise error
    failed = [int(i) for i in np.flatnonzero(rows[:, 0])]
    if failed:
        raise ValueError(f"{where}: process(es) {', '.join(map(str, failed))} stopped (their "
                         f"output says why); expected every process to go on")
    differing = [int(i) for i in np.flatnonzero((rows[:, 1:] != rows[0, 1:]).any(axis=1))]
    if differing:
        raise ValueError(f"{where}: process(es) {', '.join(map(str, differing))} run another "
                         f"config, other flags or see another --workdir than process 0; "
                         f"expected the same command on every host but --process_id, and "
                         f"a workdir on a filesystem they share")


def on_every_process(where: str, write: Callable[[], T]) -> T:
    """``write()``, a step each process takes on its own files (its client states); an
    ``OSError`` there (a full disk, an I/O error) stops every process in one line, not
    only the one that raised while the others wait for it in the next collective.
    A collective in a multi-host run: every process calls it at the same point."""
    result, error = None, None
    try:
        result = write()
    except OSError as raised:
        error = raised
    stop_together(error, where)
    return result


# Ctrl-C, and the SIGTERM a scheduler sends (to every host of a job, or to one).
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_agreed() -> Iterator[Callable[[], None]]:
    """Within the block a multi-host run's processes stop on a signal together.

    A process that raised at its signal would leave the others waiting for it in the
    next collective (or inside a checkpoint's barriers) until a timeout; so in a
    multi-process run Ctrl-C and SIGTERM are recorded here instead, and the ``check()``
    this yields, called by every process at the same points, raises the first signal's
    exception (through the handler it had) on every process once any of them got one.
    In a single-process run, or off the main thread, signals act as before and
    ``check()`` does nothing.
    """
    if not multiprocess() or threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    received: list[int] = []
    # A signal this process ignores (SIG_IGN: started in the background) stays ignored.
    previous = {signum: signal.getsignal(signum) for signum in _STOP_SIGNALS
                if signal.getsignal(signum) is not signal.SIG_IGN}
    for signum in previous:
        signal.signal(signum, lambda signum, frame: received.append(signum))

    def restore() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    def check() -> None:
        signals = gathered([received[0] if received else 0])[:, 0]
        if signals.any():
            signum = int(signals[np.flatnonzero(signals)[0]])
            received.clear()
            restore()
            _STATE["stopped_together"] = True
            handler = previous.get(signum)
            if callable(handler):  # Ctrl-C's KeyboardInterrupt, the launchers' SIGTERM
                handler(signum, None)
            # Ignored or default here: stop anyway, as every other process does.
            raise KeyboardInterrupt

    try:
        yield check
    except BaseException:
        restore()
        raise
    restore()
    if received:  # after the last check: delivered as it would have been
        signal.raise_signal(received[0])
