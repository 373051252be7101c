r"""What label-only predictors score on a config's clients: the floor that learning must beat.

  python launch/label_baselines.py --config=configs/fashion_mnist.py:mini_0.1

Prints, for the training clients' test splits (the population of the tables), the client
mean accuracy of predicting the most common label of all train data (a floor for Acc_g)
and of each client predicting its own most common train label (a floor for Acc_p); see
``flowjax.data.partition.majority_baselines``. Loads the data only; trains nothing.
"""

from launch import cli
cli.stop_at_once_while_starting(__name__)

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from flowjax import config as run_config  # noqa: E402
from flowjax.data.partition import majority_baselines  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Run config file, e.g. configs/fashion_mnist.py:mini_0.1.", lock_config=True)
_LABEL = flags.DEFINE_string("label", "y", "The label feature of the dataset's examples.")
cli.define_debug_flag()


def main(argv):
    del argv
    config = _CONFIG.value
    try:
        if config is None:
            raise ValueError("--config is required, e.g. --config=configs/fashion_mnist.py:mini_0.1")
        data = run_config.build_task(config).train
        if _LABEL.value not in data.example_spec:
            raise ValueError(f"--label={_LABEL.value!r}: not a feature of {config.dataset}; "
                             f"expected one of {sorted(data.example_spec)}")
        labels = {split: [data.client(i, split)[_LABEL.value]
                          for i in range(len(data.client_ids))] for split in ("train", "test")}
        floors = majority_baselines(labels["train"], labels["test"])
    except (ValueError, KeyError, OSError) as error:
        return cli.fail(error)
    print(f"{config.dataset} ({len(data.client_ids)} training clients, their test splits; "
          "client means)")
    print(f"  global majority label (floor for Acc_g): {100 * floors['global_majority']:.2f}%")
    print(f"  each client's majority train label (floor for Acc_p): "
          f"{100 * floors['client_majority']:.2f}%")
    return 0


if __name__ == "__main__":
    cli.run(main)
