"""Run one config end to end and write its workdir (shared by every launcher)."""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

import tqdm

from flowjax import config as run_config
from flowjax import distributed
from flowjax import experiment
from flowjax.reporting import write_json_atomic
from flowjax.tensorboard_log import SUBDIR as TENSORBOARD_DIR
from flowjax.tensorboard_log import TensorBoardLog

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


def stored_config(workdir: str, remedy: str) -> dict[str, Any] | None:
    """The ``config.json`` a run left in ``workdir`` (None if there is none).

    Raises:
      ValueError: the file is not JSON (one line ending in ``remedy``).
    """
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        try:
            return json.load(handle)
        except json.JSONDecodeError:
            raise ValueError(f"{path} is not valid JSON; {remedy}") from None


def prepare_workdir(workdir: str, resolved: dict[str, Any], overwrite: bool) -> None:
    """Refuses a workdir that holds a run of another config, unless ``overwrite``.

    With ``overwrite`` the previous run's files and checkpoints are removed; otherwise a
    workdir with the same config is resumed (or left as it is when finished).
    """
    path = os.path.join(workdir, "config.json")
    previous = None if overwrite else stored_config(
        workdir, "use --overwrite to replace the run or another --workdir")
    if previous is not None:
        differing = differing_fields(previous, resolved)
        if differing:
            raise ValueError(f"--workdir={workdir} holds a run with a different config "
                             f"(differs in: {', '.join(differing[:6])}); use --overwrite to "
                             f"replace it or another --workdir")
    if not distributed.is_primary():  # the other hosts of a multi-host run write nothing
        distributed.barrier("workdir prepared")
        return
    if overwrite:
        for name in RUN_FILES:
            if os.path.exists(os.path.join(workdir, name)):
                os.remove(os.path.join(workdir, name))
        shutil.rmtree(os.path.join(workdir, "checkpoints"), ignore_errors=True)
        shutil.rmtree(os.path.join(workdir, TENSORBOARD_DIR), ignore_errors=True)
    os.makedirs(workdir, exist_ok=True)
    write_json_atomic(path, resolved)
    distributed.barrier("workdir prepared")


def run_config_to_workdir(config, workdir: str, *, progress: bool = True,
                          overwrite: bool = False) -> dict[str, Any]:
    """Trains and evaluates ``config``; writes ``config.json``, ``metrics.jsonl``,
    ``results.json`` (deterministic: same seed, same bytes) and ``run.json`` (wall time,
    compilations) into ``workdir``, resuming from its newest checkpoint if any; with
    ``config.tensorboard`` also TensorBoard event files in ``workdir/tensorboard/``.

    Raises:
      ValueError: a bad config value or an incompatible workdir (one-line message),
        before anything is written.
    """
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

    start = time.perf_counter()
    try:
        result = experiment.run(simulation, workdir=workdir, progress=show,
                                checkpoint_every=config.get("checkpoint_every", 0),
                                run_fingerprint=resolved, log=tensorboard,
                                on_divergence=config.get("on_divergence", "stop"))
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
        "compilations": dict(simulation.trace_counts)})
    return results
