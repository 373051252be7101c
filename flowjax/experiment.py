"""One call to run a simulation with the standard callbacks, and the engine's public names.

``run(simulation, workdir=..., checkpoint_every=...)`` builds the run folder's writers,
the divergence guard and an optional per-round function as callbacks and hands them to
``flowjax.engine.loop.run``; a caller wanting other callbacks calls that directly.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from flowjax.engine.callbacks import (LOSS_GROWTH_WARNING, Callback, DivergenceError,
                                      DivergenceGuard, OnRoundEnd, Record, loss_growth,
                                      print_warning, run_folder_callbacks)
from flowjax.engine.loop import RunResult, finalize_metrics
from flowjax.engine.loop import run as run_loop
from flowjax.engine.round import ServerState
from flowjax.engine.simulation import RunSettings, Simulation

__all__ = ["LOSS_GROWTH_WARNING", "DivergenceError", "RunResult", "RunSettings", "ServerState",
           "Simulation", "finalize_metrics", "loss_growth", "run"]


def run(simulation: Simulation, *, workdir: str | None = None,
        progress: Callable[[int, Record], None] | None = None,
        checkpoint_every: int = 0, run_fingerprint: dict[str, Any] | None = None,
        on_divergence: str = "stop", warn: Callable[[str], None] = print_warning,
        callbacks: Sequence[Callback] = ()) -> RunResult:
    """Trains for ``settings.num_rounds`` rounds, evaluating on the cadence and at the end.

    Args:
      simulation: what to run.
      workdir: where ``metrics.jsonl`` and ``checkpoints/`` go (None: nothing written).
      progress: called as ``progress(rounds_done, newest train record)`` after each round.
      checkpoint_every: save every N rounds and after the last one (0: never). With a
        workdir holding checkpoints, the run resumes from the newest complete one and
        replays exactly what the uninterrupted run would have done.
      run_fingerprint: JSON metadata a resumed checkpoint must match (the config). None
        checks nothing: a ``workdir`` holding another run's checkpoints is resumed as it
        is (the launchers pass the config, and refuse another run's folder before this).
      on_divergence, warn: see ``flowjax.engine.callbacks.DivergenceGuard``.
      callbacks: more callbacks, run after these.
    """
    guard = DivergenceGuard(on_divergence, warn)
    standard = [*run_folder_callbacks(workdir, checkpoint_every, run_fingerprint), guard]
    if progress is not None:
        standard.append(OnRoundEnd(progress))
    return run_loop(simulation, [*standard, *callbacks])
