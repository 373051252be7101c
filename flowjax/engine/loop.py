"""The run loop: rounds, training records on the logging cadence, evaluations; whatever
is written or guarded is a callback (``flowjax.engine.callbacks``).

Example:
  >>> result = run(simulation, [*run_folder_callbacks(workdir, checkpoint_every=10),
  ...                           DivergenceGuard()])
  >>> result.results_dict()["acc_p"]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax

from flowjax import distributed
from flowjax.engine.callbacks import Callback, Record, RunState
from flowjax.engine.round import ServerState
from flowjax.engine.simulation import Simulation
from flowjax.evaluation.metrics import EvalSummary


def finalize_metrics(sums: dict[str, Any]) -> dict[str, float | None]:
    """``x_sum / x_count`` for every ``x`` (None when nothing counted); other entries
    pass through as floats."""
    out = {}
    for name, value in sums.items():
        if name.endswith("_sum"):
            base = name[: -len("_sum")]
            count = float(sums.get(f"{base}_count", 0.0))
            out[base] = float(value) / count if count > 0 else None
        elif not name.endswith("_count"):
            out[name] = float(value)
    return out


@dataclasses.dataclass
class RunResult:
    """What a finished run returns (and the runner writes to ``results.json``).

    ``resumed_from`` and ``earlier_wall_time_s`` are ``RunState``'s: the checkpoint this
    attempt resumed from and the earlier attempts' wall time up to it.
    """

    summaries: dict[str, EvalSummary]
    history: list[dict[str, Any]]
    final_state: ServerState
    resumed_from: int | None = None
    earlier_wall_time_s: float | None = 0.0

    def results_dict(self) -> dict[str, Any]:
        primary = self.summaries["train_clients"].to_dict()
        out = {"acc_g": primary["acc_g"], "acc_p": primary["acc_p"],
               "acc_p_soft": primary["acc_p_soft"],
               "clients_benefiting": primary["clients_benefiting"],
               "breakdown": primary["breakdown"], "num_eval_clients": primary["num_clients"]}
        out["populations"] = {name: s.to_dict() for name, s in self.summaries.items()}
        return out


def run(simulation: Simulation, callbacks: Sequence[Callback] = ()) -> RunResult:
    """Trains for ``settings.num_rounds`` rounds, evaluating on the cadence and at the end.

    Training metrics are fetched from the device only every ``log_every`` rounds (and at
    rounds a callback ``syncs_at``, a checkpoint's, and before an evaluation), so the host
    prepares the next cohort while the device trains the current one. Each record goes to
    ``history`` and then to every callback's ``on_record``; ``on_run_end`` runs for every
    callback, whatever happens. The history starts with ``simulation.earlier_records``
    (or, resumed, the checkpoint's): callbacks see those in ``on_run_start``, as
    ``run.history``, not in ``on_record``.
    """
    settings = simulation.settings
    # A later stage starts after its earlier stage's rounds (``Settings.first_round``), its
    # history with that stage's records (a resume replaces it with the checkpoint's).
    run_state = RunState(simulation=simulation, state=simulation.init_state(),
                         rounds_done=settings.first_round,
                         history=list(simulation.earlier_records))
    pending: list[tuple[int, dict[str, jax.Array]]] = []

    def emit(record: Record) -> None:
        run_state.history.append(record)
        for callback in callbacks:
            callback.on_record(run_state, record)

    def flush() -> None:
        fetched = distributed.fetch(pending)
        pending.clear()
        for round_index, device_metrics in fetched:
            emit({"round": round_index + 1, "kind": "train", **finalize_metrics(device_metrics)})

    # Multi-host: a signal stops every process at the same synced round (after its
    # checkpoint), not one process while the others wait for it in a collective.
    with distributed.signals_agreed() as stop_if_signalled:
        try:
            for callback in callbacks:
                callback.on_run_start(run_state)
            for round_index in range(run_state.rounds_done, settings.num_rounds):
                run_state.state, metrics = simulation.run_round(run_state.state, round_index)
                pending.append((round_index, metrics))
                done = run_state.rounds_done = round_index + 1
                last = run_state.last
                evaluates = last or bool(settings.eval_every and done % settings.eval_every == 0)
                # An evaluation syncs anyway; flushing before it keeps the records in
                # round order (train before eval) whatever log_every and the checkpoints'
                # rounds are, so those settings change no output and may change at a resume.
                synced = (evaluates or len(pending) >= settings.log_every
                          or any(c.syncs_at(done, last) for c in callbacks))
                if synced:
                    flush()
                if evaluates:
                    run_state.summaries = simulation.evaluate(run_state.state.params, done)
                    for name, summary in run_state.summaries.items():
                        emit({"round": done, "kind": "eval", "population": name,
                              **summary.to_dict()})
                for callback in callbacks:
                    callback.on_round_end(run_state)
                if synced:
                    stop_if_signalled()
        finally:
            for callback in callbacks:
                callback.on_run_end(run_state)
    return RunResult(summaries=run_state.summaries, history=run_state.history,
                     final_state=run_state.state, resumed_from=run_state.resumed_from,
                     earlier_wall_time_s=run_state.earlier_wall_time_s)
