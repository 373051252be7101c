"""How a per-client function is mapped over the clients axis: a strategy, not a constant.

* ``loop``: ``lax.map`` over clients inside one jit (fastest on XLA's CPU backend, where
  vmapped per-client convolution weights become grouped convolutions);
* ``vmap``: all clients at once (the accelerator design);
* ``chunked``: ``lax.map`` over chunks of ``chunk_size`` clients, ``vmap`` inside a chunk.

With several devices the clients axis is additionally sharded over a 1-D mesh with axis
``clients`` (``shard_map``); each device maps its own clients with the chosen strategy.
The per-client function is written as if alone and must be pure.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

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
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if not 1 <= self.num_devices <= jax.device_count():
            raise ValueError(f"num_devices must be in [1, {jax.device_count()}] (devices "
                             f"visible), got {self.num_devices}")

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


def default_mapping(backend: str | None = None) -> ClientMapping:
    """The measured default per backend: loop on CPU, full vmap on accelerators."""
    backend = backend or jax.default_backend()
    return ClientMapping(strategy="loop" if backend == "cpu" else "vmap")


def map_clients(fn: Callable[..., Any], mapping: ClientMapping) -> Callable[..., Any]:
    """Lifts ``fn(*per_client_args)`` to stacked args with a leading clients axis.

    Example:
      >>> square = map_clients(lambda a: a * a, ClientMapping("vmap"))
      >>> square(jnp.arange(3.0))
      Array([0., 1., 4.], dtype=float32)
    """

    def local_map(*stacked):
        if mapping.strategy == "vmap":
            return jax.vmap(fn)(*stacked)
        batch_size = mapping.chunk_size if mapping.strategy == "chunked" else None
        return jax.lax.map(lambda args: fn(*args), stacked, batch_size=batch_size)

    if mapping.num_devices == 1:
        return local_map
    spec = PartitionSpec(CLIENTS_AXIS)
    # check_vma=False: the per-client function is written for one client and knows nothing
    # of the mesh (zero-initialized scan carries would otherwise need pcast to "varying").
    return jax.shard_map(local_map, mesh=mapping.mesh(), in_specs=spec, out_specs=spec,
                         check_vma=False)
