"""The host side of a simulation: sample each round's clients, assemble and place their
padded cohort, gather and scatter per-client states, and run the jitted round and
evaluation of ``flowjax.engine.round`` on them.

It runs whatever ``FederatedAlgorithm`` it is given and never imports one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
import optax

from flowjax import distributed
from flowjax.core import prng
from flowjax.core.client_state import ClientStateStore
from flowjax.core.client_state_disk import DiskClientStateStore
from flowjax.core.cohort import ClientExamples, assemble_cohort, examples_per_client
from flowjax.core.mapping import ClientMapping
from flowjax.core.sampler import ClientSampler
from flowjax.data.federated import ArrayFederatedData, FederatedTask
from flowjax.engine.round import ServerState, make_eval_chunk, make_round
from flowjax.engine.protocol import FederatedAlgorithm
from flowjax.evaluation.metrics import EvalSummary, summarize

PyTree = Any


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
      first_round: the stage's first round: rounds ``0 .. first_round - 1`` belong to an
        earlier stage of the same seed (HypCluster's FedAvg warm-up), so this stage runs
        rounds ``first_round .. num_rounds - 1``, with their clients and training keys,
        continuing that stage's streams instead of replaying them.
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
    first_round: int = 0

    def __post_init__(self):
        for name in ("num_rounds", "clients_per_round", "batch_size", "eval_chunk", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")
        if not 0 <= self.first_round < self.num_rounds:
            raise ValueError(f"first_round must be in [0, num_rounds={self.num_rounds}), "
                             f"got {self.first_round}")
        for name in ("eval_clients", "eval_held_out_clients"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or None (all), got {getattr(self, name)}")


class Simulation:
    """A federated simulation of one algorithm on one task.

    ``trace_counts`` counts the traces (so compilations) of the round and the evaluation:
    one each in a run, whatever its length. ``earlier_records``: the training records of
    an earlier stage's rounds 1 to ``settings.first_round`` (HypCluster's FedAvg warm-up),
    with which the run's history, so ``metrics.jsonl``, starts.

    Example:
      >>> sim = Simulation(algorithm, task, settings, server_optimizer=optax.sgd(1.0))
      >>> state = sim.init_state()
      >>> state, metrics = sim.run_round(state, 0)
    """

    def __init__(self, algorithm: FederatedAlgorithm, task: FederatedTask, settings: RunSettings,
                 server_optimizer: optax.GradientTransformation, mapping: ClientMapping | None = None,
                 client_state_dir: str | None = None,
                 earlier_records: Sequence[dict[str, Any]] = ()):
        late = [r.get("round") for r in earlier_records
                if not 1 <= r.get("round", 0) <= settings.first_round]
        if late:
            raise ValueError(f"earlier_records: round {late[0]} is not an earlier stage's: "
                             f"expected rounds 1 to first_round={settings.first_round}")
        self.earlier_records = tuple(earlier_records)
        self.algorithm = algorithm
        # Where a stateful method's client states live: host memory (None) or files of
        # this folder (``DiskClientStateStore``).
        self.client_state_dir = client_state_dir
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
        self._round_fn = jax.jit(self._counted("round", make_round(
            algorithm, server_optimizer, self.mapping)), donate_argnums=(0,))
        self._eval_fn = jax.jit(self._counted("eval", make_eval_chunk(algorithm, self.mapping)))
        # Host words, like round_index: every host passes the same value.
        self.seed_words = prng.seed_words(settings.seed)

    def _counted(self, kind: str, fn):
        def traced(*args):
            self.trace_counts[kind] += 1  # runs only while tracing: counts compilations
            return fn(*args)
        return traced

    # ----------------------------------------------------------------- state
    def client_state_shapes(self) -> Any:
        """Shapes and dtypes of one client's state (``jax.ShapeDtypeStruct`` leaves,
        nothing computed); None for a method without client state."""
        if not self.algorithm.stateful:
            return None
        return jax.eval_shape(
            lambda: self.algorithm.init_client_state(self._initial_params()))

    def _initial_params(self):
        return self.algorithm.init(prng.base_key(self.settings.seed, prng.Purpose.INIT))

    def init_state(self) -> ServerState:
        """The round-0 server state; also resets the per-client state store."""
        params = self._initial_params()
        if self.algorithm.stateful:
            template = jax.device_get(self.algorithm.init_client_state(params))
            self.client_states = (
                ClientStateStore(template) if self.client_state_dir is None
                else distributed.on_every_process(
                    f"client states in {self.client_state_dir}",
                    lambda: DiskClientStateStore(template, self.client_state_dir,
                                                 chain_token=distributed.shared_token())))
        state = ServerState(params=params, opt_state=self.server_optimizer.init(params))
        if self.mapping.num_devices > 1:
            # Replicated where the round leaves it, so round 2 does not compile the round
            # again for a new input sharding; across hosts, every host computed the same
            # state and one global array spans all their devices.
            state = distributed.replicate(state, self.mapping.mesh())
        return state

    # ----------------------------------------------------------------- training
    def host_cohort(self, round_index: int) -> ClientExamples:
        """The padded, stacked training cohort of a round (host numpy arrays)."""
        clients = self.sampler.sample(round_index)
        return assemble_cohort(self.task.train, "train", clients,
                               num_clients=self.cohort_clients,
                               padded_examples=self.train_examples,
                               batch_size=self.settings.batch_size,
                               max_examples=self.settings.max_examples_per_client)

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
        state, metrics, new_states = self._round_fn(
            state, cohort, np.int32(round_index), states, self.seed_words)
        if self.client_states is not None:
            new_states = distributed.fetch(new_states)
            store = lambda: self.client_states.scatter(client_ids, new_states)  # noqa: E731
            if self.client_state_dir is None:  # host memory: no file to fail
                store()
            else:
                distributed.on_every_process(f"round {round_index + 1}: client states in "
                                             f"{self.client_state_dir}", store)
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
        same at every evaluation of the run) of those with test examples.

        A client without test examples has no accuracy and is left out of every mean, so a
        subset is drawn among the others: ``eval_clients=1000`` on Stack Overflow, whose
        test split holds 204,088 of the 342,477 training clients (TFF's counts), averages
        1,000 clients, as the paper does. Where every client has test examples the draw is
        unchanged.
        """
        data = self.eval_populations()[population]
        num = len(data.client_ids)
        limit = (self.settings.eval_clients if population == "train_clients"
                 else self.settings.eval_held_out_clients)
        if limit is None:
            return np.arange(num)
        testable = np.flatnonzero(np.asarray(data.num_examples("test")) > 0)
        if limit >= len(testable):
            return testable
        words = [int(prng.Purpose.EVAL)]
        if population != "train_clients":
            words.append(1)  # an independent draw per population
        rng = prng.host_rng(self.settings.seed, *words)
        return np.sort(testable[rng.choice(len(testable), size=limit, replace=False)])

    def evaluate(self, params: PyTree, round_index: int) -> dict[str, EvalSummary]:
        """Personalize and evaluate every evaluated client of every population."""
        summaries = {}
        for population_index, (name, data) in enumerate(self.eval_populations().items()):
            indices = self.eval_client_indices(name)
            if not len(indices):  # a capped draw among no client with test examples
                raise ValueError(f"no {name} client has a test instance; cannot summarize")
            chunks, rows = [], []
            for start in range(0, len(indices), self.eval_cohort_clients):
                chunk = indices[start: start + self.eval_cohort_clients]
                args = dict(num_clients=self.eval_cohort_clients,
                            batch_size=self.settings.batch_size,
                            max_examples=self.settings.max_eval_examples)
                train = assemble_cohort(data, "train", chunk,
                                        padded_examples=self.eval_train_examples, **args)
                test = assemble_cohort(data, "test", chunk,
                                       padded_examples=self.eval_test_examples, **args)
                rows.append(np.asarray(train.client_id))  # -1: a padding client
                states = self._client_states_for(rows[-1], name)
                chunks.append(self._eval_fn(params, self._place(train), self._place(test),
                                            np.int32(round_index), np.int32(population_index),
                                            states, self.seed_words))
            chunks = distributed.fetch(chunks)
            counts = jax.tree.map(lambda *a: np.concatenate(a), *chunks)
            names = [data.client_ids[i] if i >= 0 else "" for i in np.concatenate(rows)]
            summaries[name] = summarize(counts, names,
                                        snapshot_split=self.algorithm.snapshot_split)
        return summaries
