r"""Client-steps/s of FedAvg and Flow rounds, per client-mapping strategy, side by side.

  python launch/benchmark.py                       # both models, every strategy
  python launch/benchmark.py --models=emnist_cnn --strategies=loop --repeats=5

For each model it times, in one process: a FedAvg round and a Flow round through the
engine (``Simulation.run_round``) for each strategy; the same clients trained by a Python
loop calling the same jitted ``client_update`` one client at a time (the FedJAX / PFLlib
way); and the centralized-equivalent work, ``steps`` SGD steps of the plain model on one
batch of ``clients x batch`` examples (the physical limit). A client-step is one minibatch
visited by one client: FedAvg visits ``steps`` per client (one epoch); Flow visits
``steps / 2`` in its local phase and ``steps / 2`` in its routing phase, where each
minibatch takes a policy step and a global step through both branches.

Options:
  --compare_torch (or --compare-torch): also time the EMNIST CNN's FedAvg round in PyTorch
    eager (``launch/torch_reference.py``). ``torch`` is optional, not a flowjax dependency
    (``pip install torch==2.13.0``); without it the comparison is skipped with one line.
  --scaling: FedAvg client-steps/s of the first model for cohorts of 1, 2, 4, ...
    ``--max_clients`` clients, and the memory each concurrently trained client needs.
  --skewed: Stack Overflow-like client sizes (``data.synthetic.stackoverflow_like_sizes``:
    log-normal, mean 397, capped at 1,000 examples) instead of ``steps x batch`` each. Each
    row then counts useful client-steps (every client's own batches) and reports
    useful / executed steps for its mapping: a loop runs each client's own steps, a
    vmapped group runs as long as its longest member (chunks are sorted longest first).
  --devices=1,2: also shard the clients axis over 2 devices (on CPU, emulate them with
    ``XLA_FLAGS=--xla_force_host_platform_device_count=2``).
  --plan_memory_gb=78: the memory planner's clients per vmapped chunk for FedAvg and Flow
    of each model on a device of that size (``flowjax.memory_plan``).
  --strategies=planned: sorted chunks whose size the memory planner chooses per method:
    the largest chunk that fits the device (``plan_chunk_size``; on CPU give
    ``--plan_memory_gb``) caps ``chunk_for_sizes``'s padding-vs-fill choice.
  --epochs=3: epochs per round (FedAvg; each of Flow's two phases).
  --algorithms=fedavg,flow,flow_fused: ``flow_fused`` is Flow with each layer's two branches
    in one product where its input outweighs its weights (``FlowConfig.fuse_branches``:
    the EMNIST CNN's convolutions), timed beside ``flow`` in the same run;
    ``flow_mixed_state`` is Flow whose LSTM layers route every cell application
    (``FlowConfig.recurrence='mixed_state'``).
  --conv_impl=im2col, --compute_dtype=bfloat16: the EMNIST CNN's conv formulation, and
    the matmul precision of the CNN and the LSTMs (``config.conv_impl``,
    ``config.compute_dtype``).
  --algorithms=fedavg,fedavg+lstm_unroll=20+steps_per_loop=10: a method with other loop
    shapes (the LSTMs' time steps per loop iteration, ``config.lstm_unroll``; local SGD
    steps per iteration of the step loop, ``config.sgd.steps_per_loop``), timed beside the
    plain method in the same process, with a ratio line for each.
  --algorithms=flow_mixed_state,flow_mixed_state+custom_grad=0: the same method with its
    model's hand-written VJPs (the plain entry, unless ``--custom_grad`` says otherwise)
    and with autodiff (``+custom_grad=0``), side by side in one process.
  --nopython_loop, --nocentralized: skip the sequential baseline / the centralized step
    (for cohorts where they take too long or, centralized, too much memory).
  --nowarmup: compile each round ahead of time (reported as ``compile s``) and time the
    first execution, instead of a warm-up round and then ``--repeats`` rounds: for rounds
    too long to run twice.
  --project_rounds=2000: also print clients/s and the time of that many such rounds.
  --profile_dir=DIR (with --nowarmup): one more execution of each engine round's compiled
    program under ``jax.profiler.trace(DIR/<model>-<method>-<mapping>)``, its HLO text
    beside it, and a summary of the trace printed and stored in the row
    (``launch/trace_summary.py``: device busy vs idle time, op time by kind, top ops).

The Stack Overflow scale run of ``launch/gpu_bench.sh``:

  python launch/benchmark.py --models=stackoverflow_lstm --skewed --clients=1000 --epochs=3 \
      --strategies=planned --nopython_loop --nocentralized --nowarmup --project_rounds=2000
"""

import os
import sys

from launch import cli, xla_env  # noqa: E402
cli.stop_at_once_while_starting(__name__)

xla_env.apply()

import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any, Sequence  # noqa: E402

from absl import flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from flowjax import run_folder  # noqa: E402
from flowjax.algorithms.base import client_optimizer, plain_loss_sums, sgd_step  # noqa: E402
from flowjax.core.checks import is_digits  # noqa: E402
from flowjax.core.cohort import client_at  # noqa: E402
from flowjax.core.mapping import (ClientMapping, default_mapping, executed_steps,  # noqa: E402
                                  num_devices_problem)
from flowjax.core.server_opt import server_optimizer  # noqa: E402
from flowjax.core.tree import weighted_mean  # noqa: E402
from flowjax.data.federated import FederatedTask  # noqa: E402
from flowjax.data.synthetic import stackoverflow_like_sizes  # noqa: E402
from flowjax.config import example_batch  # noqa: E402
from flowjax.memory_plan import (chunk_for_sizes, compiled_peak_bytes,  # noqa: E402
                                 plan_chunk_size)
from flowjax.experiment import RunSettings, Simulation  # noqa: E402
from flowjax.models import MODELS, get_model, model_takes  # noqa: E402
from launch import trace_summary  # noqa: E402
from launch.bench_common import (ALGORITHMS, BATCH, LEARNING_RATE, build_algorithm,  # noqa: E402
                                 first_and_median_seconds, median_seconds,
                                 synthetic_examples, synthetic_task)

_MODELS = flags.DEFINE_list("models", ["emnist_cnn", "shakespeare_lstm"], "Models to time.")
_STRATEGIES = flags.DEFINE_list("strategies", ["loop", "chunked", "vmap"], "Client mappings: "
                                 "loop, chunked (--chunk_size), chunked:N (N clients), vmap, "
                                 "planned (memory-planned sorted chunks).")
_CLIENTS = flags.DEFINE_integer("clients", 10, "Clients per round.", lower_bound=1)
_STEPS = flags.DEFINE_integer("steps", 20, "Minibatches per client per round.",
                             lower_bound=1)
_CHUNK = flags.DEFINE_integer("chunk_size", 5, "Clients per vmapped chunk for 'chunked'.",
                             lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repetitions (median reported).",
                               lower_bound=1)
_OUT = flags.DEFINE_string("json_out", None, "Optional JSON file for the measurements.")
_CUSTOM_GRAD = flags.DEFINE_enum("custom_grad", "auto", ["auto", "true", "false"],
                                 "Hand-written VJPs for convs/LSTMs (auto: the model's default).")
_COMPARE_TORCH = flags.DEFINE_bool(
    "compare_torch", False, "Also time the EMNIST CNN's FedAvg round in PyTorch eager. Needs the "
    "optional torch package (not a flowjax dependency; pip install torch==2.13.0); skipped "
    "with a note when it is missing.")
_SCALING = flags.DEFINE_bool("scaling", False, "FedAvg client-steps/s of the first model per "
                             "cohort size 1, 2, 4, ... --max_clients, with memory per client.")
_MAX_CLIENTS = flags.DEFINE_integer("max_clients", 32, "Largest cohort for --scaling.",
                                   lower_bound=1)
_SKEWED = flags.DEFINE_bool("skewed", False, "Stack Overflow-like client sizes (log-normal, "
                            "mean 397, capped at 1,000) instead of steps*batch each.")
_DEVICES = flags.DEFINE_list("devices", ["1"], "Device counts to shard the clients over.")
_PLAN_GB = flags.DEFINE_float("plan_memory_gb", 0.0, "Plan clients per chunk for this much "
                              "device memory (GiB; 0: no plan; 'planned' then uses the "
                              "device's own limit).", lower_bound=0.0)
_ALGORITHMS = flags.DEFINE_list(
    "algorithms", ["fedavg", "flow"],
    "Methods to time (fedavg, flow, flow_fused: Flow with FlowConfig.fuse_branches, "
    "flow_mixed_state: Flow with FlowConfig.recurrence='mixed_state'), each optionally with "
    "loop shapes or gradients, METHOD+OPTION=N (OPTION: lstm_unroll, steps_per_loop, N >= 1; "
    "custom_grad, N 0 or 1), "
    "timed beside the plain METHOD in the same process; not --methods, which compare.py and "
    "reproduce.py define in the same flag registry when tests import the launchers together.")
_EPOCHS = flags.DEFINE_integer("epochs", 1, "Epochs per round (each of Flow's two phases).",
                              lower_bound=1)
_CONV_IMPL = flags.DEFINE_enum("conv_impl", "auto", ["auto", "xla", "im2col", "im2col_slices"],
                               "EMNIST CNN convolution formulation (config.conv_impl).")
_COMPUTE_DTYPE = flags.DEFINE_enum("compute_dtype", "float32", ["float32", "bfloat16"],
                                   "Matmul dtype of the EMNIST CNN and the LSTMs (config.compute_dtype).")
_PYTHON_LOOP = flags.DEFINE_bool("python_loop", True, "Time the sequential Python loop.")
_CENTRALIZED = flags.DEFINE_bool("centralized", True, "Time the centralized-equivalent step.")
_WARMUP = flags.DEFINE_bool("warmup", True, "A warm-up round before the timed ones; without "
                            "it the round is compiled ahead of time and run --repeats times.")
_PROFILE = flags.DEFINE_string("profile_dir", None, "With --nowarmup: trace one more execution "
                                "of each engine round with JAX's profiler into a folder here "
                                "per row, and print where its time went "
                                "(launch/trace_summary.py).")
_PROJECT = flags.DEFINE_integer("project_rounds", 0, "Print clients/s and the time of this "
                                "many rounds (0: no projection).", lower_bound=0)
cli.define_debug_flag()

def client_sizes(clients: int, cap: int, skewed: bool, seed: int = 0) -> np.ndarray:
    """Examples per client: all ``cap`` (no padding at all), or Stack Overflow-like."""
    if not skewed:
        return np.full((clients,), cap, np.int64)
    return stackoverflow_like_sizes(clients, seed)


def client_steps(task: FederatedTask, batch: int) -> np.ndarray:
    """Each client's own minibatches per epoch (what a loop over clients runs)."""
    return -(-np.asarray(task.train.num_examples("train")) // batch)


class BadFlags(ValueError):
    """A flag combination the benchmark cannot run: one line, exit status 2."""


def model_options(model_name: str) -> dict:
    """The model factory's options the flags set (only those off their defaults, so a
    model without conv_impl / compute_dtype is built as before)."""
    options = {} if _CUSTOM_GRAD.value == "auto" else {"custom_grad": _CUSTOM_GRAD.value == "true"}
    if _CONV_IMPL.value != "auto":
        options["conv_impl"] = _CONV_IMPL.value
    if _COMPUTE_DTYPE.value != "float32":
        options["compute_dtype"] = _COMPUTE_DTYPE.value
    for name in ("conv_impl", "compute_dtype"):
        if name in options:
            require_option(model_name, name, f"--{name}")
    return options


def require_option(model_name: str, option: str, where: str) -> None:
    """Raises ``BadFlags`` naming ``where`` unless the model's factory takes ``option``."""
    if not model_takes(model_name, option):
        takers = [m for m in MODELS if model_takes(m, option)]
        raise BadFlags(f"{where}: {model_name} does not implement {option} "
                       f"(only {', '.join(takers)})")


# A variant's loop shapes, the model's (config.lstm_unroll) and the clients' SGD's
# (config.sgd.steps_per_loop), each N >= 1; and its gradients, the model's hand-written VJPs
# (custom_grad=1) or autodiff (0), timed side by side in one process (--custom_grad sets
# the plain methods' for the whole run).
LOOP_OPTIONS = ("lstm_unroll", "steps_per_loop")
SWITCH_OPTIONS = ("custom_grad",)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One ``--algorithms`` entry, ``METHOD[+OPTION=N...]``, built."""

    algorithm: Any
    steps_per_loop: int = 1


def parse_variant(entry: str) -> tuple[str, dict[str, int]]:
    """``"flow+lstm_unroll=20"`` -> ``("flow", {"lstm_unroll": 20})``."""
    method, *options = entry.split("+")
    if method not in ALGORITHMS:
        raise BadFlags(f"{entry!r}: expected one of {', '.join(ALGORITHMS)}, optionally with "
                       "+OPTION=N")
    parsed = {}
    for option in options:
        name, _, value = option.partition("=")
        if not (name in LOOP_OPTIONS and is_digits(value) and int(value) >= 1
                or name in SWITCH_OPTIONS and value in ("0", "1")):
            raise BadFlags(f"{entry!r}: expected +OPTION=N with OPTION one of "
                           f"{', '.join(LOOP_OPTIONS)} and N >= 1, or "
                           f"{', '.join(SWITCH_OPTIONS)} and N 0 or 1, not {option!r}")
        parsed[name] = int(value)
    return method, parsed


def _check_variants(entries: list[str]) -> bool:
    """``--algorithms``'s validator: a bad entry fails while the flags are parsed."""
    for entry in entries:
        try:
            parse_variant(entry)
        except BadFlags as error:
            raise flags.ValidationError(str(error)) from None
    return True


flags.register_validator("algorithms", _check_variants)


def algorithms(model_name: str, example_x) -> tuple[Any, dict[str, Variant]]:
    """The plain model (the centralized step's) and each ``--algorithms`` entry built."""
    if not _ALGORITHMS.value:
        raise BadFlags(f"--algorithms=: expected some of {', '.join(ALGORITHMS)}")
    options = model_options(model_name)
    model = get_model(model_name, **options)
    variants = {}
    for entry in _ALGORITHMS.value:
        method, entry_options = parse_variant(entry)
        built = model
        # The model's options (every one but the clients' SGD's steps_per_loop); the
        # switches as bools.
        model_options_of_entry = {k: bool(v) if k in SWITCH_OPTIONS else v
                                  for k, v in entry_options.items() if k != "steps_per_loop"}
        for name in model_options_of_entry:
            require_option(model_name, name, f"--algorithms: {entry!r}")
        if model_options_of_entry:
            built = get_model(model_name, **{**options, **model_options_of_entry})
        steps_per_loop = entry_options.get("steps_per_loop", 1)
        variants[entry] = Variant(build_algorithm(built, method, example_x, _EPOCHS.value,
                                                  steps_per_loop), steps_per_loop)
    return model, variants


def mapping_padding(cohort, mapping: ClientMapping, batch: int, epochs: int = 1,
                    steps_per_loop: int = 1) -> dict[str, float]:
    """Useful / executed client-steps of one round of ``epochs`` epochs under ``mapping``
    (``steps_per_loop``: ``run_epochs``'s), and useful examples / the example slots those
    executed steps hold."""
    steps = -(-np.asarray(cohort.num_examples) // batch)
    executed = executed_steps(steps, mapping, steps_per_loop) * epochs
    return {"useful_steps": int(np.sum(steps)) * epochs, "executed_steps": executed,
            "step_efficiency": float(np.sum(steps)) * epochs / executed,
            "example_efficiency": float(np.sum(cohort.num_examples)) * epochs / (executed * batch)}


def time_engine_round(algorithm, task, mapping: ClientMapping, repeats: int,
                      profile_dir: str | None = None, steps_per_loop: int = 1) -> dict:
    batch = BATCH[algorithm.model.name]
    settings = RunSettings(seed=0, num_rounds=1, clients_per_round=len(task.train.client_ids),
                           batch_size=batch, eval_held_out=False)
    simulation = Simulation(algorithm, task, settings, server_optimizer("sgd", 1.0), mapping)
    host_cohort = simulation.cohort(0)
    cohort = jax.device_put(host_cohort)
    state = simulation.init_state()

    def one_round():
        # The round donates its input state; hand it a fresh copy each time.
        fresh = jax.tree.map(jnp.copy, state)
        return simulation.run_round(fresh, 0, cohort)[0]

    if _WARMUP.value:
        # The first round's time, compiling included: what a variant costs before its
        # first step (an unrolled loop compiles for longer), and what a device script's
        # timeouts must leave room for.
        first, median = first_and_median_seconds(one_round, repeats)
        timing = {"round_s": median, "first_round_s": first}
    else:
        timing = time_compiled_round(simulation, state, cohort, repeats, profile_dir)
    return {**timing, "compilations": simulation.trace_counts["round"],
            **mapping_padding(jax.device_get(host_cohort), mapping, batch, _EPOCHS.value,
                              steps_per_loop)}


STRATEGY_SPELLINGS = "loop, chunked, chunked:N (N >= 1), vmap or planned"


def checked_device_counts(devices: Sequence[str], strategies: Sequence[str],
                          chunk_size: int) -> list[int]:
    """``--devices`` as integers, with ``--strategies`` checked against them; BadFlags (one
    line) before anything is timed: a bad value found mid-run lost the timings taken."""
    counts = []
    for text in devices:
        count = int(text) if is_digits(text.strip()) else None
        problem = (num_devices_problem(count) if count is not None
                   else "expected an integer >= 1")
        if problem:
            raise BadFlags(f"--devices={','.join(devices)}: {text!r}: {problem}")
        counts.append(count)
    if not counts or not strategies:
        raise BadFlags("--devices and --strategies: expected at least one value each")
    for strategy in strategies:
        if strategy == "planned":
            if counts != [1]:
                raise BadFlags("--strategies=planned plans one device's chunks; expected "
                               "--devices=1")
            continue
        try:
            parse_strategy(strategy, chunk_size, counts[0])
        except BadFlags:
            raise
        except ValueError:  # ClientMapping's: not a strategy
            raise BadFlags(f"--strategies={','.join(strategies)}: {strategy!r}; expected "
                           f"some of {STRATEGY_SPELLINGS}") from None
    return counts


def parse_strategy(strategy: str, chunk_size: int, devices: int) -> ClientMapping:
    """``loop`` / ``vmap`` / ``chunked`` (of ``chunk_size``) / ``chunked:N`` (of N)."""
    name, _, size = strategy.partition(":")
    if size and not (name == "chunked" and is_digits(size) and int(size) > 0):
        raise BadFlags(f"--strategies: {strategy!r}; expected chunked:N with N >= 1")
    return ClientMapping(name, int(size) if size else chunk_size, devices)


def time_compiled_round(simulation, state, cohort, repeats: int,
                        profile_dir: str | None = None) -> dict:
    """Compiles the round ahead of time, then times ``repeats`` executions with no warm-up
    run (the engine's own jitted round function, lowered for these exact arguments).
    With ``profile_dir``, one more execution runs under JAX's profiler (not timed)."""
    start = time.perf_counter()
    compiled = simulation._round_fn.lower(state, cohort, np.int32(0), None,
                                          simulation.seed_words).compile()
    compile_s = time.perf_counter() - start

    def execute():
        fresh = jax.tree.map(jnp.copy, state)  # donated by the round
        jax.block_until_ready(fresh)
        start = time.perf_counter()
        jax.block_until_ready(compiled(fresh, cohort, np.int32(0), None, simulation.seed_words))
        return time.perf_counter() - start

    times = [execute() for _ in range(repeats)]
    timing = {"round_s": statistics.median(times), "compile_s": compile_s}
    if profile_dir:
        timing["profile"] = profile_execution(execute, compiled.as_text(), profile_dir)
    return timing


def profile_execution(execute, hlo_text: str, directory: str) -> dict:
    """Runs ``execute`` once under ``jax.profiler.trace(directory)``, writes the compiled
    HLO beside the trace and returns (and prints) ``trace_summary``'s summary."""
    os.makedirs(directory, exist_ok=True)
    hlo_path = os.path.join(directory, "round.hlo.txt")
    with open(hlo_path, "w") as out:
        out.write(hlo_text)
    with jax.profiler.trace(directory):
        seconds = execute()
    summary = trace_summary.summarize_dir(directory, hlo_path)
    print(f"profiled one execution ({seconds:.3f} s, traced) into {directory}:\n"
          + trace_summary.format_summary(summary), flush=True)
    return {"directory": directory, "round_s_traced": seconds, "processes": summary}


def planned_mapping(algorithm, task, batch: int, device_bytes: int,
                    steps_per_loop: int = 1) -> ClientMapping:
    """Sorted chunks of the size ``chunk_for_sizes`` picks under the memory plan's cap
    (for the variant's ``steps_per_loop``)."""
    padded = -(-int(np.max(task.train.num_examples("train"))) // batch) * batch
    # The benchmark's cohort is every client of its task: the plan is the whole round's.
    plan = plan_chunk_size(algorithm, task.train.example_spec, padded_examples=padded,
                           batch_size=batch, device_bytes=device_bytes,
                           cohort_clients=len(task.train.client_ids))
    if plan.clients_per_chunk < 1:
        raise BadFlags(f"memory plan: not one client fits ({plan.describe()})")
    cohort = len(task.train.client_ids)
    try:
        chunk = chunk_for_sizes(
            client_steps(task, batch), plan.clients_per_chunk, steps_per_loop=steps_per_loop,
            fits=lambda k: compiled_peak_bytes(algorithm, task.train.example_spec, padded,
                                               batch, k, cohort_clients=cohort)
            <= plan.budget_bytes)
    except ValueError as error:
        raise BadFlags(f"memory plan: {error} ({plan.describe()})") from None
    print(f"memory plan, {algorithm.model.name} {algorithm.name}: {plan.describe()}; "
          f"chunk_for_sizes picks {chunk}")
    return ClientMapping("chunked", chunk)


def device_memory_limit() -> int:
    """The memory XLA's allocator may use on device 0 (what a plan must fit)."""
    stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        raise BadFlags("--strategies=planned on a backend that reports no memory "
                             "limit: give --plan_memory_gb")
    return int(stats["bytes_limit"])


def time_sequential_loop(algorithm, task, repeats):
    """A Python loop over clients, each calling the same jitted client update."""
    settings = RunSettings(seed=0, num_rounds=1, clients_per_round=len(task.train.client_ids),
                           batch_size=BATCH[algorithm.model.name], eval_held_out=False)
    simulation = Simulation(algorithm, task, settings, server_optimizer("sgd", 1.0))
    cohort = jax.device_put(simulation.cohort(0))
    params = simulation.init_state().params
    update = jax.jit(algorithm.client_update)
    mean = jax.jit(weighted_mean)
    clients = [client_at(cohort, i) for i in range(len(task.train.client_ids))]

    def one_round():
        results = [update(params, c, jax.random.key(i)) for i, c in enumerate(clients)]
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *[r.params for r in results])
        return mean(stacked, jnp.stack([r.weight for r in results]))

    return median_seconds(one_round, repeats)


def time_centralized(model, clients, steps, repeats):
    """``steps`` SGD steps of the plain model on batches of ``clients x batch`` examples."""
    batch = BATCH[model.name] * clients
    # Its own full-size data: under --skewed the clients hold fewer examples than this.
    x, y = synthetic_examples(model.name, steps * batch, np.random.default_rng(1))
    x = jnp.asarray(x).reshape((steps, batch) + x.shape[1:])
    y = jnp.asarray(y).reshape((steps, batch) + y.shape[1:])
    optimizer = optax.sgd(LEARNING_RATE[model.name])
    step = sgd_step(lambda p, b, k: plain_loss_sums(model, p, b, k), optimizer)
    params = model.init(jax.random.key(0))

    @jax.jit
    def train(params):
        def body(carry, batch):
            return step(carry, (batch[0], batch[1], jnp.ones(batch[0].shape[0])), jax.random.key(0))
        return jax.lax.scan(body, (params, optimizer.init(params)), (x, y))[0]

    return median_seconds(lambda: train(params), repeats)


def time_torch(model_name: str, task, steps: int, repeats: int) -> dict | None:
    """PyTorch eager FedAvg round on the task's clients, or None (with a note) if unavailable."""
    if model_name != "emnist_cnn":
        print(f"--compare_torch: only emnist_cnn has a PyTorch reference; skipping {model_name}")
        return None
    if importlib.util.find_spec("torch") is None:
        print("--compare_torch: torch is not installed (optional; pip install torch==2.13.0); "
              "skipping the PyTorch comparison")
        return None
    from launch import torch_reference  # only now: torch is optional

    data = task.train
    clients = [(rows["x"], rows["y"]) for rows in
               (data.client(i, "train") for i in range(len(data.client_ids)))]
    return torch_reference.time_fedavg_round(clients, steps=steps, batch=BATCH[model_name],
                                             learning_rate=LEARNING_RATE[model_name],
                                             repeats=repeats)


def mapping_label(mapping: ClientMapping) -> str:
    label = mapping.strategy + (f" {mapping.chunk_size}" if mapping.strategy == "chunked" else "")
    return label + (f", {mapping.num_devices} devices" if mapping.num_devices > 1 else "")


def profile_folder(model_name: str, method: str, mapping: str) -> str | None:
    """``--profile_dir``'s folder for one row, named in letters, digits, '.', '_', '-'."""
    if not _PROFILE.value:
        return None
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{model_name}-{method}-{mapping}").strip("_")
    return os.path.join(_PROFILE.value, name)


def time_model(model_name: str, clients: int, steps: int, repeats: int) -> dict:
    """Every row of one model's table: engine rounds per mapping, the Python loop, the
    centralized-equivalent step and (with --compare_torch) PyTorch eager."""
    batch = BATCH[model_name]
    task = synthetic_task(model_name, client_sizes(clients, steps * batch, _SKEWED.value))
    useful = int(np.sum(client_steps(task, batch))) * _EPOCHS.value
    model, methods = algorithms(model_name, example_batch(task, batch))
    # The centralized equivalent of the round's useful work: steps on batches of
    # clients x batch examples, timed for a whole number of steps and scaled to exactly
    # ``useful`` client-steps. Timed first and printed, so a run cut short by its
    # timeout still gives the rows it reached a denominator.
    central = None
    if _CENTRALIZED.value:
        central_steps = max(1, round(useful / clients))
        plain = (get_model(model_name, **{**model_options(model_name), "conv_impl": "xla"})
                 if model_name == "emnist_cnn" else model)  # the CNN's fastest: cuDNN's own
        central = (time_centralized(plain, clients, central_steps, repeats)
                   * (useful / (central_steps * clients)))
        print(f"timed the centralized-equivalent step: {useful / central:.1f} client-steps/s "
              f"({central:.3f} s)", flush=True)
    rows = {}
    for method, variant in methods.items():
        algorithm = variant.algorithm
        if _PYTHON_LOOP.value:
            rows[(method, "python loop (sequential)")] = {
                "round_s": time_sequential_loop(algorithm, task, repeats), "compilations": 1,
                "useful_steps": useful, "executed_steps": useful}
        for devices in (int(d) for d in _DEVICES.value):  # checked once, in run()
            for strategy in _STRATEGIES.value:
                if strategy == "planned":
                    memory = (int(_PLAN_GB.value * 2**30) if _PLAN_GB.value > 0
                              else device_memory_limit())
                    mapping = planned_mapping(algorithm, task, batch, memory,
                                              variant.steps_per_loop)
                    label = "planned"
                else:
                    mapping, label = parse_strategy(strategy, _CHUNK.value, devices), ""
                key = (method, mapping_label(mapping) + (f" ({label})" if label else ""))
                rows[key] = time_engine_round(algorithm, task, mapping, repeats,
                                              profile_folder(model_name, *key),
                                              variant.steps_per_loop)
                row = rows[key]
                cost = (f"first round, compiling included: {row['first_round_s']:.1f} s"
                        if "first_round_s" in row else f"compiled in {row['compile_s']:.1f} s")
                print(f"timed {key[0]}, {key[1]}: {row['round_s']:.3f} s per round ({cost})",
                      flush=True)  # before the table: a run cut short still reports it
    torch_row = time_torch(model_name, task, steps, repeats) if _COMPARE_TORCH.value else None
    return {"rows": rows, "torch": torch_row, "methods": tuple(methods), "useful_steps": useful,
            "centralized_s": central}


def print_model(model_name: str, timed: dict, clients: int, steps: int) -> dict:
    """Prints one model's table and ratio lines; returns them for the JSON report."""
    central, rows, useful = timed["centralized_s"], dict(timed["rows"]), timed["useful_steps"]
    if timed["torch"]:
        torch_row = timed["torch"]
        rows[("fedavg", f"pytorch {torch_row['torch']} eager, channels_last, "
                        f"{torch_row['threads']} threads")] = torch_row
    shape = ("Stack Overflow-like sizes" if _SKEWED.value else f"{steps} steps")
    options = ", ".join(f"{k}={v}" for k, v in model_options(model_name).items())
    print(f"\n{model_name}{f' ({options})' if options else ''}: {clients} clients x {shape} x "
          f"batch {BATCH[model_name]} x {_EPOCHS.value} epoch(s) ({useful} useful client-steps); "
          + (f"centralized-equivalent {useful / central:.1f} client-steps/s ({central:.3f} s)"
             if central else "no centralized-equivalent step timed"))
    print("| method | mapping | round s | useful client-steps/s | vs python loop | "
          "vs centralized | compilations | useful / executed steps |")
    print("|---|---|---|---|---|---|---|---|")
    results = [print_row(key, row, rows, central, useful) for key, row in rows.items()]
    out = {"centralized_s": central, "useful_steps": useful, "rows": results,
           "model_options": model_options(model_name), "epochs": _EPOCHS.value}
    print_ratios(timed, out)
    if _PROJECT.value:
        out["projection"] = print_projection(rows, clients, _PROJECT.value)
    return out


def print_projection(rows: dict, clients: int, rounds: int) -> list[dict]:
    """Clients/s of each engine row and the time ``rounds`` such rounds would take."""
    out = []
    for (method, mapping), row in rows.items():
        if "python" in mapping or "torch" in row:
            continue
        seconds = row["round_s"]
        compile_note = f", compiled once in {row['compile_s']:.0f} s" if "compile_s" in row else ""
        print(f"{method} {mapping}: {clients / seconds:.1f} clients/s; {rounds} rounds of "
              f"{clients} clients: {rounds * seconds / 3600:.2f} h{compile_note}")
        out.append({"method": method, "mapping": mapping, "clients_per_s": clients / seconds,
                    "rounds": rounds, "projected_hours": rounds * seconds / 3600})
    return out


def print_row(key, row: dict, rows: dict, central: float, client_steps: int) -> dict:
    """One table row; every ratio compares round times on the same clients' work."""
    (method, mapping), seconds = key, row["round_s"]
    # Eager PyTorch counts its own steps (one per real minibatch, as the loop does).
    client_steps = row.get("client_steps", client_steps)
    sequential = rows.get((method, "python loop (sequential)"), {}).get("round_s")
    useful = row.get("step_efficiency", 1.0 if "torch" in row or "python" in mapping else None)
    vs_loop = sequential / seconds if sequential else None
    vs_central = central / seconds if central else None
    print(f"| {method} | {mapping} | {seconds:.3f} | {client_steps / seconds:.1f} | "
          f"{'-' if vs_loop is None else f'{vs_loop:.2f}x'} | "
          f"{'-' if vs_central is None else f'{vs_central:.2f}'} | {row.get('compilations', '-')} "
          f"| {'-' if useful is None else f'{useful:.2f}'} |")
    return {"method": method, "mapping": mapping, **row,
            "client_steps_per_s": client_steps / seconds,
            "speedup_vs_python_loop": vs_loop, "fraction_of_centralized": vs_central}


def print_ratios(timed: dict, out: dict) -> None:
    """Flow over FedAvg, the device and padding lines and flowjax over PyTorch, into ``out``."""
    rows = timed["rows"]
    best = {m: min((k for k in rows if k[0] == m), key=lambda k: rows[k]["round_s"])
            for m in timed["methods"]}
    labels = {"flow": "Flow round", "fedavg": "FedAvg round",
              "flow_fused": "Flow round with fused branches",
              "flow_mixed_state": "Flow round with the mixed-state recurrence"}
    for slower, faster, suffix in (("flow", "fedavg", " (best mapping each)"),
                                   ("flow_fused", "fedavg", " (best mapping each)"),
                                   ("flow", "flow_fused", ""),
                                   ("flow_mixed_state", "flow", "")):
        if {slower, faster} <= set(best):
            ratio = rows[best[slower]]["round_s"] / rows[best[faster]]["round_s"]
            out[f"{slower}_over_{faster}"] = ratio
            print(f"{labels[slower]} / {labels[faster]}{suffix}: {ratio:.2f}x")
    for entry in best:  # each variant beside its plain method, when that was timed too
        method = parse_variant(entry)[0]
        if entry != method and method in best:
            ratio = rows[best[method]]["round_s"] / rows[best[entry]]["round_s"]
            out[f"{method}_over_{entry}"] = ratio
            print(f"{method} round / {entry} round (best mapping each): {ratio:.2f}x")
    engine = [key for key in rows if "step_efficiency" in rows[key]]
    if not engine:
        return
    # Padding is the mapping's: from its FedAvg row, else the first row timed with it
    # (a run of variants alone, fedavg+lstm_unroll=20 say, printed none before).
    by_mapping = {}
    for key in sorted(engine, key=lambda k: k[0] != "fedavg"):
        by_mapping.setdefault(key[1], key)
    out["padding"] = {mapping: {"step_efficiency": rows[k]["step_efficiency"],
                                "example_efficiency": rows[k]["example_efficiency"]}
                      for mapping, k in by_mapping.items()}
    print("useful / executed client-steps (example slots) per mapping: " + ", ".join(
        f"{name} {p['step_efficiency']:.2f} ({p['example_efficiency']:.2f})"
        for name, p in out["padding"].items()))
    out["devices"] = {}
    for method, mapping in engine:
        if ", " in mapping and "devices" in mapping:
            single = (method, mapping.split(", ")[0])
            if single in rows:
                speedup = rows[single]["round_s"] / rows[(method, mapping)]["round_s"]
                out["devices"][f"{method} {mapping}"] = speedup
                print(f"{method} {mapping} vs 1 device: {speedup:.2f}x faster")
    if timed["torch"]:
        fastest = min((k for k in engine if k[0] == "fedavg"), key=lambda k: rows[k]["round_s"])
        ratio = timed["torch"]["round_s"] / rows[fastest]["round_s"]
        out["flowjax_over_torch"] = {"mapping": fastest[1], "ratio": ratio}
        print(f"flowjax FedAvg ({fastest[1]}) / PyTorch eager, throughput on the same round: "
              f"{ratio:.2f}x")


def memory_plans(model_name: str, steps: int, gigabytes: float) -> dict:
    """Clients per vmapped chunk for FedAvg and Flow on ``gigabytes`` of device memory."""
    batch = BATCH[model_name]
    task = synthetic_task(model_name, client_sizes(2, steps * batch, _SKEWED.value))
    _, methods = algorithms(model_name, example_batch(task, batch))
    padded = int(np.max(task.train.num_examples("train")))
    padded = -(-padded // batch) * batch
    out = {}
    for method, variant in methods.items():
        plan = plan_chunk_size(variant.algorithm, task.train.example_spec, padded_examples=padded,
                               batch_size=batch, device_bytes=int(gigabytes * 2**30))
        print(f"memory plan, {model_name} {method}, {padded} examples per client, "
              f"{gigabytes:g} GiB: {plan.describe()}")
        out[method] = dataclasses.asdict(plan)
    return out


def tree_bytes(tree) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def memory_per_client(model_name: str, model, steps: int) -> dict[str, int]:
    """Bytes one concurrently trained FedAvg client holds: its params, grads, optimizer
    state and its cohort slice (activations come on top; see the device peak)."""
    params = model.init(jax.random.key(0))
    opt_state = client_optimizer(LEARNING_RATE[model_name]).init(params)
    x, y = synthetic_examples(model_name, steps * BATCH[model_name], np.random.default_rng(0))
    sizes = {"params": tree_bytes(params), "grads": tree_bytes(params),
             "optimizer": tree_bytes(opt_state), "data": x.nbytes + y.nbytes + y.shape[0]}
    return {**sizes, "total": sum(sizes.values())}


def peak_device_bytes() -> int | None:
    """The device's peak allocation so far, where the backend reports it (not on CPU)."""
    stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    return (stats or {}).get("peak_bytes_in_use")


def cohort_sizes(max_clients: int) -> list[int]:
    sizes = [1 << i for i in range(max(max_clients, 1).bit_length()) if 1 << i <= max_clients]
    return sizes + ([max_clients] if sizes[-1] != max_clients else [])


def scaling(model_name: str, steps: int, max_clients: int, repeats: int) -> dict:
    """FedAvg client-steps/s with the backend's default mapping per cohort size (equal-size
    clients, so only the cohort size changes), and memory per concurrent client."""
    mapping, batch = default_mapping(), BATCH[model_name]
    print(f"\nscaling, {model_name} FedAvg, mapping {mapping.strategy}, {steps} steps x batch "
          f"{batch}:\n| clients | round s | client-steps/s | device peak MB |\n|---|---|---|---|")
    rows = []
    for n in cohort_sizes(max_clients):
        task = synthetic_task(model_name, client_sizes(n, steps * batch, False))
        model, methods = algorithms(model_name, example_batch(task, batch))
        seconds = time_engine_round(methods["fedavg"].algorithm, task, mapping,
                                    repeats)["round_s"]
        peak = peak_device_bytes()
        rows.append({"clients": n, "round_s": seconds, "client_steps_per_s": n * steps / seconds,
                     "device_peak_bytes": peak})
        print(f"| {n} | {seconds:.3f} | {n * steps / seconds:.1f} | "
              f"{'-' if peak is None else f'{peak / 2**20:.0f}'} |")
    memory = memory_per_client(model_name, model, steps)
    print("memory per concurrently trained client (params + grads + optimizer + data): "
          + ", ".join(f"{k} {v / 2**20:.2f} MB" for k, v in memory.items()))
    if rows[-1]["device_peak_bytes"]:
        # An upper bound: the peak also holds the global state and any earlier, larger round.
        print(f"device peak / clients at {rows[-1]['clients']} clients: "
              f"{rows[-1]['device_peak_bytes'] / rows[-1]['clients'] / 2**20:.1f} MB")
    return {"model": model_name, "mapping": mapping.strategy, "rows": rows,
            "memory_per_client_bytes": memory}


def main(argv):
    # ``compile s`` must time XLA compiling, not a load from the launchers' cache.
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        run(argv)
    except BadFlags as error:
        return cli.fail(error)
    return 0


def run(argv):
    del argv
    unknown = [name for name in _MODELS.value if name not in BATCH]
    if unknown or not _MODELS.value:
        raise BadFlags(f"--models={','.join(_MODELS.value)}: {', '.join(unknown) or 'none given'}"
                       f" is not benchmarked; expected some of {', '.join(BATCH)}")
    if _PROFILE.value and _WARMUP.value:
        raise BadFlags(f"--profile_dir={_PROFILE.value}: expected --nowarmup as well; the "
                       "profiled execution reuses the round compiled ahead of time")
    checked_device_counts(_DEVICES.value, _STRATEGIES.value, _CHUNK.value)
    if _OUT.value:
        try:
            cli.check_output_file("json_out", _OUT.value)
        except ValueError as error:
            raise BadFlags(str(error)) from None
    clients, steps, repeats = _CLIENTS.value, _STEPS.value, _REPEATS.value
    report = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
              "jax": jax.__version__, "clients": clients, "steps": steps,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "custom_grad": _CUSTOM_GRAD.value,
              "conv_impl": _CONV_IMPL.value, "compute_dtype": _COMPUTE_DTYPE.value,
              "epochs": _EPOCHS.value, "skewed": _SKEWED.value, "models": {}}
    print(f"backend={report['backend']} device={report['device']} jax={report['jax']} "
          f"XLA_FLAGS='{report['xla_flags']}' custom_grad={_CUSTOM_GRAD.value}")
    for model_name in _MODELS.value:
        timed = time_model(model_name, clients, steps, repeats)
        report["models"][model_name] = print_model(model_name, timed, clients, steps)
    if _PLAN_GB.value > 0:
        report["memory_plans"] = {m: memory_plans(m, steps, _PLAN_GB.value) for m in _MODELS.value}
    if _SCALING.value:
        report["scaling"] = scaling(_MODELS.value[0], steps, _MAX_CLIENTS.value, repeats)
    if _OUT.value:  # atomically: an earlier measurement there survives a failed write
        run_folder.write_text_atomic(_OUT.value, json.dumps(report, indent=2))


def normalize_flag_spelling(argv: list[str]) -> list[str]:
    """``--compare-torch`` -> ``--compare_torch``: absl only knows underscores."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--":  # everything after is positional
            return out + argv[i:]
        if i and arg.startswith("--"):
            name, sep, value = arg[2:].partition("=")
            arg = "--" + name.replace("-", "_") + sep + value
        out.append(arg)
    return out


if __name__ == "__main__":
    sys.argv = normalize_flag_spelling(sys.argv)
    cli.run(main)
