r"""Train and evaluate one method on one dataset.

  python launch/train.py --config=configs/shakespeare.py:quick --workdir=/tmp/run
  python launch/train.py --config=configs/shakespeare.py:paper --config.algorithm=fedavg \
      --workdir=/tmp/fedavg

The workdir receives ``config.json`` (the resolved config), ``metrics.jsonl`` (one line
per round and per evaluation) and ``results.json``; the results table is printed in the
paper's layout.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch import xla_env  # noqa: E402

xla_env.apply()

import json  # noqa: E402
import time  # noqa: E402

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402
import tqdm  # noqa: E402

from flowjax import config as run_config  # noqa: E402
from flowjax import experiment  # noqa: E402
from flowjax.reporting import results_table, write_json_atomic  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file, e.g. configs/shakespeare.py:quick.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for config, metrics and results.")
_DEBUG = flags.DEFINE_bool("debug", False, "Show full tracebacks on errors.")


def main(argv):
    del argv
    config = _CONFIG.value
    if config is None:
        raise app.UsageError("--config is required, e.g. --config=configs/shakespeare.py:quick")
    workdir = _WORKDIR.value
    if not workdir:
        raise app.UsageError("--workdir is required")
    try:
        simulation = run_config.build_simulation(config)
    except (ValueError, KeyError, ImportError) as error:
        if _DEBUG.value:
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2
    os.makedirs(workdir, exist_ok=True)
    write_json_atomic(os.path.join(workdir, "config.json"), json.loads(config.to_json_best_effort()))
    task = simulation.task
    print(f"{config.algorithm} on {task.name}: {len(task.train.client_ids)} training clients, "
          f"{len(task.held_out.client_ids) if task.held_out else 0} held-out clients, "
          f"{config.num_rounds} rounds x {config.clients_per_round} clients, "
          f"mapping={simulation.mapping.strategy}", flush=True)

    bar = tqdm.tqdm(total=config.num_rounds, unit="round", dynamic_ncols=True)

    def progress(done, last):
        bar.update(done - bar.n)
        if last.get("loss") is not None:
            bar.set_postfix(loss=f"{last['loss']:.4f}")

    start = time.perf_counter()
    result = experiment.run(simulation, workdir=workdir, progress=progress)
    bar.close()
    results = result.results_dict()
    results["algorithm"] = config.algorithm
    results["dataset"] = task.name
    results["wall_time_s"] = time.perf_counter() - start
    results["compilations"] = dict(simulation.trace_counts)
    write_json_atomic(os.path.join(workdir, "results.json"), results)
    print(results_table({config.algorithm: results}))
    print(f"wrote {os.path.join(workdir, 'results.json')} ({results['wall_time_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    flags.mark_flags_as_required(["workdir"])
    app.run(main)
