"""How many clients fit in one vmapped chunk, from XLA's own memory analysis.

The compiler knows the peak memory of a compiled computation before it runs. The planner
compiles (never runs) one vmapped client update for two chunk sizes on abstract inputs,
or, given the run's cohort size, the whole round over that cohort in chunks of those
sizes (what grows with the cohort, its data and every client's outputs, is then part of
the fixed cost); it fits ``peak = fixed + chunk * per_client``, solves for the largest
chunk under the device budget, and compiles that chunk once more to check it. Works on
every backend; on CPU it plans host memory.

Example:
  >>> plan = plan_chunk_size(algorithm, spec, padded_examples=1008, batch_size=16,
  ...                        device_bytes=78 * 2**30)
  >>> plan.clients_per_chunk
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from flowjax.algorithms.base import FederatedAlgorithm
from flowjax.core import prng
from flowjax.core.cohort import ClientExamples
from flowjax.core.mapping import ClientMapping, chunk_step_counts
from flowjax.engine.round import ServerState, make_round

# The fitted points: small enough to compile quickly, large enough that XLA's per-client
# buffers dominate its constant ones.
_PROBES = (2, 4)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """A chunk size and the memory model behind it (bytes).

    Attributes:
      fixed_bytes: what a chunk needs whatever its size (server params, constants).
      per_client_bytes: what each client of a chunk adds (its params, grads, optimizer
        state, copies, activations and data).
      budget_bytes: the usable device memory the plan fits under.
      clients_per_chunk: the largest chunk predicted to fit (0 if not even one).
      checked_peak_bytes: the compiled peak of that chunk (None if 0 clients).
    """

    fixed_bytes: int
    per_client_bytes: int
    budget_bytes: int
    clients_per_chunk: int
    checked_peak_bytes: int | None

    def describe(self) -> str:
        mib = 2 ** 20
        return (f"{self.clients_per_chunk} clients per chunk fit in {self.budget_bytes / mib:,.0f}"
                f" MiB ({self.per_client_bytes / mib:,.1f} MiB per client + "
                f"{self.fixed_bytes / mib:,.1f} MiB fixed"
                + (f"; compiled peak at that chunk {self.checked_peak_bytes / mib:,.0f} MiB)"
                   if self.checked_peak_bytes is not None else ")"))


def _abstract_chunk(algorithm: FederatedAlgorithm, example_spec: Mapping[str, tuple],
                    padded_examples: int, batch_size: int, clients: int):
    steps = padded_examples // batch_size

    def stacked(shape, dtype):
        return jax.ShapeDtypeStruct((clients, steps, batch_size) + tuple(shape), dtype)

    examples = ClientExamples(
        x=stacked(*example_spec["x"]), y=stacked(*example_spec["y"]),
        mask=stacked((), jnp.bool_),
        num_examples=jax.ShapeDtypeStruct((clients,), jnp.int32),
        client_id=jax.ShapeDtypeStruct((clients,), jnp.int32))
    params = jax.eval_shape(algorithm.init, jax.random.key(0))
    states = None
    if algorithm.stateful:
        one = jax.eval_shape(algorithm.init_client_state, params)
        states = jax.tree.map(lambda s: jax.ShapeDtypeStruct((clients,) + s.shape, s.dtype), one)
    return params, examples, states


def compiled_peak_bytes(algorithm: FederatedAlgorithm, example_spec: Mapping[str, tuple],
                        padded_examples: int, batch_size: int, clients: int,
                        cohort_clients: int | None = None,
                        server_optimizer: optax.GradientTransformation | None = None) -> int:
    """Peak memory XLA plans for ``clients`` vmapped client updates and their mean; with
    ``cohort_clients``, for the whole round that runs them (``make_round`` over that many
    clients in chunks of ``clients``, as the ``chunked`` mapping runs it): beyond a chunk's
    own buffers it holds the whole cohort, its copy sorted by size, every client's outputs
    and their copy in cohort order, which grow with the cohort, not the chunk.
    ``server_optimizer`` (default: FedAvg's ``sgd(1.0)``) adds its state."""
    if cohort_clients is not None:
        return _compiled_round_peak(algorithm, example_spec, padded_examples, batch_size,
                                    clients, cohort_clients,
                                    server_optimizer or optax.sgd(1.0))
    params, examples, states = _abstract_chunk(algorithm, example_spec, padded_examples,
                                               batch_size, clients)

    def chunk(params, examples, states):
        def one(ex, state):
            result = algorithm.client_update(params, ex, jax.random.key(0), state)
            return result.params, result.client_state
        updates, new_states = jax.vmap(one)(examples, states)
        return jax.tree.map(lambda u: jnp.mean(u, axis=0), updates), new_states

    return _peak(jax.jit(chunk).lower(params, examples, states).compile())


def _compiled_round_peak(algorithm: FederatedAlgorithm, example_spec: Mapping[str, tuple],
                         padded_examples: int, batch_size: int, chunk: int,
                         cohort_clients: int,
                         server_optimizer: optax.GradientTransformation) -> int:
    params, cohort, states = _abstract_chunk(algorithm, example_spec, padded_examples,
                                             batch_size, cohort_clients)
    state = ServerState(params=params, opt_state=jax.eval_shape(server_optimizer.init, params))
    round_fn = make_round(algorithm, server_optimizer,
                          ClientMapping("chunked", min(chunk, cohort_clients)))
    lowered = jax.jit(round_fn).lower(state, cohort, np.int32(0), states, prng.seed_words(0))
    return _peak(lowered.compile())


def _peak(compiled) -> int:
    analysis = compiled.memory_analysis()
    peak = getattr(analysis, "peak_memory_in_bytes", 0) or 0
    if jax.default_backend() == "cpu" or not peak:
        # XLA's CPU backend reports a peak that leaves the temporaries out (measured: 11
        # MiB for a chunk whose temporaries alone take 213 MiB); there, count every buffer
        # as live at once: the plan may waste memory, never overcommit it.
        peak = max(peak, analysis.argument_size_in_bytes + analysis.output_size_in_bytes
                   + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)
    return int(peak)


def plan_chunk_size(algorithm: FederatedAlgorithm, example_spec: Mapping[str, tuple], *,
                    padded_examples: int, batch_size: int, device_bytes: int,
                    headroom: float = 0.9, max_clients: int | None = None,
                    cohort_clients: int | None = None,
                    server_optimizer: optax.GradientTransformation | None = None) -> MemoryPlan:
    """The largest vmapped chunk of clients whose compiled peak fits ``headroom * device_bytes``.

    With ``cohort_clients`` the peak is the whole round's over a cohort of that many
    (``compiled_peak_bytes``), so ``fixed_bytes`` holds what grows with the cohort; plan
    a run's chunks this way. Without it, only a chunk's own buffers count: the chunk
    fits, the round around it may not.

    Args:
      algorithm: the method (its client update is what a chunk runs).
      example_spec: ``{"x": (shape, dtype), "y": (shape, dtype)}`` of one example.
      padded_examples: examples per client after padding (a multiple of ``batch_size``).
      device_bytes: the device's memory.
      headroom: the fraction of it to plan for (allocator fragmentation, the server
        state and the next cohort in flight need the rest).
      max_clients: no need to plan beyond this (the cohort size).
    """
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom must be in (0, 1], got {headroom}")
    if device_bytes < 1:
        raise ValueError(f"device_bytes must be positive, got {device_bytes}")
    if cohort_clients is not None:
        if cohort_clients < 1:
            raise ValueError(f"cohort_clients must be >= 1, got {cohort_clients}")
        max_clients = min(cohort_clients, max_clients or cohort_clients)

    def peak(k: int) -> int:
        return compiled_peak_bytes(algorithm, example_spec, padded_examples, batch_size, k,
                                   cohort_clients, server_optimizer)

    # Two probes fit the line; a cohort of fewer clients than the larger probe has its
    # chunks probed at 1 and the whole cohort (a cohort of one: per client, all of it).
    probes = _PROBES if cohort_clients is None or cohort_clients >= _PROBES[1] else (
        (1, cohort_clients) if cohort_clients > 1 else (1,))
    peaks = [peak(k) for k in probes]
    if len(probes) == 1:
        per_client, fixed = max(1, peaks[0]), 0
    else:
        per_client = max(1, (peaks[1] - peaks[0]) // (probes[1] - probes[0]))
        fixed = max(0, peaks[0] - probes[0] * per_client)
    budget = int(headroom * device_bytes)
    chunk = max(0, (budget - fixed) // per_client)
    if max_clients is not None:
        chunk = min(chunk, max_clients)
    checked = None
    while chunk > 0:
        checked = peak(chunk)
        if checked <= budget:
            break
        # The linear model was optimistic: shrink by the measured overshoot and recheck.
        chunk = int(np.floor(chunk * budget / checked))
        checked = None
    if chunk == 0:
        # The peak is not linear in the chunk: one that leaves a remainder runs it apart
        # and copies the outputs together (core.mapping.map_chunks), so the probes may
        # overstate a line on which the whole cohort, or one client at a time, still fits.
        for k in dict.fromkeys(k for k in (max_clients, 1) if k):
            measured = peak(k)  # one compile per candidate
            if measured <= budget:
                chunk, checked = k, measured
                break
    return MemoryPlan(fixed_bytes=int(fixed), per_client_bytes=int(per_client),
                      budget_bytes=budget, clients_per_chunk=int(chunk),
                      checked_peak_bytes=checked)


# The cost model of ``chunk_for_sizes``: one vmapped local step of k clients costs as
# much as (OVERHEAD_CLIENTS + k) clients' share of it. Fitted to the Stack Overflow LSTM
# rows of docs/benchmarks/gpu-h200.md (chunks of 8: 1,412 step slots in 0.508 s, 176
# chunk-steps; full vmap of 64: 4,032 slots in 0.759 s, 63 chunk-steps): a fixed
# 1.6 ms per chunk-step and 0.16 ms per client-step slot, a ratio of about 10.
# ``launch/chunk_costs.py`` fits the same two costs to any benchmark's chunk rows: the H100
# rows of docs/benchmarks/gpu-h100-2026-11-26.md give a ratio of 4.4 (FedAvg) and 4.8
# (Flow), which would pick chunks of 11 instead of 19 there for a modeled gain under 5%,
# within the spread between device calls; the constant stays until a device call times both.
OVERHEAD_CLIENTS = 10.0


def chunk_cost(steps: np.ndarray, chunk: int, overhead_clients: float = OVERHEAD_CLIENTS,
               steps_per_loop: int = 1) -> float:
    """Modeled time (in client-step units) of ``chunk_step_counts`` (with the step loop's
    ``steps_per_loop``): each chunk-step costs ``overhead_clients`` slots beyond its own."""
    chunk_steps, slots = chunk_step_counts(steps, chunk, steps_per_loop)
    return float(overhead_clients * chunk_steps + slots)


def chunk_for_sizes(steps: np.ndarray, max_chunk: int,
                    overhead_clients: float = OVERHEAD_CLIENTS, steps_per_loop: int = 1,
                    fits: Callable[[int], bool] | None = None) -> int:
    """The chunk size in ``[1, max_chunk]`` of least ``chunk_cost`` (the smallest on ties)
    among those that ``fits`` (default: all).

    Larger chunks fill the device (the fixed cost of a step is shared by more clients)
    but pad more on skewed sizes (each chunk lasts as long as its longest client);
    ``max_chunk`` is what fits in memory (``plan_chunk_size``). With ``steps_per_loop``
    (``SGDConfig.steps_per_loop``) a chunk runs its steps in groups, and up to that many
    minus one more steps than its longest client (``chunk_step_counts``). A chunk below
    ``max_chunk`` may still need more memory than it (a remainder chunk's copies), so a
    planned run passes ``fits``, its peak against the budget, tried in order of cost.

    Example:
      >>> chunk_for_sizes(np.full(64, 10), 64)  # equal sizes: one chunk, no padding
      64
      >>> chunk_for_sizes(np.array([100] + [1] * 63), 64)  # one long client, small chunks
      3
    """
    if max_chunk < 1:
        raise ValueError(f"max_chunk must be >= 1, got {max_chunk}")
    steps = np.asarray(steps)
    largest = min(max_chunk, len(steps))
    candidates = sorted(range(1, largest + 1),
                        key=lambda k: (chunk_cost(steps, k, overhead_clients, steps_per_loop), k))
    for chunk in candidates:
        if fits is None or fits(chunk):
            return chunk
    raise ValueError(f"no chunk size in [1, {largest}] fits the memory budget")
