"""Run one config end to end and write its workdir (shared by every launcher)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from typing import Any

import numpy as np
import tqdm

from flowjax import config as run_config
from flowjax import distributed
from flowjax import experiment
from flowjax.reporting import write_json_atomic
from flowjax.tensorboard_log import SUBDIR as TENSORBOARD_DIR
from flowjax.tensorboard_log import TensorBoardLog
from flowjax.validation import bad_values

RUN_FILES = ("config.json", "metrics.jsonl", "results.json", "run.json")


def resolved_config(config) -> dict[str, Any]:
    """The config as a run stores it in ``config.json`` (per-method rows applied)."""
    return json.loads(run_config.effective_config(config).to_json_best_effort())


def differing_fields(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted paths where two resolved configs differ."""
    fields = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            fields += differing_fields(a, b, f"{prefix}{key}.")
        elif a != b:
            fields.append(f"{prefix}{key}")
    return fields


def read_json(path: str, remedy: str) -> dict[str, Any] | None:
    """A run file's JSON (None when absent).

    Raises:
      ValueError: the file is not JSON, truncated say (one line ending in ``remedy``).
    """
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        try:
            return json.load(handle)
        except json.JSONDecodeError:
            raise ValueError(f"{path} is not valid JSON (truncated?); {remedy}") from None


def stored_config(workdir: str, remedy: str) -> dict[str, Any] | None:
    """The ``config.json`` a run left in ``workdir`` (None if there is none)."""
    return read_json(os.path.join(workdir, "config.json"), remedy)


def conflicting_fields(workdir: str, resolved: dict, remedy: str) -> list[str]:
    """Dotted fields in which the started run in ``workdir`` differs from ``resolved``.

    Empty when ``workdir`` holds no ``config.json`` or nothing was started (a config.json
    alone loses nothing when replaced). Raises ValueError (ending in ``remedy``) when the
    stored config is not JSON.
    """
    previous = stored_config(workdir, remedy)
    if previous is None or not run_started(workdir):
        return []
    return differing_fields(previous, resolved)


def check_workdir(workdir: str | None) -> None:
    """Refuses a workdir that cannot hold a run, before anything is loaded or written.

    Raises:
      ValueError: ``workdir`` is empty, is a file (or lies under one), or the folder it
        would be created in is not writable (one line).
    """
    if not workdir:
        raise ValueError("--workdir is missing or empty; expected a directory for the run's "
                         "files, e.g. --workdir=runs/quick")
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ValueError(f"--workdir={workdir} is a file; expected a directory (new, or "
                         "holding a run)")
    existing = os.path.abspath(workdir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"--workdir={workdir} lies under the file {existing}; expected a "
                         "directory path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--workdir={workdir}: {existing} is not writable; expected a "
                         "directory you can write")


def run_started(workdir: str) -> bool:
    """Whether ``workdir``'s run got past its start: a result, a training line in
    ``metrics.jsonl`` or anything under ``checkpoints/``. A ``config.json`` alone is a
    run that failed before its first round: replacing it loses nothing."""
    metrics = os.path.join(workdir, "metrics.jsonl")
    checkpoints = os.path.join(workdir, "checkpoints")
    return (os.path.exists(os.path.join(workdir, "results.json"))
            or (os.path.exists(metrics) and os.path.getsize(metrics) > 0)
            or (os.path.isdir(checkpoints) and bool(os.listdir(checkpoints))))


def prepare_workdir(workdir: str, resolved: dict[str, Any], overwrite: bool) -> None:
    """Refuses a workdir that holds a run of another config, unless ``overwrite``.

    With ``overwrite`` the previous run's files and checkpoints are removed; otherwise a
    workdir with the same config is resumed (or left as it is when finished).

    Raises:
      ValueError: a started run of another config, or the filesystem refused a write
        (one line).
    """
    path = os.path.join(workdir, "config.json")
    if not overwrite:
        differing = conflicting_fields(
            workdir, resolved, "use --overwrite to replace the run or another --workdir")
        if differing:
            raise ValueError(f"--workdir={workdir} holds a run with a different config "
                             f"(differs in: {', '.join(differing[:6])}); use --overwrite to "
                             f"replace it or another --workdir")
    if not distributed.is_primary():  # the other hosts of a multi-host run write nothing
        distributed.barrier("workdir prepared")
        return
    try:
        if overwrite:
            for name in RUN_FILES:
                if os.path.exists(os.path.join(workdir, name)):
                    os.remove(os.path.join(workdir, name))
            shutil.rmtree(os.path.join(workdir, "checkpoints"), ignore_errors=True)
            shutil.rmtree(os.path.join(workdir, TENSORBOARD_DIR), ignore_errors=True)
        os.makedirs(workdir, exist_ok=True)
        write_json_atomic(path, resolved)
    except OSError as error:
        raise ValueError(f"--workdir={workdir}: cannot write it ({error.strerror or error}); "
                         "expected a directory you can write") from None
    distributed.barrier("workdir prepared")


def explain_divergence(simulation, config, error: experiment.DivergenceError
                       ) -> experiment.DivergenceError:
    """``error`` with what went non-finite first: the round's inputs, then its labels (as
    ``validate_task`` checks them), else the loss and parameters, so the optimization."""
    cohort = simulation.host_cohort(error.round_number - 1)
    model = simulation.algorithm.model
    names = simulation.task.train.client_ids
    for feature, what in (("x", "inputs"), ("y", "labels")):
        for row, client in enumerate(np.asarray(cohort.client_id)):
            if client < 0:  # a padding client
                continue
            real = np.asarray(cohort.mask[row], bool)
            bad = bad_values(feature, np.asarray(getattr(cohort, feature)[row])[real], model)
            if bad is not None:
                return error.explained(
                    f"client {names[int(client)]!r} of the round has {what} {bad}",
                    "The data is at fault, not the learning rate: fix it and rerun")
    knobs = f"config.learning_rate (now {config.learning_rate:g})"
    if config.algorithm == "flow" and config.get("gamma", 0):
        knobs += f" or config.gamma (now {config.gamma:g})"
    return error.explained(
        f"{error.cause}, while the round's inputs and labels are valid",
        f"Lower {knobs}, or set on_divergence='skip_clients' to drop such clients and go on")


def run_config_to_workdir(config, workdir: str, *, progress: bool = True,
                          overwrite: bool = False) -> dict[str, Any]:
    """Trains and evaluates ``config``; writes ``config.json``, ``metrics.jsonl``,
    ``results.json`` (deterministic: same seed, same bytes) and ``run.json`` (wall time,
    compilations) into ``workdir``, resuming from its newest checkpoint if any; with
    ``config.tensorboard`` also TensorBoard event files in ``workdir/tensorboard/``.

    Raises:
      ValueError: a bad config value or an incompatible workdir (one-line message),
        before anything is written.
      experiment.DivergenceError: training went non-finite (``on_divergence='stop'``);
        the message names the round's bad inputs or labels first, if any.
    """
    check_workdir(workdir)
    simulation = run_config.build_simulation(config)
    resolved = resolved_config(config)
    config = run_config.effective_config(config)
    # Created before the workdir is touched, so a missing tensorboardX fails first.
    primary = distributed.is_primary()
    tensorboard = (TensorBoardLog(workdir) if config.get("tensorboard", False) and primary
                   else None)
    prepare_workdir(workdir, resolved, overwrite)
    task = simulation.task
    print(f"{config.algorithm} on {task.name}: {len(task.train.client_ids)} training clients, "
          f"{len(task.held_out.client_ids) if task.held_out else 0} held-out clients, "
          f"{config.num_rounds} rounds x {config.clients_per_round} clients, "
          f"mapping={simulation.mapping.strategy}", flush=True)
    bar = tqdm.tqdm(total=config.num_rounds, unit="round", dynamic_ncols=True,
                    disable=not (progress and primary), desc=config.algorithm)

    def show(done, last):
        bar.update(done - bar.n)
        if last.get("loss") is not None:
            bar.set_postfix(loss=f"{last['loss']:.4f}")

    warnings: list[str] = []

    def warn(message):
        warnings.append(message)
        bar.write(f"warning: {message}", file=sys.stderr)

    start = time.perf_counter()
    try:
        result = experiment.run(simulation, workdir=workdir, progress=show,
                                checkpoint_every=config.get("checkpoint_every", 0),
                                run_fingerprint=resolved, log=tensorboard,
                                on_divergence=config.get("on_divergence", "stop"), warn=warn)
    except experiment.DivergenceError as error:
        raise explain_divergence(simulation, config, error) from None
    finally:
        bar.close()
        if tensorboard is not None:
            tensorboard.close()
    results = result.results_dict()
    results.update(algorithm=config.algorithm, dataset=task.name)
    if not primary:
        return results
    write_json_atomic(os.path.join(workdir, "results.json"), results)
    write_json_atomic(os.path.join(workdir, "run.json"), {
        "wall_time_s": time.perf_counter() - start,
        "compilations": dict(simulation.trace_counts), "warnings": warnings})
    return results
