"""The round loop: sample, assemble, train the cohort in one jit, aggregate, evaluate, log.

It runs whatever ``FederatedAlgorithm`` it is given and never imports one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from flowjax import distributed
from flowjax.algorithms.base import FederatedAlgorithm
from flowjax.checkpoint import Checkpointer, maybe_inject_fault
from flowjax.core import prng
from flowjax.core.client_state import ClientStateStore
from flowjax.core.cohort import ClientExamples, assemble_cohort, examples_per_client
from flowjax.core.mapping import ClientMapping, map_clients
from flowjax.core.sampler import ClientSampler
from flowjax.core.server_opt import apply_server_update
from flowjax.core.tree import select_tree, tree_all_finite, weighted_mean
from flowjax.data.federated import ArrayFederatedData, FederatedTask
from flowjax.evaluation.metrics import ClientCounts, EvalSummary, evaluate_client, summarize
from flowjax.reporting import write_text_atomic

PyTree = Any


@flax.struct.dataclass
class ServerState:
    """Everything the server carries between rounds."""

    params: PyTree
    opt_state: PyTree


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """The engine's knobs (the algorithm's own hyperparameters live in its config).

    Attributes:
      seed: root of every random stream of the run.
      num_rounds: training rounds.
      clients_per_round: M, clients sampled per round.
      batch_size: client batch size (shapes the cohorts).
      max_examples_per_client: cap on a training client's examples (None = no cap).
      max_eval_examples: cap on an eval client's train/test examples (None = no cap).
      eval_every: evaluate every N rounds (0 = only after the last round).
      eval_clients: train-population clients evaluated (None = all of them).
      eval_held_out_clients: held-out clients evaluated (None = all of them).
      eval_held_out: also evaluate the held-out ("newly joined") clients.
      eval_chunk: clients per evaluation call.
      log_every: rounds between host syncs for training metrics.
    """

    seed: int
    num_rounds: int
    clients_per_round: int
    batch_size: int
    max_examples_per_client: int | None = None
    max_eval_examples: int | None = None
    eval_every: int = 0
    eval_clients: int | None = None
    eval_held_out_clients: int | None = None
    eval_held_out: bool = True
    eval_chunk: int = 16
    log_every: int = 1

    def __post_init__(self):
        for name in ("num_rounds", "clients_per_round", "batch_size", "eval_chunk", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")
        for name in ("eval_clients", "eval_held_out_clients"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or None (all), got {getattr(self, name)}")


def _sum_metrics(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {name: jnp.sum(value) for name, value in metrics.items()}


def finalize_metrics(sums: dict[str, Any]) -> dict[str, float | None]:
    """``x_sum / x_count`` for every ``x`` (None when nothing counted); other entries
    pass through as floats."""
    out = {}
    for name, value in sums.items():
        if name.endswith("_sum"):
            base = name[: -len("_sum")]
            count = float(sums.get(f"{base}_count", 0.0))
            out[base] = float(value) / count if count > 0 else None
        elif not name.endswith("_count"):
            out[name] = float(value)
    return out


class Simulation:
    """A federated simulation of one algorithm on one task.

    Example:
      >>> sim = Simulation(algorithm, task, settings, server_optimizer=optax.sgd(1.0))
      >>> state = sim.init_state()
      >>> state, metrics = sim.run_round(state, 0)
    """

    def __init__(self, algorithm: FederatedAlgorithm, task: FederatedTask, settings: RunSettings,
                 server_optimizer: optax.GradientTransformation, mapping: ClientMapping | None = None):
        self.algorithm = algorithm
        self.task = task
        self.settings = settings
        self.server_optimizer = server_optimizer
        self.mapping = mapping or ClientMapping()
        num_train_clients = len(task.train.client_ids)
        self.sampler = ClientSampler(num_train_clients, settings.clients_per_round, settings.seed)
        self.cohort_clients = self.mapping.padded_clients(settings.clients_per_round)
        self.train_examples = examples_per_client(
            task.train.num_examples("train"), settings.batch_size, settings.max_examples_per_client)
        eval_sets = [d for d in self.eval_populations().values()]
        self.eval_train_examples = examples_per_client(
            np.concatenate([d.num_examples("train") for d in eval_sets]), settings.batch_size,
            settings.max_eval_examples)
        self.eval_test_examples = examples_per_client(
            np.concatenate([d.num_examples("test") for d in eval_sets]), settings.batch_size,
            settings.max_eval_examples)
        self.eval_cohort_clients = self.mapping.padded_clients(settings.eval_chunk)
        self.trace_counts = {"round": 0, "eval": 0}
        self.client_states: ClientStateStore | None = None
        self._round_fn = jax.jit(self._round, donate_argnums=(0,))
        self._eval_fn = jax.jit(self._evaluate_chunk)

    # ----------------------------------------------------------------- state
    def init_state(self) -> ServerState:
        """The round-0 server state; also resets the per-client state store."""
        params = self.algorithm.init(prng.base_key(self.settings.seed, prng.Purpose.INIT))
        if self.algorithm.stateful:
            self.client_states = ClientStateStore(
                jax.device_get(self.algorithm.init_client_state(params)))
        state = ServerState(params=params, opt_state=self.server_optimizer.init(params))
        if distributed.multiprocess() and self.mapping.num_devices > 1:
            # Every host computed the same state; one global array spans all their devices.
            state = distributed.replicate(state, self.mapping.mesh())
        return state

    # ----------------------------------------------------------------- training
    def _round(self, state: ServerState, cohort: ClientExamples, round_index: jax.Array,
               client_states: PyTree) -> tuple[ServerState, dict[str, jax.Array], PyTree]:
        self.trace_counts["round"] += 1  # runs only while tracing: counts compilations
        key_of_round = prng.round_key(prng.base_key(self.settings.seed, prng.Purpose.TRAIN),
                                      round_index)

        def one_client(examples: ClientExamples, client_state):
            key = prng.client_key(key_of_round, examples.client_id)
            return self.algorithm.client_update(state.params, examples, key, client_state)

        by_size = lambda examples, _: examples.num_examples  # noqa: E731
        results = map_clients(one_client, self.mapping, cost=by_size)(cohort, client_states)
        # A client whose update went non-finite is dropped from the mean (its params are
        # zeroed, since 0 * nan is nan) and counted; the run loop decides to stop or go on.
        finite = jax.vmap(tree_all_finite)(results.params)
        results = results.replace(
            params=jax.tree.map(lambda p: jnp.where(
                finite.reshape((-1,) + (1,) * (p.ndim - 1)), p, jnp.zeros_like(p)), results.params),
            weight=jax.tree.map(lambda w: jnp.where(finite, w, 0.0), results.weight),
            metrics=jax.tree.map(lambda m: jnp.where(finite, m, 0.0), results.metrics))
        if isinstance(results.weight, dict):
            # One weighted mean per parameter group (e.g. per cluster); a group nobody
            # trained keeps its params (zero pseudo-gradient).
            total_weight = sum(jnp.sum(w) for w in results.weight.values())
            client_mean = {
                group: select_tree(jnp.sum(results.weight[group]) > 0,
                                   weighted_mean(results.params[group], results.weight[group]),
                                   state.params[group])
                for group in state.params}
        else:
            total_weight = jnp.sum(results.weight)
            client_mean = weighted_mean(results.params, results.weight)
        params, opt_state = apply_server_update(self.server_optimizer, state.params,
                                                state.opt_state, client_mean)
        # A round whose clients all had nothing to train on leaves the server unchanged.
        trained = total_weight > 0
        new_state = ServerState(params=select_tree(trained, params, state.params),
                                opt_state=select_tree(trained, opt_state, state.opt_state))
        metrics = _sum_metrics(results.metrics)
        metrics["weight"] = total_weight
        metrics["clients_skipped"] = jnp.sum(~finite)
        new_client_states = results.client_state
        if client_states is not None:  # a dropped client keeps the state it came with
            new_client_states = jax.tree.map(
                lambda new, old: jnp.where(finite.reshape((-1,) + (1,) * (new.ndim - 1)), new, old),
                results.client_state, client_states)
        return new_state, metrics, new_client_states

    def host_cohort(self, round_index: int) -> ClientExamples:
        """The padded, stacked training cohort of a round (host numpy arrays)."""
        clients = self.sampler.sample(round_index)
        return assemble_cohort(self.task.train, "train", clients,
                               num_clients=self.cohort_clients,
                               padded_examples=self.train_examples,
                               batch_size=self.settings.batch_size)

    def cohort(self, round_index: int) -> ClientExamples:
        """The round's cohort where the round takes it (sharded over the mesh, if any)."""
        return self._place(self.host_cohort(round_index))

    def run_round(self, state: ServerState, round_index: int,
                  cohort: ClientExamples | None = None) -> tuple[ServerState, dict[str, jax.Array]]:
        """One round; metrics stay on device until the caller fetches them.

        Stateful methods sync once per round: the cohort's new client states come back to
        the host store.
        """
        if cohort is None:
            host = self.host_cohort(round_index)
            client_ids, cohort = host.client_id, self._place(host)
        else:  # a placed cohort: its ids come back from the devices (no wait on the round)
            client_ids = distributed.fetch(cohort.client_id)
        states = self._client_states_for(client_ids)
        # A numpy scalar, not a device array: every host passes the same host value.
        state, metrics, new_states = self._round_fn(state, cohort, np.int32(round_index), states)
        if self.client_states is not None:
            self.client_states.scatter(client_ids, distributed.fetch(new_states))
        return state, metrics

    def _client_states_for(self, client_ids: np.ndarray, population: str = "train_clients"):
        if self.client_states is None:
            return None
        if population != "train_clients":  # never trained: every client has the template
            client_ids = np.full_like(client_ids, -1)
        return self._place(self.client_states.gather(client_ids))

    def _place(self, stacked: ClientExamples) -> ClientExamples:
        sharding = self.mapping.client_sharding()
        return jax.device_put(stacked, sharding) if sharding is not None else stacked

    # ----------------------------------------------------------------- evaluation
    def eval_populations(self) -> dict[str, ArrayFederatedData]:
        populations = {"train_clients": self.task.train}
        if self.settings.eval_held_out and self.task.held_out is not None:
            populations["held_out_clients"] = self.task.held_out
        return populations

    def eval_client_indices(self, population: str) -> np.ndarray:
        """Which clients of a population are evaluated: all, or a seeded fixed subset (the
        same at every evaluation of the run)."""
        data = self.eval_populations()[population]
        num = len(data.client_ids)
        limit = (self.settings.eval_clients if population == "train_clients"
                 else self.settings.eval_held_out_clients)
        if limit is None or limit >= num:
            return np.arange(num)
        stream = [self.settings.seed, int(prng.Purpose.EVAL)]
        if population != "train_clients":
            stream.append(1)  # an independent draw per population
        rng = np.random.default_rng(stream)
        return np.sort(rng.choice(num, size=limit, replace=False))

    def _evaluate_chunk(self, params: PyTree, train: ClientExamples, test: ClientExamples,
                        round_index: jax.Array, population: jax.Array,
                        client_states: PyTree) -> ClientCounts:
        self.trace_counts["eval"] += 1
        stream = jax.random.fold_in(prng.base_key(self.settings.seed, prng.Purpose.EVAL),
                                    population)
        key_of_round = prng.round_key(stream, round_index)

        def one_client(train_examples, test_examples, client_state):
            key = prng.client_key(key_of_round, train_examples.client_id)
            return evaluate_client(self.algorithm, params, train_examples, test_examples, key,
                                   client_state)

        # Personalization trains on the train split: its size sets a client's run length.
        by_size = lambda train, test, _: train.num_examples  # noqa: E731
        return map_clients(one_client, self.mapping, cost=by_size)(train, test, client_states)

    def evaluate(self, params: PyTree, round_index: int) -> dict[str, EvalSummary]:
        """Personalize and evaluate every evaluated client of every population."""
        summaries = {}
        for population_index, (name, data) in enumerate(self.eval_populations().items()):
            indices = self.eval_client_indices(name)
            chunks = []
            for start in range(0, len(indices), self.eval_cohort_clients):
                chunk = indices[start: start + self.eval_cohort_clients]
                args = dict(num_clients=self.eval_cohort_clients,
                            batch_size=self.settings.batch_size)
                train = assemble_cohort(data, "train", chunk,
                                        padded_examples=self.eval_train_examples, **args)
                test = assemble_cohort(data, "test", chunk,
                                       padded_examples=self.eval_test_examples, **args)
                states = self._client_states_for(np.asarray(train.client_id), name)
                chunks.append(self._eval_fn(params, self._place(train), self._place(test),
                                            np.int32(round_index), np.int32(population_index),
                                            states))
            chunks = distributed.fetch(chunks)
            counts = jax.tree.map(lambda *a: np.concatenate(a), *chunks)
            summaries[name] = summarize(counts)
        return summaries


@dataclasses.dataclass
class RunResult:
    """What a finished run returns (and writes to ``results.json``)."""

    summaries: dict[str, EvalSummary]
    history: list[dict[str, Any]]
    final_state: ServerState

    def results_dict(self) -> dict[str, Any]:
        primary = self.summaries["train_clients"].to_dict()
        out = {"acc_g": primary["acc_g"], "acc_p": primary["acc_p"],
               "acc_p_soft": primary["acc_p_soft"],
               "clients_benefiting": primary["clients_benefiting"],
               "breakdown": primary["breakdown"], "num_eval_clients": primary["num_clients"]}
        out["populations"] = {name: s.to_dict() for name, s in self.summaries.items()}
        return out


DEFAULT_REMEDY = ("Lower the learning rate, or set on_divergence='skip_clients' to drop "
                  "such clients and go on")
# A training loss above this multiple of the run's first finite training loss is reported
# (once per run) as a warning: such growth means the run is diverging even while every
# value is still finite (FedAvg at learning_rate=1e30 reaches losses near 1e31).
LOSS_GROWTH_WARNING = 1e3


class DivergenceError(RuntimeError):
    """Training produced a non-finite loss or parameter.

    Attributes:
      round_number: the round (1-based) whose training went non-finite.
      loss: its training loss over the clients that stayed finite (None: none did).
      clients_skipped: clients of the round that returned non-finite parameters.
      last_good: the round of the newest checkpoint, None if none was written.
      cause: what went non-finite first; remedy: what to do about it. The engine sees
        only the loss and the parameters; ``flowjax.runner`` names a data fault instead
        when it finds one (``explained``).
    """

    def __init__(self, round_number: int, loss: float | None, clients_skipped: int,
                 last_good: int | None, cause: str | None = None, remedy: str | None = None):
        self.round_number, self.loss = round_number, loss
        self.clients_skipped, self.last_good = clients_skipped, last_good
        self.cause = cause or self.non_finite_values()
        self.remedy = remedy or DEFAULT_REMEDY
        where = (f"the last good checkpoint is round {last_good}" if last_good is not None
                 else "no checkpoint was written")
        super().__init__(f"round {round_number}: training diverged: {self.cause}; stopping, "
                         f"{where}. {self.remedy}")

    def non_finite_values(self) -> str:
        """The loss and parameters that went non-finite, as text."""
        params = f"{self.clients_skipped} client(s) returned non-finite parameters"
        if self.loss is None:  # no client stayed finite, so no loss was counted
            return f"all {params}"
        if not np.isfinite(self.loss):
            return f"the loss is {self.loss}" + (f" and {params}" if self.clients_skipped else
                                                 " (every client's parameters are finite)")
        return f"{params} (loss of the others {self.loss:g})"

    def explained(self, cause: str, remedy: str) -> "DivergenceError":
        """The same divergence with its cause and remedy named."""
        return DivergenceError(self.round_number, self.loss, self.clients_skipped,
                               self.last_good, cause, remedy)


def _check_finite(record: dict[str, Any], last_good: int | None) -> None:
    """Raises ``DivergenceError`` naming the round when a round went non-finite."""
    loss = record.get("loss")
    skipped = record.get("clients_skipped", 0) or 0
    if skipped or (loss is not None and not np.isfinite(loss)):
        raise DivergenceError(record["round"], loss, int(skipped), last_good)


def loss_growth(history: Sequence[dict[str, Any]], record: dict[str, Any]) -> str | None:
    """A warning when ``record``'s training loss exceeds ``LOSS_GROWTH_WARNING`` times the
    first finite, positive training loss in ``history``, else None.

    Example:
      >>> loss_growth([{"kind": "train", "round": 1, "loss": 4.0}],
      ...             {"kind": "train", "round": 2, "loss": 5e3})[:47]
      'round 2: training loss 5000 is over 1000x round'
    """
    loss = record.get("loss")
    if record.get("kind") != "train" or loss is None or not np.isfinite(loss):
        return None
    first = next((r for r in history if r.get("kind") == "train" and r.get("loss") is not None
                  and np.isfinite(r["loss"]) and r["loss"] > 0), None)
    if first is None or first is record or loss <= LOSS_GROWTH_WARNING * first["loss"]:
        return None
    return (f"round {record['round']}: training loss {loss:g} is over "
            f"{LOSS_GROWTH_WARNING:g}x round {first['round']}'s ({first['loss']:g}): the run is "
            "diverging; lower the learning rate")


def _print_warning(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def run(simulation: Simulation, *, workdir: str | None = None,
        progress: Callable[[int, dict[str, float]], None] | None = None,
        log: Callable[[dict[str, Any]], None] | None = None,
        checkpoint_every: int = 0, run_fingerprint: dict[str, Any] | None = None,
        on_divergence: str = "stop",
        warn: Callable[[str], None] = _print_warning) -> RunResult:
    """Trains for ``settings.num_rounds`` rounds, evaluating on the cadence and at the end.

    Training metrics are fetched from the device only every ``log_every`` rounds (and
    before each checkpoint), so the host prepares the next cohort while the device trains
    the current one.

    Args:
      simulation: what to run.
      workdir: where ``metrics.jsonl`` and ``checkpoints/`` go (None: nothing written).
      checkpoint_every: save every N rounds and after the last one (0: never). With a
        workdir holding checkpoints, the run resumes from the newest complete one and
        replays exactly what the uninterrupted run would have done.
      run_fingerprint: JSON metadata a resumed checkpoint must match (the config).
      on_divergence: ``stop`` raises ``DivergenceError`` when a client returns
        non-finite parameters or the loss is not finite; ``skip_clients`` drops such
        clients from the round's mean (always the case) and goes on, reporting them.
      warn: receives, once per run each, a line when the training loss grows past
        ``LOSS_GROWTH_WARNING`` times its first value and when ``skip_clients`` first
        drops a client (default: printed to stderr).
    """
    if on_divergence not in ("stop", "skip_clients"):
        raise ValueError(f"on_divergence={on_divergence!r}: expected 'stop' or 'skip_clients'")
    settings = simulation.settings
    state = simulation.init_state()
    history: list[dict[str, Any]] = []
    summaries: dict[str, EvalSummary] = {}
    first_round = 0
    checkpointer = None
    if workdir and checkpoint_every:
        checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"))
        latest = checkpointer.latest_round()
        if latest is not None:
            state, rows, meta = checkpointer.restore(latest, state, simulation.algorithm.stateful)
            if run_fingerprint is not None and meta.get("fingerprint") != run_fingerprint:
                raise ValueError(f"checkpoint {checkpointer.directory}/{latest} was written by "
                                 f"a different config; use another --workdir or --overwrite")
            if rows is not None:
                simulation.client_states.load_state_dict(rows)
            first_round, history = latest, list(meta["history"])
            summaries = {name: EvalSummary(**s) for name, s in meta.get("summaries", {}).items()}
    # Every process of a multi-host run trains; one writes (checkpoints: orbax coordinates).
    metrics_path = (os.path.join(workdir, "metrics.jsonl")
                    if workdir and distributed.is_primary() else None)
    if metrics_path:
        # Exactly the records up to the resumed round: lines a killed run wrote after its
        # last checkpoint are replayed, not duplicated.
        write_text_atomic(metrics_path, "".join(json.dumps(r) + "\n" for r in history))
    metrics_file = open(metrics_path, "a") if metrics_path else None
    pending: list[tuple[int, dict[str, jax.Array]]] = []
    last_good = first_round if first_round else None

    def emit(record):
        history.append(record)
        if metrics_file:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        if log:
            log(record)

    warned: set[str] = set()

    def warn_once(kind: str, message: str | None) -> None:
        if message is not None and kind not in warned:
            warned.add(kind)
            if distributed.is_primary():
                warn(message)

    def flush():
        for round_index, device_metrics in distributed.fetch(pending):
            record = {"round": round_index + 1, "kind": "train", **finalize_metrics(device_metrics)}
            emit(record)
            if on_divergence == "stop":
                _check_finite(record, last_good)
            elif record.get("clients_skipped"):
                warn_once("skipped", f"round {record['round']}: {int(record['clients_skipped'])} "
                          "client(s) returned non-finite parameters and were dropped "
                          "(on_divergence='skip_clients'; metrics.jsonl counts them per round)")
            warn_once("growth", loss_growth(history, record))
        pending.clear()

    try:
        for round_index in range(first_round, settings.num_rounds):
            state, metrics = simulation.run_round(state, round_index)
            maybe_inject_fault("round", round_index + 1)  # the round is still in flight
            pending.append((round_index, metrics))
            done = round_index + 1
            last = done == settings.num_rounds
            save = checkpointer is not None and (last or done % checkpoint_every == 0)
            if len(pending) >= settings.log_every or last or save:
                flush()
            if progress:
                progress(done, history[-1] if history else {})
            if last or (settings.eval_every and done % settings.eval_every == 0):
                summaries = simulation.evaluate(state.params, done)
                for name, summary in summaries.items():
                    emit({"round": done, "kind": "eval", "population": name, **summary.to_dict()})
            if save:
                rows = (simulation.client_states.state_dict()
                        if simulation.client_states is not None else None)
                meta = {"rounds_done": done, "history": history, "fingerprint": run_fingerprint,
                        "summaries": {n: s.to_dict() for n, s in summaries.items()}}
                checkpointer.save(done, state, rows, json.loads(json.dumps(meta)))
                last_good = done
    finally:
        if metrics_file:
            metrics_file.close()
        if checkpointer is not None:
            checkpointer.close()
    return RunResult(summaries=summaries, history=history, final_state=state)
