r"""Train and evaluate one method on one dataset.

  python launch/train.py --config=configs/shakespeare.py:quick --workdir=/tmp/run
  python launch/train.py --config=configs/shakespeare.py:paper --config.algorithm=fedavg \
      --workdir=/tmp/fedavg

The workdir receives ``config.json`` (the resolved config), ``metrics.jsonl`` (one line
per round and per evaluation) and ``results.json``; the results table is printed in the
paper's layout.

Several hosts (one command per host, the same flags except --process_id; the workdir on
a filesystem they share; the clients sharded over every host's devices):

  python launch/train.py --config=... --workdir=/shared/run \
      --config.mapping.num_devices=8 --coordinator_address=host0:8476 \
      --num_processes=2 --process_id=0     # on host0; --process_id=1 on host1
"""

from launch import cli, xla_env
cli.stop_at_once_while_starting(__name__)

xla_env.apply()

from absl import flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from flowjax import distributed  # noqa: E402
from flowjax.experiment import DivergenceError  # noqa: E402
from flowjax.reporting import results_table  # noqa: E402
from flowjax.runner import run_config_to_workdir  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Run config file, e.g. configs/shakespeare.py:quick.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for config, metrics and results.")
cli.define_debug_flag()
_OVERWRITE = flags.DEFINE_bool("overwrite", False,
                               "Replace a run of a different config in --workdir.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "Multi-host runs: HOST:PORT of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 1, "Multi-host runs: processes in all.")
_PROCESS_ID = flags.DEFINE_integer("process_id", 0, "Multi-host runs: this process's index.")


def main(argv):
    del argv
    # Library INFO lines (orbax's per-checkpoint messages) would bury the progress bar and
    # the results table; --verbosity=0 brings them back.
    if not flags.FLAGS['verbosity'].present:
        logging.set_verbosity(logging.WARNING)
    config = _CONFIG.value
    try:
        if config is None:
            raise ValueError("--config is required, e.g. --config=configs/shakespeare.py:quick")
        if _NUM_PROCESSES.value > 1:
            distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
        else:
            distributed.check_single_process(_COORDINATOR.value, _NUM_PROCESSES.value,
                                             _PROCESS_ID.value)
        results = run_config_to_workdir(config, _WORKDIR.value, overwrite=_OVERWRITE.value)
    except (ValueError, KeyError, ImportError, OSError, DivergenceError) as error:
        return cli.fail(error)
    if distributed.is_primary():
        print(results_table({config.algorithm: results}))
        print(f"wrote {_WORKDIR.value}/results.json")
    return 0


if __name__ == "__main__":
    flags.mark_flags_as_required(["workdir"])
    cli.run(main, resumable=True)
