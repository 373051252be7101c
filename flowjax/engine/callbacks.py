"""Callbacks around the run loop (``flowjax.engine.loop``), in pfl-research's style: the
loop trains and evaluates; everything a run writes or guards is a callback.

* ``Checkpoints``: resumes from the newest checkpoint, saves every N rounds and the last;
* ``MetricsFile``: ``metrics.jsonl``, one line per record;
* ``DivergenceGuard``: stops (or reports) a round that went non-finite, warns once when
  the loss grows past ``LOSS_GROWTH_WARNING`` times its first value;
* ``ProgressBar``: a tqdm bar with the last training loss; ``OnRoundEnd`` calls a function
  after each round (tests inspect the simulation there);
* ``flowjax.tensorboard_log.TensorBoardLog``: TensorBoard event files.

Hooks run in the order the callbacks are given: ``run_folder_callbacks`` puts
``Checkpoints`` before ``MetricsFile`` (the restored history is what the file starts
with), and ``MetricsFile`` goes before ``DivergenceGuard`` (the round that diverged is in
the file when the guard stops the run).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from flowjax import distributed, run_folder
from flowjax.checkpoint import CheckpointUnreadable, Checkpointer
from flowjax.engine.round import ServerState
from flowjax.evaluation.metrics import EvalSummary

if TYPE_CHECKING:  # annotations only: the simulation module needs nothing from here
    from flowjax.engine.simulation import Simulation

Record = dict[str, Any]


@dataclasses.dataclass
class RunState:
    """The loop's state as callbacks see it (``Checkpoints`` replaces it on resume).

    Attributes:
      simulation: what runs.
      state: the server state after ``rounds_done`` rounds.
      rounds_done: completed rounds.
      history: the records logged so far (train records reach it every ``log_every``
        rounds, and at every round a callback ``syncs_at``).
      summaries: the newest evaluation, by population.
      last_checkpoint: the round of the newest checkpoint (None: none written).
      resumed_from: the checkpoint round this attempt resumed from (None: a fresh start).
      earlier_wall_time_s: wall seconds the earlier attempts took to reach that
        checkpoint (0 for a fresh start; None when the checkpoint recorded none).
      started_at: ``time.perf_counter()`` when this attempt's loop started.
    """

    simulation: Simulation
    state: ServerState
    rounds_done: int = 0
    history: list[Record] = dataclasses.field(default_factory=list)
    summaries: dict[str, EvalSummary] = dataclasses.field(default_factory=dict)
    last_checkpoint: int | None = None
    resumed_from: int | None = None
    earlier_wall_time_s: float | None = 0.0
    started_at: float = dataclasses.field(default_factory=time.perf_counter)

    def wall_time_s(self) -> float | None:
        """Wall seconds of the whole run so far, earlier attempts included up to the
        resumed checkpoint (the work they did after it is redone, so not counted); None
        when the earlier attempts' time is unknown."""
        if self.earlier_wall_time_s is None:
            return None
        return self.earlier_wall_time_s + time.perf_counter() - self.started_at

    @property
    def last(self) -> bool:
        """Whether the last round is done."""
        return self.rounds_done == self.simulation.settings.num_rounds


class Callback:
    """Hooks of the run loop; every one is optional."""

    def on_run_start(self, run: RunState) -> None:
        """Before the first round (may restore ``run``: a resumed run starts later)."""

    def syncs_at(self, rounds_done: int, last: bool) -> bool:
        """Whether the round's training records must reach the host (and ``history``)
        before ``on_round_end`` of round ``rounds_done``."""
        del rounds_done, last
        return False

    def on_record(self, run: RunState, record: Record) -> None:
        """A train or eval record, just appended to ``run.history``."""

    def on_round_end(self, run: RunState) -> None:
        """After a round, its synced records and its evaluation, if any."""

    def on_run_end(self, run: RunState) -> None:
        """Always, after the last round or an error (close files here)."""


# ---------------------------------------------------------------------------- the run folder
class Checkpoints(Callback):
    """Orbax checkpoints in ``<workdir>/checkpoints``: resumes from the newest complete one
    (the run then replays exactly what the uninterrupted run would have done), saves
    every ``every`` rounds and after the last one.

    Args:
      workdir: the run folder.
      every: rounds between checkpoints (>= 1).
      fingerprint: JSON metadata a resumed checkpoint must match (the config, compared as
        ``run_folder.resumable_differences`` does).
    """

    def __init__(self, workdir: str, every: int, fingerprint: dict[str, Any] | None = None):
        self.workdir = workdir
        self.directory = run_folder.path(workdir, run_folder.CHECKPOINTS)
        self.every = every
        self.fingerprint = fingerprint
        self._checkpointer: Checkpointer | None = None

    def on_run_start(self, run: RunState) -> None:
        self._checkpointer = checkpointer = Checkpointer(self.directory)
        latest = checkpointer.latest_round()
        if latest is None:
            return
        simulation = run.simulation
        try:
            state, rows, meta = checkpointer.restore(latest, run.state,
                                                     simulation.algorithm.stateful)
        except CheckpointUnreadable:
            raise  # not the checkpoint's fault: no older one to point at
        except ValueError as error:
            older = [r for r in checkpointer.rounds() if r < latest]
            states = simulation.client_states
            if not older or (states is not None and not states.restores_older_checkpoints):
                raise
            # --overwrite would delete the older, intact checkpoint along with this one.
            raise ValueError(f"{error}; or move {checkpointer.directory}/{latest} out of "
                             f"{run_folder.CHECKPOINTS}/ to resume from round {older[-1]}'s "
                             f"checkpoint") from None
        if self.fingerprint is not None:
            stored = meta.get("fingerprint")
            differing = (["(no config recorded)"] if not isinstance(stored, dict)
                         else run_folder.resumable_differences(self.workdir, stored,
                                                               self.fingerprint))
            if differing:
                raise ValueError(f"checkpoint {checkpointer.directory}/{latest} was written "
                                 f"by a different config (differs in: "
                                 f"{run_folder.named_fields(differing)}); use another --workdir or "
                                 f"--overwrite")
        if rows is not None:
            try:
                simulation.client_states.load_state_dict(rows, latest)
                error = None
            except ValueError as raised:
                error = ValueError(f"checkpoint {checkpointer.directory}/{latest}: {raised}; "
                                   f"use another --workdir or --overwrite")
            except OSError as raised:  # restoring writes and syncs the files
                error = raised
            # Each process restores its own files: one that cannot must stop the others
            # here, not leave them waiting for it in the first round's collectives.
            distributed.stop_together(
                error, f"checkpoint {checkpointer.directory}/{latest}: client states")
        run.state, run.rounds_done, run.history = state, latest, list(meta["history"])
        run.summaries = {name: EvalSummary(**s) for name, s in meta.get("summaries", {}).items()}
        run.last_checkpoint = run.resumed_from = latest
        # Checkpoints of older flowjax versions recorded no time.
        run.earlier_wall_time_s = meta.get("wall_time_s")

    def syncs_at(self, rounds_done: int, last: bool) -> bool:
        return last or rounds_done % self.every == 0

    def on_round_end(self, run: RunState) -> None:
        done = run.rounds_done
        if not self.syncs_at(done, run.last):
            return
        client_states = run.simulation.client_states
        where = f"checkpoint {self._checkpointer.directory}/{done}: client states"
        rows = (distributed.on_every_process(where, client_states.state_dict)
                if client_states is not None else None)
        meta = {"rounds_done": done, "history": run.history, "fingerprint": self.fingerprint,
                "summaries": {n: s.to_dict() for n, s in run.summaries.items()},
                "wall_time_s": run.wall_time_s()}
        self._checkpointer.save(done, run.state, rows, json.loads(json.dumps(meta)))
        if client_states is not None:
            distributed.on_every_process(where, lambda: client_states.committed(done))
        run.last_checkpoint = done

    def on_run_end(self, run: RunState) -> None:
        if self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None


class MetricsFile(Callback):
    """``<workdir>/metrics.jsonl``: at the start exactly the records up to the resumed
    round (lines a killed run wrote after its last checkpoint are replayed, not
    duplicated), or a fresh run's earlier stage's (HypCluster's warm-up), then one line
    per record. Only the primary process of a multi-host run
    writes."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self._file = None

    def on_run_start(self, run: RunState) -> None:
        if not distributed.is_primary():
            return
        run_folder.write_metrics(self.workdir, run.history)
        self._file = open(run_folder.path(self.workdir, run_folder.METRICS), "a")

    def on_record(self, run: RunState, record: Record) -> None:
        if self._file is not None:
            self._file.write(run_folder.metrics_line(record))
            self._file.flush()

    def on_run_end(self, run: RunState) -> None:
        if self._file is not None:
            # On disk before results.json marks the run finished: a finished run is never
            # resumed, so lines a power cut dropped from the cache would stay lost.
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


def run_folder_callbacks(workdir: str | None, checkpoint_every: int = 0,
                         fingerprint: dict[str, Any] | None = None) -> list[Callback]:
    """The writers of a run folder, in the order they must run (none without a workdir;
    no checkpoints with ``checkpoint_every=0``)."""
    if not workdir:
        return []
    checkpoints = [Checkpoints(workdir, checkpoint_every, fingerprint)] if checkpoint_every else []
    return [*checkpoints, MetricsFile(workdir)]


# ---------------------------------------------------------------------------- divergence
DEFAULT_REMEDY = ("Lower the learning rate, or set on_divergence='skip_clients' to drop "
                  "such clients and go on")
SERVER_REMEDY = ("Lower the learning rate; on_divergence='skip_clients' cannot drop the "
                 "server's update")
EVALUATION_REMEDY = ("Lower the learning rate, or set on_divergence='skip_clients' to count "
                     "such predictions as wrong and go on")
# A training loss above this multiple of the run's first finite training loss is reported
# (once per run) as a warning: such growth means the run is diverging even while every
# value is still finite (FedAvg at learning_rate=1e30 reaches losses near 1e31).
LOSS_GROWTH_WARNING = 1e3


class DivergenceError(RuntimeError):
    """Training produced a non-finite loss or parameter, or an evaluation a non-finite
    prediction.

    Attributes:
      round_number: the round (1-based) whose training (or evaluation) went non-finite.
      loss: its training loss over the clients that stayed finite (None: none did).
      clients_skipped: clients of the round that returned non-finite parameters (their
        update, or their new client state such as APFL's and Ditto's personal model).
      last_good: the round of the newest checkpoint, None if none was written.
      cause: what went non-finite first; remedy: what to do about it. The engine sees
        only the loss and the parameters; ``flowjax.runner`` names a data fault instead
        when it finds one (``explained``).
      stage: ``training``, or ``evaluation`` (a personalization at evaluation time
        diverged: Local trains only there, FedAvgFT fine-tunes there).
    """

    def __init__(self, round_number: int, loss: float | None, clients_skipped: int,
                 last_good: int | None, cause: str | None = None, remedy: str | None = None,
                 stage: str = "training"):
        self.round_number, self.loss = round_number, loss
        self.clients_skipped, self.last_good, self.stage = clients_skipped, last_good, stage
        self.cause = cause or self.non_finite_values()
        self.remedy = remedy or DEFAULT_REMEDY
        where = (f"the last good checkpoint is round {last_good}" if last_good is not None
                 else "no checkpoint was written")
        super().__init__(f"round {round_number}: {stage} diverged: {self.cause}; stopping, "
                         f"{where}. {self.remedy}")

    def non_finite_values(self) -> str:
        """The loss and parameters that went non-finite, as text."""
        params = f"{self.clients_skipped} client(s) returned non-finite parameters"
        if self.loss is None:  # no client stayed finite, so no loss was counted
            return f"all {params}"
        if not np.isfinite(self.loss):
            return f"the loss is {self.loss}" + (f" and {params}" if self.clients_skipped else
                                                 " (every client's parameters are finite)")
        return f"{params} (loss of the others {self.loss:g})"

    def explained(self, cause: str, remedy: str) -> "DivergenceError":
        """The same divergence with its cause and remedy named."""
        return DivergenceError(self.round_number, self.loss, self.clients_skipped,
                               self.last_good, cause, remedy, self.stage)


def check_finite(record: Record, last_good: int | None) -> None:
    """Raises ``DivergenceError`` naming the round when a train record went non-finite."""
    loss = record.get("loss")
    skipped = record.get("clients_skipped", 0) or 0
    if skipped or (loss is not None and not np.isfinite(loss)):
        raise DivergenceError(record["round"], loss, int(skipped), last_good)


def check_server_finite(record: Record, last_good: int | None) -> None:
    """Raises ``DivergenceError`` when the round's server step made its params non-finite
    (whatever ``on_divergence``: no client can be dropped to undo it)."""
    if record.get("server_nonfinite"):
        skipped = int(record.get("clients_skipped", 0) or 0)
        clients = (f"{skipped} client update(s) were non-finite and dropped" if skipped
                   else "every client update was finite")
        raise DivergenceError(record["round"], record.get("loss"), skipped, last_good,
                              f"the server's update (the clients' mean and the server "
                              f"optimizer's step) made its parameters non-finite ({clients})",
                              SERVER_REMEDY)


def nonfinite_predictions(record: Record) -> str | None:
    """What an eval record's non-finite predictions were, as text, or None if none.

    Example:
      >>> nonfinite_predictions({"kind": "eval", "population": "train_clients",
      ...                        "num_clients": 8, "clients_nonfinite": 2,
      ...                        "first_nonfinite_client": "f0001"})
      "2 of 8 train_clients client(s) made non-finite predictions (first: client 'f0001')"
    """
    clients = record.get("clients_nonfinite") or 0
    if record.get("kind") != "eval" or not clients:
        return None
    first = record.get("first_nonfinite_client")
    return (f"{clients} of {record['num_clients']} {record['population']} client(s) made "
            f"non-finite predictions" + (f" (first: client {first!r})" if first else ""))


def loss_growth(history: Sequence[Record], record: Record) -> str | None:
    """A warning when ``record``'s training loss exceeds ``LOSS_GROWTH_WARNING`` times the
    first finite, positive training loss in ``history``, else None.

    Example:
      >>> loss_growth([{"kind": "train", "round": 1, "loss": 4.0}],
      ...             {"kind": "train", "round": 2, "loss": 5e3})[:47]
      'round 2: training loss 5000 is over 1000x round'
    """
    loss = record.get("loss")
    if record.get("kind") != "train" or loss is None or not np.isfinite(loss):
        return None
    first = next((r for r in history if r.get("kind") == "train" and r.get("loss") is not None
                  and np.isfinite(r["loss"]) and r["loss"] > 0), None)
    if first is None or first is record or loss <= LOSS_GROWTH_WARNING * first["loss"]:
        return None
    return (f"round {record['round']}: training loss {loss:g} is over "
            f"{LOSS_GROWTH_WARNING:g}x round {first['round']}'s ({first['loss']:g}): the run is "
            "diverging; lower the learning rate")


def print_warning(message: str) -> None:
    """Prints ``warning: <message>`` to stderr."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


class DivergenceGuard(Callback):
    """Checks every training record.

    Args:
      on_divergence: ``stop`` raises ``DivergenceError`` when a client returned
        non-finite parameters or the loss is not finite; ``skip_clients`` goes on (such
        clients are always dropped from the round's mean), reporting them. Either way a
        server step that made the server's params non-finite stops the run.
      warn: receives, once per run each, a line when the training loss grows past
        ``LOSS_GROWTH_WARNING`` times its first value and when ``skip_clients`` first
        drops a client (only the primary process warns).
    """

    def __init__(self, on_divergence: str = "stop", warn: Callable[[str], None] = print_warning):
        if on_divergence not in ("stop", "skip_clients"):
            raise ValueError(f"on_divergence={on_divergence!r}: expected 'stop' or 'skip_clients'")
        self.on_divergence, self.warn = on_divergence, warn
        self._warned: set[str] = set()

    def _warn_once(self, kind: str, message: str | None) -> None:
        if message is not None and kind not in self._warned:
            self._warned.add(kind)
            if distributed.is_primary():
                self.warn(message)

    def on_record(self, run: RunState, record: Record) -> None:
        predictions = nonfinite_predictions(record)
        if predictions is not None and self.on_divergence == "stop":
            raise DivergenceError(record["round"], None, 0, run.last_checkpoint, predictions,
                                  EVALUATION_REMEDY, stage="evaluation")
        if predictions is not None:
            self._warn_once("predictions", f"round {record['round']}: {predictions}; they "
                            "count as wrong (on_divergence='skip_clients'; results.json counts "
                            "such clients as clients_nonfinite)")
        if record.get("kind") != "train":
            return
        if self.on_divergence == "stop":
            check_finite(record, run.last_checkpoint)
        check_server_finite(record, run.last_checkpoint)
        if self.on_divergence == "skip_clients" and record.get("clients_skipped"):
            self._warn_once("skipped", f"round {record['round']}: "
                            f"{int(record['clients_skipped'])} client(s) returned non-finite "
                            f"parameters and were dropped (on_divergence='skip_clients'; "
                            f"metrics.jsonl counts them per round)")
        self._warn_once("growth", loss_growth(run.history, record))


# ---------------------------------------------------------------------------- progress
def last_train_record(history: Sequence[Record]) -> Record:
    """The newest train record of ``history`` ({} if none)."""
    return next((r for r in reversed(history) if r.get("kind") == "train"), {})


class OnRoundEnd(Callback):
    """Calls ``fn(rounds_done, newest train record)`` after each round."""

    def __init__(self, fn: Callable[[int, Record], None]):
        self.fn = fn

    def on_round_end(self, run: RunState) -> None:
        self.fn(run.rounds_done, last_train_record(run.history))


class ProgressBar(Callback):
    """A tqdm bar of rounds (rounds/s, ETA) showing the newest training loss.

    ``write`` prints a line above the bar (for warnings).
    """

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self._options = dict(total=total, desc=desc, disable=not enabled)
        self._bar = None  # drawn from the run's start: an error before it is a line of its own

    @property
    def rounds_shown(self) -> int:
        """The rounds the bar counts as done."""
        return self._bar.n if self._bar is not None else 0

    def write(self, line: str) -> None:
        if self._bar is None:
            print(line, file=sys.stderr, flush=True)
        else:
            self._bar.write(line, file=sys.stderr)

    def on_run_start(self, run: RunState) -> None:
        import tqdm
        # Into a file (a log, nohup) every redraw is a line: one every 10 s there, not one
        # per round.
        interval = 0.1 if sys.stderr.isatty() else 10.0
        # A resumed run, or a stage starting after a warm-up (HypCluster), starts at its
        # rounds done; as tqdm's initial count, so the rate counts this attempt's rounds.
        self._bar = tqdm.tqdm(unit="round", dynamic_ncols=True, mininterval=interval,
                              initial=run.rounds_done, **self._options)

    def on_round_end(self, run: RunState) -> None:
        loss = last_train_record(run.history).get("loss")
        if loss is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)  # drawn by update
        self._bar.update(run.rounds_done - self._bar.n)

    def on_run_end(self, run: RunState) -> None:
        if self._bar is not None:
            self._bar.close()
