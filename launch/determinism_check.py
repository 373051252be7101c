"""Same seed, same numbers on this device? Runs the same rounds twice and compares bits.

XLA's CPU programs are deterministic; on a GPU, reductions that accumulate with atomics
(the scatter-add of an embedding's gradient, some cuDNN convolution algorithms) may sum
in a different order each run. This runs, for the EMNIST CNN (convolutions) and the Stack
Overflow LSTM (an embedding), FedAvg and Flow rounds on synthetic clients twice from the
same state, with the same compiled program, and reports whether the server parameters
and the round metrics agree bit for bit, and the largest difference where they do not.

  python launch/determinism_check.py [--rounds=2] [--clients=8] [--steps=4]
      [--models=emnist_cnn,stackoverflow_lstm] [--algorithms=fedavg,flow] [--json_out=F]

``launch/gpu_bench.sh`` runs it on the device; on CPU every case is identical.
"""

from __future__ import annotations

import json

from launch import xla_env

xla_env.apply()

from absl import flags  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from flowjax import run_folder  # noqa: E402
from flowjax.config import example_batch  # noqa: E402
from flowjax.models import get_model  # noqa: E402
from launch import cli  # noqa: E402
cli.stop_at_once_while_starting(__name__)
from launch.bench_common import BATCH, build_algorithm, run_twice, synthetic_task  # noqa: E402

_MODELS = flags.DEFINE_list("models", ["emnist_cnn", "stackoverflow_lstm"], "Models to check.")
_ALGORITHMS = flags.DEFINE_list("algorithms", ["fedavg", "flow"], "fedavg and/or flow.")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Rounds per run.")
_CLIENTS = flags.DEFINE_integer("clients", 8, "Clients per round (all of them).")
_STEPS = flags.DEFINE_integer("steps", 4, "Minibatches per client per epoch.")
_OUT = flags.DEFINE_string("json_out", None, "Optional JSON file for the outcome.")
cli.define_debug_flag()


def main(argv):
    del argv
    if _ROUNDS.value < 1 or _CLIENTS.value < 1 or _STEPS.value < 1:
        return cli.fail(ValueError(f"--rounds, --clients and --steps must be >= 1, got "
                                   f"{_ROUNDS.value}, {_CLIENTS.value}, {_STEPS.value}"))
    if _OUT.value:
        try:
            cli.check_output_file("json_out", _OUT.value)
        except ValueError as error:
            return cli.fail(error)
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}")
    outcome = {"device": device.device_kind, "platform": device.platform, "cases": {}}
    for model_name in _MODELS.value:
        if model_name not in BATCH:
            return cli.fail(ValueError(f"--models: {model_name!r} is not checked; expected "
                                       f"some of {', '.join(BATCH)}"))
        batch = BATCH[model_name]
        task = synthetic_task(model_name, np.full(_CLIENTS.value, _STEPS.value * batch))
        model = get_model(model_name)
        try:
            built = {name: build_algorithm(model, name, example_batch(task, batch))
                     for name in _ALGORITHMS.value}
        except ValueError as error:
            return cli.fail(error)
        for name, algorithm in built.items():
            case = run_twice(algorithm, task, _ROUNDS.value, batch)
            outcome["cases"][f"{model_name}/{name}"] = case
            verdict = ("identical" if case["identical"] else
                       f"DIFFERS in {case['differing_arrays']} of {case['arrays']} arrays, "
                       f"max |diff| {case['max_abs_diff']:.3g}")
            print(f"{model_name} {name}: {verdict} ({_ROUNDS.value} rounds x "
                  f"{_CLIENTS.value} clients, run twice)", flush=True)
    if _OUT.value:
        # Atomically: an earlier outcome there survives a failed write.
        run_folder.write_text_atomic(_OUT.value, json.dumps(outcome, indent=1))
    return 0


if __name__ == "__main__":
    cli.run(main)
