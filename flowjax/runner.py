"""Run one config end to end and write its workdir (shared by every launcher)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import tqdm

from flowjax import config as run_config
from flowjax import experiment
from flowjax.reporting import write_json_atomic


def run_config_to_workdir(config, workdir: str, *, progress: bool = True) -> dict[str, Any]:
    """Trains and evaluates ``config``; writes ``config.json``, ``metrics.jsonl`` and
    ``results.json`` into ``workdir`` and returns the results dict.

    Raises:
      ValueError: a bad config value (one-line message), before anything is written.
    """
    simulation = run_config.build_simulation(config)
    os.makedirs(workdir, exist_ok=True)
    write_json_atomic(os.path.join(workdir, "config.json"),
                      json.loads(config.to_json_best_effort()))
    task = simulation.task
    print(f"{config.algorithm} on {task.name}: {len(task.train.client_ids)} training clients, "
          f"{len(task.held_out.client_ids) if task.held_out else 0} held-out clients, "
          f"{config.num_rounds} rounds x {config.clients_per_round} clients, "
          f"mapping={simulation.mapping.strategy}", flush=True)
    bar = tqdm.tqdm(total=config.num_rounds, unit="round", dynamic_ncols=True,
                    disable=not progress, desc=config.algorithm)

    def show(done, last):
        bar.update(done - bar.n)
        if last.get("loss") is not None:
            bar.set_postfix(loss=f"{last['loss']:.4f}")

    start = time.perf_counter()
    result = experiment.run(simulation, workdir=workdir, progress=show)
    bar.close()
    results = result.results_dict()
    results.update(algorithm=config.algorithm, dataset=task.name,
                   wall_time_s=time.perf_counter() - start,
                   compilations=dict(simulation.trace_counts))
    write_json_atomic(os.path.join(workdir, "results.json"), results)
    return results
