"""TensorBoard event files of a run's records, written with tensorboardX (no TensorFlow).

With ``config.tensorboard = True`` the runner hands a ``TensorBoardLog`` callback to the
run loop (``flowjax.engine.loop``); every record that goes into ``metrics.jsonl`` also
becomes scalars in ``<workdir>/tensorboard/``, at step = round:

* a train record's numbers as ``train/<metric>`` (``train/loss``, ...);
* an eval record's numbers as ``eval/<population>/<metric>``, nested fields joined by
  ``/`` (``eval/train_clients/breakdown/global_only``) and per-layer lists indexed
  (``eval/train_clients/q0_by_group/both_correct/0``, None entries left out); nested
  lists (the q0 histograms) are not scalars and are left out.

Resuming: the run loop replays the records before the resumed checkpoint into
``metrics.jsonl`` but does not pass them to ``on_record``, so the event files of the first
attempt keep those rounds and a new event file takes the rounds after. The first attempt
may also have logged rounds after its last checkpoint, which the resumed run computes
again; so the new file starts with a purge marker at its first round, and TensorBoard
hides the first attempt's events from that step on (the replayed values are the same:
the run is deterministic). A run resumed, or a finished run reused, with
``config.tensorboard`` newly on (it may change at a resume: ``run_folder.OUTPUT_ONLY_FIELDS``)
first logs the records it already has, when the folder holds no event file. A fresh
HypCluster run's history starts with its FedAvg warm-up's records (rounds 1 to W), which
it logs the same way at its start.
``--overwrite`` removes the folder with the other run files.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Iterator, Mapping

from flowjax import run_folder
from flowjax.engine.callbacks import Callback, RunState

_SKIPPED = ("round", "kind", "population")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _flatten(prefix: str, value: Any) -> Iterator[tuple[str, float]]:
    if _is_number(value):
        yield prefix, float(value)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _flatten(f"{prefix}/{key}", item)
    elif isinstance(value, (list, tuple)) and all(v is None or _is_number(v) for v in value):
        for index, item in enumerate(value):
            if item is not None:
                yield f"{prefix}/{index}", float(item)


def record_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """``{tag: value}`` of one ``metrics.jsonl`` record (see the module docstring).

    Non-finite values are kept: a diverging loss should show in TensorBoard too.
    """
    kind = record.get("kind", "train")
    prefix = f"eval/{record.get('population', 'train_clients')}" if kind == "eval" else kind
    scalars = {}
    for key, value in record.items():
        if key not in _SKIPPED:
            scalars.update(_flatten(f"{prefix}/{key}", value))
    return scalars


# Written after an event file closes cleanly: the last round the event files then held.
# A killed attempt loses what tensorboardX had not flushed (up to flush_secs, 120 s), so
# event files alone do not say that they hold every round before the resumed one.
LOGGED_THROUGH = ".logged_through"


def _logged_through(logdir: str) -> int:
    try:
        with open(os.path.join(logdir, LOGGED_THROUGH)) as handle:
            return int(handle.read())
    except (OSError, ValueError):
        return -1


def _event_files(logdir: str) -> list[str]:
    if not os.path.isdir(logdir):
        return []
    return [name for name in os.listdir(logdir) if name.startswith("events.out.tfevents")]


class TensorBoardLog(Callback):
    """A run-loop callback writing ``record_scalars`` per record.

    The writer opens at the first record, so a finished run opened again (no record)
    leaves no empty event file; the loop closes it when the run ends.

    Example:
      >>> loop.run(simulation, [MetricsFile(workdir), TensorBoardLog(workdir)])

    Raises:
      ImportError: tensorboardX is not installed (one line naming the option).
    """

    def __init__(self, workdir: str):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ImportError("config.tensorboard=True needs tensorboardX: pip install "
                              "'flowjax[tensorboard]' (or tensorboardX), or set "
                              "--config.tensorboard=False") from None
        self._writer_class = SummaryWriter
        self.logdir = run_folder.path(workdir, run_folder.TENSORBOARD)
        self._writer = None
        self._last_step = -1
        self._complete = False

    def on_run_start(self, run: RunState) -> None:
        # Runs after the checkpoint's restore (the runner lists it later), so a run resumed
        # with config.tensorboard newly on logs the rounds it resumed past as well (and a
        # fresh HypCluster run its warm-up's records).
        self.log_earlier(run.history)

    def on_record(self, run: RunState, record: Mapping[str, Any]) -> None:
        self(record)

    def log_earlier(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Logs ``records`` of earlier attempts (or stages) unless a cleanly closed event
        file holds them all; else all of them again, and TensorBoard hides the earlier
        files' steps from the first one on (``purge_step``), so an attempt that was killed
        before its events were flushed, or that ran with ``config.tensorboard`` off,
        leaves no gap."""
        records = list(records)
        if not records or (_event_files(self.logdir) and _logged_through(self.logdir)
                           >= max(int(record["round"]) for record in records)):
            return
        if _event_files(self.logdir):
            # The whole history follows: no round before its first needs vouching for.
            self._write_logged_through(int(records[0]["round"]) - 1)
        for record in records:
            self(record)

    def on_run_end(self, run: RunState) -> None:
        self.close()

    def __call__(self, record: Mapping[str, Any]) -> None:
        """Writes one record's scalars."""
        step = int(record["round"])
        if self._writer is None:
            # A killed attempt's half-written marker (the runner holds the folder's lock).
            run_folder.remove_write_leftovers(self.logdir, (LOGGED_THROUGH,))
            # Events of an earlier attempt from this step on are superseded by this one.
            earlier = len(_event_files(self.logdir))
            # Complete on closing only if the rounds before its first are vouched for.
            self._complete = not earlier or _logged_through(self.logdir) >= step - 1
            if earlier and self._complete:
                # This file hides the earlier files' steps from `step` on, and a kill may
                # cut it short: until it closes, vouch only for the rounds before it.
                self._write_logged_through(step - 1)
            # tensorboardX names files by the second and host only: the suffix keeps an
            # attempt started in the same second from overwriting the previous file.
            self._writer = self._writer_class(self.logdir, purge_step=step if earlier else None,
                                              filename_suffix=f".{earlier}")
        for tag, value in record_scalars(record).items():
            self._writer.add_scalar(tag, value, step)
        self._last_step = max(self._last_step, step)

    def close(self) -> None:
        """Flushes and closes the event file (a no-op when nothing was logged)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            if self._complete:
                self._write_logged_through(self._last_step)

    def _write_logged_through(self, round_: int) -> None:
        run_folder.write_text_atomic(os.path.join(self.logdir, LOGGED_THROUGH), str(round_))
