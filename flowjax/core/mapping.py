"""How a per-client function is mapped over the clients axis: a strategy, not a constant.

* ``loop``: ``lax.map`` over clients inside one jit (fastest on XLA's CPU backend, where
  vmapped per-client convolution weights become grouped convolutions);
* ``vmap``: all clients at once (the accelerator design);
* ``chunked``: ``lax.map`` over chunks of ``chunk_size`` clients, ``vmap`` inside a chunk.
  Given a per-client cost (the engine passes the example count), the clients are run in
  order of decreasing cost and the outputs put back in cohort order: a vmapped chunk
  lasts as long as its longest client (``core.local_training``), so chunks of similar
  clients waste little on skewed sizes, with no new shapes (and no recompilation).

With several devices the clients axis is additionally sharded over a 1-D mesh with axis
``clients`` (``shard_map``); each device maps its own clients with the chosen strategy.
The per-client function is written as if alone and must be pure.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flowjax.core.checks import is_int

STRATEGIES = ("loop", "vmap", "chunked")
CLIENTS_AXIS = "clients"


@dataclasses.dataclass(frozen=True)
class ClientMapping:
    """A client-parallel execution strategy.

    Attributes:
      strategy: one of ``STRATEGIES``.
      chunk_size: clients per vmapped chunk for ``chunked``.
      num_devices: devices to shard the clients axis over (1 = no sharding).
    """

    strategy: str = "loop"
    chunk_size: int = 1
    num_devices: int = 1

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown client mapping strategy {self.strategy!r}; "
                             f"expected one of {STRATEGIES}")
        if not is_int(self.chunk_size) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be an integer >= 1, got {self.chunk_size!r}")
        problem = num_devices_problem(self.num_devices)
        if problem:
            raise ValueError(f"num_devices={self.num_devices!r}: {problem}")

    def mesh(self) -> Mesh:
        return Mesh(np.array(jax.devices()[: self.num_devices]), (CLIENTS_AXIS,))

    def client_sharding(self) -> NamedSharding | None:
        """Where stacked per-client inputs should live (None for one device)."""
        if self.num_devices == 1:
            return None
        return NamedSharding(self.mesh(), PartitionSpec(CLIENTS_AXIS))

    def padded_clients(self, num_clients: int) -> int:
        """Clients per cohort rounded up so every device gets the same number."""
        return -(-num_clients // self.num_devices) * self.num_devices


def fewest_devices_spanning_processes() -> int:
    """The fewest leading devices (``jax.devices()[:n]``, as ``ClientMapping.mesh`` takes
    them) that hold a device of every process."""
    seen, processes = set(), jax.process_count()
    for index, device in enumerate(jax.devices(), start=1):
        seen.add(device.process_index)
        if len(seen) == processes:
            return index
    return jax.device_count()


def num_devices_problem(num_devices: Any) -> str | None:
    """Why ``num_devices`` cannot shard the clients axis (what is expected), or None.

    The one rule for the Python API (``ClientMapping``) and the config path
    (``flowjax.validation``).
    """
    count = jax.device_count()
    if not (is_int(num_devices) and 1 <= num_devices <= count):
        return f"expected an integer in [1, {count}] (devices visible)"
    # A process holding none of the mesh's devices has no shard of the cohort: the run
    # failed after its first round (process 1 without a shard, orbax refusing host-local
    # arrays in the checkpoint).
    fewest = fewest_devices_spanning_processes()
    if num_devices < fewest:
        return (f"expected an integer in [{fewest}, {count}]: in a run of "
                f"{jax.process_count()} processes the clients axis must reach a device of "
                f"every process (it takes the first num_devices of the {count} devices)")
    return None


def default_mapping(backend: str | None = None) -> ClientMapping:
    """The measured default per backend: loop on CPU, full vmap on accelerators."""
    backend = backend or jax.default_backend()
    return ClientMapping(strategy="loop" if backend == "cpu" else "vmap")


def map_clients(fn: Callable[..., Any], mapping: ClientMapping,
                cost: Callable[..., jax.Array] | None = None) -> Callable[..., Any]:
    """Lifts ``fn(*per_client_args)`` to stacked args with a leading clients axis.

    Args:
      fn: the per-client function, written as if alone.
      mapping: how to map it.
      cost: ``cost(*stacked) -> [clients]``, the clients' relative run lengths; with the
        ``chunked`` strategy, chunks are formed from clients sorted by it. Outputs are in
        cohort order whatever the strategy.

    Example:
      >>> square = map_clients(lambda a: a * a, ClientMapping("vmap"))
      >>> square(jnp.arange(3.0))
      Array([0., 1., 4.], dtype=float32)
    """

    def local_map(*stacked):
        if mapping.strategy == "vmap":
            return jax.vmap(fn)(*stacked)
        if mapping.strategy == "loop":
            return jax.lax.map(lambda args: fn(*args), stacked)
        if cost is None:
            return map_chunks(fn, mapping.chunk_size)(*stacked)
        order = longest_first(cost(*stacked))
        ordered = jax.tree.map(lambda a: a[order], stacked)
        outputs = map_chunks(fn, mapping.chunk_size)(*ordered)
        return jax.tree.map(lambda a: a[jnp.argsort(order)], outputs)

    if mapping.num_devices == 1:
        return local_map
    spec = PartitionSpec(CLIENTS_AXIS)
    # check_vma=False: the per-client function is written for one client and knows nothing
    # of the mesh (zero-initialized scan carries would otherwise need pcast to "varying").
    return jax.shard_map(local_map, mesh=mapping.mesh(), in_specs=spec, out_specs=spec,
                         check_vma=False)


def map_chunks(fn: Callable[..., Any], chunk_size: int) -> Callable[..., Any]:
    """``fn`` over the clients axis in consecutive chunks of ``chunk_size``: ``lax.map``
    over the whole chunks with ``vmap`` inside, then the rest in one ``vmap``.

    What ``lax.map(..., batch_size=chunk_size)`` computes, written out because that one
    cannot reshape outputs with no elements (the empty ``q0`` of methods without routing:
    their evaluation under ``chunked`` crashed).
    """
    def run(*stacked):
        num_clients = jax.tree.leaves(stacked)[0].shape[0]
        whole = num_clients // chunk_size * chunk_size
        parts = []
        if whole:
            chunks = jax.tree.map(
                lambda a: a[:whole].reshape((whole // chunk_size, chunk_size) + a.shape[1:]),
                stacked)
            outputs = jax.lax.map(lambda chunk: jax.vmap(fn)(*chunk), chunks)
            parts.append(jax.tree.map(lambda a: a.reshape((whole,) + a.shape[2:]), outputs))
        if whole < num_clients:
            parts.append(jax.vmap(fn)(*jax.tree.map(lambda a: a[whole:], stacked)))
        if len(parts) == 1:
            return parts[0]
        return jax.tree.map(lambda *a: jnp.concatenate(a), *parts)

    return run


def longest_first(cost: jax.Array) -> jax.Array:
    """Indices sorting ``cost`` in decreasing order; ties keep cohort order (stable)."""
    return jnp.argsort(-cost, stable=True)


def executed_steps(steps: np.ndarray, mapping: ClientMapping, steps_per_loop: int = 1) -> int:
    """Client-step slots a mapping executes for clients of ``steps`` local steps each.

    A loop runs each client's own steps; a vmapped group of clients runs as long as its
    longest member (chunks of clients sorted longest first; the whole cohort for
    ``vmap``; ``chunk_step_counts``, with ``run_epochs``'s ``steps_per_loop``); with
    several devices each device maps its own contiguous share.

    Example:
      >>> executed_steps(np.array([8, 1, 1, 8]), ClientMapping("chunked", chunk_size=2))
      18
      >>> executed_steps(np.array([7, 1, 1, 5]), ClientMapping("chunked", chunk_size=2), 3)
      18
    """
    total = 0
    for shard in np.split(np.asarray(steps), mapping.num_devices):
        if mapping.strategy == "loop":
            total += int(np.sum(shard))
            continue
        size = len(shard) if mapping.strategy == "vmap" else mapping.chunk_size
        total += chunk_step_counts(shard, size, steps_per_loop)[1]
    return total


def chunk_step_counts(steps: np.ndarray, chunk: int,
                      steps_per_loop: int = 1) -> tuple[int, int]:
    """``(chunk-steps, client-step slots)`` of clients with ``steps`` local steps each,
    sorted longest first and run ``chunk`` at a time (the last chunk holds the rest): each
    chunk runs as long as its longest client, for ``size`` slots per step. With
    ``steps_per_loop`` (``run_epochs``'s), a chunk runs its loop of that many steps as
    long as its longest member's whole iterations, then single steps as long as its
    largest rest.

    Example:
      >>> chunk_step_counts(np.array([1, 9, 4]), 2)  # chunks (9, 4) and (1)
      (10, 19)
      >>> chunk_step_counts(np.array([1, 7, 5]), 2, 3)  # (7, 5): 3 + 3, then 2 more; (1)
      (9, 17)
    """
    ordered = np.sort(np.asarray(steps))[::-1]
    starts = np.arange(0, len(ordered), chunk)
    sizes = np.minimum(chunk, len(ordered) - starts)
    runs = np.array([steps_per_loop * np.max(group // steps_per_loop)
                     + np.max(group % steps_per_loop)
                     for group in np.split(ordered, starts[1:])], np.int64)
    return int(np.sum(runs)), int(np.sum(runs * sizes))
