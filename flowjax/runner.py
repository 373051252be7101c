"""Run one config end to end and write its workdir (shared by every launcher)."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import subprocess
import time
from typing import Any

import numpy as np

from flowjax import config as run_config
from flowjax import distributed, run_folder
from flowjax.checkpoint import checkpoint_meta
from flowjax.core import client_state
from flowjax.core.checks import new_folder_problem
from flowjax.engine import loop
from flowjax.engine.callbacks import (DivergenceError, DivergenceGuard, ProgressBar,
                                      run_folder_callbacks)
from flowjax.tensorboard_log import TensorBoardLog
from flowjax.validation import bad_values


def resolved_config(config) -> dict[str, Any]:
    """The config as a run stores it in ``config.json`` (each method's SGD resolved)."""
    return run_config.stored_config(config)


def conflicting_fields(workdir: str, resolved: dict, remedy: str) -> list[str]:
    """Dotted fields in which the started run in ``workdir`` differs from ``resolved``.

    Empty when nothing was started in ``workdir`` (a flowjax config.json alone loses
    nothing when replaced). Raises ValueError ending in ``remedy`` when the same config's
    unfinished run has checkpoints that ``checkpoint_every=0`` would not resume from (it
    would start over and lose them); ending in "use another --workdir" when
    ``config.json`` is not a flowjax run's (``stored_run_config``), or when a run's files
    lie there without one (``refuse_an_unknown_run``).
    """
    previous = stored_run_config(workdir)
    refuse_an_unknown_run(workdir)
    if not run_folder.run_started(workdir):
        return []
    if older_schema(previous):
        raise ValueError(f"{workdir} holds a run written by an older flowjax config schema "
                         f"(top-level learning_rate/gamma, no config.sgd), so it cannot be "
                         f"resumed or compared; nothing was deleted; {remedy}")
    differing = run_folder.resumable_differences(workdir, previous, resolved)
    checkpoints = run_folder.checkpoint_rounds(workdir)
    if _disk_states_asked_in_memory(workdir, resolved, checkpoints):
        # Refused here, before config.json is rewritten, not when the checkpoint is read.
        raise ValueError(f"{workdir} holds an unfinished run whose client states are in its "
                         f"client_states/ (client_states='disk'); expected "
                         f"--config.client_states=disk to resume it, or {remedy}")
    if (not differing and checkpoints and not resolved.get("checkpoint_every")
            and not run_folder.finished(workdir)):
        raise ValueError(f"{workdir} holds this config's unfinished run with checkpoints up "
                         f"to round {checkpoints[-1]}, which checkpoint_every=0 would not "
                         f"resume: the run would start over and lose them; expected "
                         f"checkpoint_every >= 1 to resume it (any value), or {remedy}")
    return differing


def _disk_states_asked_in_memory(workdir: str, resolved: dict, checkpoints: list[int]) -> bool:
    """Whether ``resolved`` keeps client states in memory while the unfinished run's newest
    checkpoint left them in ``client_states/`` (its fingerprint says "disk")."""
    if (not checkpoints or resolved.get("client_states", "memory") == "disk"
            or run_folder.finished(workdir) or not run_folder.has_client_state_files(workdir)):
        return False
    meta = checkpoint_meta(run_folder.path(workdir, run_folder.CHECKPOINTS), checkpoints[-1])
    return (meta.get("fingerprint") or {}).get("client_states") == "disk"


UNKNOWN_RUN_REMEDY = ("move its files away to run there (--overwrite deletes only a run "
                      "whose config.json says it is flowjax's), or use another --workdir")


def refuse_an_unknown_run(workdir: str) -> None:
    """Raises ValueError when ``workdir`` has no ``config.json`` but files or folders a
    run writes: every flowjax run writes ``config.json`` first, so these may be another
    program's (its ``checkpoints/``, its ``tensorboard/``), which ``--overwrite`` would
    delete and a run would write among."""
    if os.path.exists(run_folder.path(workdir, run_folder.CONFIG)):
        return
    present = run_folder.run_files_present(workdir)
    if present:
        raise ValueError(f"{workdir} holds {', '.join(present)} but no config.json, so what "
                         f"made them is unknown; nothing was deleted; {UNKNOWN_RUN_REMEDY}")


def stored_run_config(workdir: str) -> dict[str, Any] | None:
    """The ``config.json`` of the flowjax run in ``workdir``; None where there is none.

    Raises ValueError when a ``config.json`` is there but is not a flowjax run's, which a
    run would replace and ``--overwrite`` delete with the folder's other files: JSON
    without ``run_folder.CONFIG_MARKERS`` (``null`` too), or no JSON at all (a run writes
    it whole, atomically, so it is not a torn write of one).
    """
    file = run_folder.path(workdir, run_folder.CONFIG)
    if not os.path.exists(file):
        return None
    try:
        stored = run_folder.read_json(file, "")
    except ValueError:
        raise ValueError(f"{file} is not valid JSON, and a flowjax run writes it whole, so "
                         "what wrote it is unknown; nothing was changed; move it away to run "
                         "there, or use another --workdir") from None
    if not run_folder.is_run_config(stored):
        raise ValueError(f"{file} is not a flowjax run's config (it lacks "
                         f"{', '.join(run_folder.CONFIG_MARKERS)}); nothing was changed; use "
                         f"another --workdir")
    return stored


def older_schema(stored: dict) -> bool:
    """Whether a ``config.json`` predates ``config.sgd`` / ``config.methods.flow`` (its
    client SGD and Flow fields at the top level)."""
    return "sgd" not in stored and ("learning_rate" in stored or "per_method" in stored)


def check_workdir(workdir: str | None, writable: bool = True) -> None:
    """Refuses a workdir that cannot hold a run, before anything is loaded or written.

    Raises:
      ValueError: ``workdir`` is empty, is a file (or lies under one), or (``writable``)
        the folder it would be created in is not writable (one line).
    """
    if not workdir:
        raise ValueError("--workdir is missing or empty; expected a directory for the run's "
                         "files, e.g. --workdir=runs/quick")
    problem = new_folder_problem(workdir, writable)
    if problem and problem.kind == "file":
        raise ValueError(f"--workdir={workdir} is a file; expected a directory (new, or "
                         "holding a run)")
    if problem and problem.kind == "under_file":
        raise ValueError(f"--workdir={workdir} {problem}; expected a directory path")
    if problem:
        raise ValueError(f"--workdir={workdir}: {problem}; expected a directory you can "
                         "write")


def prepare_workdir(workdir: str, resolved: dict[str, Any], overwrite: bool) -> bool:
    """Refuses a workdir that holds a run of another config, unless ``overwrite``.

    With ``overwrite`` the previous run's files and checkpoints are removed; otherwise a
    workdir with the same config is resumed, or left as it is when finished. In a
    multi-host run every process checks, process 0 writes, and all stop together if one
    cannot go on (``distributed.stop_together``): after the checks nothing is written
    unless every process passed them with the same config and flags.

    Returns:
      Whether ``workdir`` already holds this config's finished run (nothing was written).

    Raises:
      ValueError: a started run of another config or of an unknown one (no
        ``config.json``), the filesystem refused a write, or (multi-host) another process
        failed, runs another command or sees another workdir (one line).
    """
    where = f"--workdir={workdir}"
    finished, error, wait_s = False, None, 0.0
    try:
        if distributed.multiprocess():
            wait_s = shared_fs_wait_s()  # a bad value stops every process, before writing
        finished = _checked_workdir(workdir, resolved, overwrite)
    except (ValueError, OSError) as raised:
        error = raised
    distributed.stop_together(error, where, json.dumps(
        [resolved, overwrite, finished], sort_keys=True, default=str).encode())
    if finished:
        return True
    if distributed.is_primary():  # the other hosts of a multi-host run write nothing
        try:
            if overwrite:
                run_folder.remove_run(workdir)
            # A killed attempt's half-written files: this process holds the lock.
            run_folder.remove_write_leftovers(workdir, run_folder.RUN_FILES)
            os.makedirs(workdir, exist_ok=True)
            run_folder.write_json_atomic(run_folder.path(workdir, run_folder.CONFIG), resolved)
        except OSError as raised:
            error = ValueError(f"{where}: cannot write it ({raised.strerror or raised}); "
                               "expected a directory you can write")
    distributed.stop_together(error, where)
    if not distributed.is_primary():
        error = _unseen_config(workdir, resolved, where, wait_s)
    distributed.stop_together(error, where)
    return False


# How long a process of a multi-host run looks for the config.json process 0 wrote. An
# NFS client trusts its cached lookups (this process found no config.json moments before)
# and a folder's cached attributes for up to acdirmax, 60 s by default (nfs(5)), so a file
# another host just created can stay out of sight that long. FLOWJAX_SHARED_FS_WAIT_S sets
# another bound.
SHARED_FS_WAIT_S = 60.0
_WAIT_VARIABLE = "FLOWJAX_SHARED_FS_WAIT_S"


def shared_fs_wait_s() -> float:
    """The bound on that wait: ``FLOWJAX_SHARED_FS_WAIT_S``, else ``SHARED_FS_WAIT_S``."""
    text = os.environ.get(_WAIT_VARIABLE)
    if text is None:
        return SHARED_FS_WAIT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise ValueError(f"{_WAIT_VARIABLE}={text!r}; expected seconds >= 0")
    return value


def _unseen_config(workdir: str, resolved: dict[str, Any], where: str,
                   wait_s: float) -> Exception | None:
    """None once this process reads the ``config.json`` process 0 wrote for ``resolved``
    (looking again every 0.5 s, for up to ``wait_s``); else why not."""
    expected = json.loads(json.dumps(resolved))
    deadline = time.monotonic() + wait_s
    while True:
        # Listing the folders makes an NFS client revalidate them, which drops its cached
        # "no such file" once the folder has changed on the server.
        for folder in (os.path.dirname(os.path.abspath(workdir)), workdir):
            try:
                os.listdir(folder)
            except OSError:
                pass
        try:
            written = run_folder.read_config(workdir, "expected the config.json process 0 wrote")
            error = None if written == expected else ValueError(
                f"{where}: this process does not see the config.json process 0 wrote; "
                f"expected a workdir on a filesystem every process shares")
        except (ValueError, OSError) as raised:
            error = raised
        if error is None or time.monotonic() >= deadline:
            return error
        time.sleep(0.5)


def _checked_workdir(workdir: str, resolved: dict[str, Any], overwrite: bool) -> bool:
    """Whether ``workdir`` holds this config's finished run; raises ValueError where it
    holds another run and ``overwrite`` is off. Writes nothing."""
    if overwrite:
        stored_run_config(workdir)
        refuse_an_unknown_run(workdir)
        return False
    differing = conflicting_fields(
        workdir, resolved, "use --overwrite to replace the run or another --workdir")
    if differing:
        raise ValueError(f"--workdir={workdir} holds a run with a different config "
                         f"(differs in: {run_folder.named_fields(differing)}); use "
                         f"--overwrite to replace it or another --workdir")
    return run_folder.finished(workdir)


def explain_divergence(simulation, run: run_config.ResolvedRun,
                       error: DivergenceError) -> DivergenceError:
    """``error`` with what went non-finite first: the round's inputs, then its labels (as
    ``validate_task`` checks them), else the loss and parameters, so the optimization.
    A diverged evaluation names the learning rate the clients personalized with."""
    own = run.config.methods[run.algorithm].get("sgd", {}).get("learning_rate") is not None
    where = f"methods.{run.algorithm}.sgd" if own else "sgd"
    knobs = f"config.{where}.learning_rate (now {run.sgd.learning_rate:g})"
    if run.algorithm == "flow" and run.method.gamma:
        knobs += f" or config.methods.flow.gamma (now {run.method.gamma:g})"
    server = run.config.server
    if (server.optimizer, server.learning_rate, server.momentum) != ("sgd", 1.0, 0.0):
        # Not plain averaging: the server's steps can grow the model the clients receive.
        knobs += f" or config.server.learning_rate (now {server.learning_rate:g})"
    # The guard's remedy ("Lower the learning rate, or ...") with the values to lower.
    remedy = error.remedy.replace("the learning rate", knobs, 1)
    if error.stage == "evaluation":
        return error.explained(error.cause, remedy)
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
    return error.explained(f"{error.cause}, while the round's inputs and labels are valid",
                           remedy)


def run_config_to_workdir(config, workdir: str, *, progress: bool = True,
                          overwrite: bool = False) -> dict[str, Any]:
    """Trains and evaluates ``config``; writes ``config.json``, ``metrics.jsonl``,
    ``results.json`` (deterministic: same seed, same bytes) and ``run.json`` (wall time,
    summed over the attempts of a resumed run; compilations) into ``workdir``, resuming
    from its newest checkpoint if any; with ``config.tensorboard`` also TensorBoard event
    files in ``workdir/tensorboard/``. A ``workdir`` that holds this config's finished run
    is left as it is and its stored results are returned (``overwrite`` runs it again).

    Raises:
      ValueError: a bad config value or an incompatible workdir (one-line message),
        before anything is written.
      DivergenceError: training went non-finite (``on_divergence='stop'``);
        the message names the round's bad inputs or labels first, if any.
    """
    # Checked on every process before the workdir is touched (a missing tensorboardX or
    # dataset on one host stops them all); only process 0 writes the TensorBoard log.
    primary, tensorboard, error = distributed.is_primary(), None, None
    try:
        check_workdir(workdir)
        run = run_config.resolve(config)
        resolved = resolved_config(config)
        tensorboard = TensorBoardLog(workdir) if config.get("tensorboard", False) else None
    except (ValueError, KeyError, ImportError, OSError) as raised:
        error = raised
    distributed.stop_together(error, f"--config for --workdir={workdir}")
    tensorboard = tensorboard if primary else None
    # One run per workdir at a time; process 0 holds the lock for a multi-host run.
    lock = run_folder.RunLock(workdir)
    try:
        error = None
        if primary:
            try:
                lock.acquire()
            except ValueError as raised:
                error = raised
        distributed.stop_together(error, f"--workdir={workdir}")
        return _run_in_workdir(config, workdir, run, resolved, tensorboard, progress,
                               overwrite)
    finally:
        lock.release()


def _run_in_workdir(config, workdir: str, run: run_config.ResolvedRun, resolved: dict[str, Any],
                    tensorboard: TensorBoardLog | None, progress: bool,
                    overwrite: bool) -> dict[str, Any]:
    """``run_config_to_workdir`` once its checks passed and its lock is held."""
    primary = distributed.is_primary()
    if prepare_workdir(workdir, resolved, overwrite):
        # Running it again would replace metrics.jsonl from round 0 (without checkpoints
        # the run starts over), so a finished run is reported, not retrained.
        print(f"{workdir}: finished earlier with this config; reusing its results.json "
              f"(--overwrite runs it again)", flush=True)
        if tensorboard is not None:  # turned on after the run: its records, once
            tensorboard.log_earlier(run_folder.read_metrics(workdir))
            tensorboard.close()
        return run_folder.read_results(workdir, "use --overwrite to run it again")
    # Timed from here: HypCluster's FedAvg warm-up (a stage of its own, before the
    # method's first round, run again by a resumed attempt) is part of the run's time.
    start = time.perf_counter()
    bar = ProgressBar(config.num_rounds, config.algorithm, enabled=progress and primary)
    warnings: list[str] = []

    def warn(message):
        warnings.append(message)
        bar.write(f"warning: {message}")

    # One guard for both stages: its warnings come once per run.
    guard = DivergenceGuard(config.get("on_divergence", "stop"), warn)
    try:
        starts = run_config.warm_up(run, guard)
    except DivergenceError as error:
        raise explain_divergence(run_config.warm_up_simulation(run), run, error) from None
    simulation = run_config.simulation_for(run, starts, workdir)
    task = simulation.task
    print(f"{config.algorithm} on {task.name}: {len(task.train.client_ids)} training clients, "
          f"{len(task.held_out.client_ids) if task.held_out else 0} held-out clients, "
          f"{config.num_rounds} rounds x {config.clients_per_round} clients, "
          f"mapping={simulation.mapping.strategy}", flush=True)

    shapes = simulation.client_state_shapes()
    if shapes is not None:
        on_disk = simulation.client_state_dir
        forecast = client_state.memory_forecast(
            shapes, len(task.train.client_ids), config.clients_per_round, config.num_rounds,
            client_state.host_memory_bytes() if on_disk is None
            else client_state.free_disk_bytes(on_disk), on_disk)
        if forecast.exceeds_available:
            warn(f"{forecast.line()}: the run may run out of "
                 f"{'memory' if on_disk is None else 'disk space'} before its last round")
        else:
            print(forecast.line(), flush=True)

    callbacks = [*run_folder_callbacks(workdir, config.get("checkpoint_every", 0), resolved),
                 *([tensorboard] if tensorboard is not None else []),
                 guard, bar]
    try:
        result = loop.run(simulation, callbacks)
    except DivergenceError as error:
        raise explain_divergence(simulation, run, error) from None
    results = result.results_dict()
    results.update(algorithm=config.algorithm, dataset=task.name)
    this_attempt = time.perf_counter() - start
    earlier = result.earlier_wall_time_s
    if earlier is None:
        warnings.append(f"resumed from round {result.resumed_from}'s checkpoint, which an "
                        f"older flowjax wrote without its time: wall_time_s counts only this "
                        f"attempt")

    def write_results() -> None:
        if not primary:  # the other hosts of a multi-host run write nothing
            return
        # run.json first: results.json marks the run finished, and a finished run is
        # reused, never rewritten, so a kill between the two would lose run.json.
        run_folder.write_json_atomic(run_folder.path(workdir, run_folder.RUN_INFO), {
            # A resumed run's time is its attempts' time to the resumed checkpoint plus
            # this attempt's (reproduce.py and compare.py sum it over cells and methods).
            "wall_time_s": this_attempt + (earlier or 0.0),
            "wall_time_s_this_attempt": this_attempt,
            "resumed_from_round": result.resumed_from,
            "compilations": dict(simulation.trace_counts), "warnings": warnings,
            "code": code_version()})
        run_folder.write_json_atomic(run_folder.path(workdir, run_folder.RESULTS), results)

    # Every process returns (a job's exit 0) only once process 0's results are on disk,
    # and all fail in one line if it cannot write them (a full disk).
    distributed.on_every_process(f"results of --workdir={workdir}", write_results)
    return results


@functools.cache
def code_version() -> dict[str, Any]:
    """The flowjax code that ran: its git commit and whether the checkout had uncommitted
    changes (None for both outside a git checkout), and the package version.

    Read once per process, when this module is imported: a process keeps running the code
    it imported, so a commit or an edit made while ``compare.py`` or ``reproduce.py`` runs
    method after method must not be recorded for the later methods.

    A cell is reused by its config alone (``conflicting_fields``); this tells a cell run
    by older code apart when a change alters a method's numbers.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = dirty = None
    # Only this checkout's own .git: a `git archive` copy inside another checkout would
    # otherwise report that checkout's commit.
    if os.path.exists(os.path.join(root, ".git")):
        try:
            commit = _git(root, "rev-parse", "HEAD").strip() or None
            dirty = bool(_git(root, "status", "--porcelain", "--untracked-files=no").strip())
        except (OSError, subprocess.SubprocessError):
            commit = dirty = None
    try:
        version = importlib.metadata.version("flowjax")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {"commit": commit, "dirty": dirty, "version": version}


def _git(root: str, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                          timeout=10, check=True).stdout


code_version()  # the checkout as this process imported it (see the docstring)
