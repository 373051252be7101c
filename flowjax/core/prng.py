"""PRNG keys derived only from (seed, purpose, round, client id).

No key is ever carried as hidden state: any key of a run can be recomputed from the
seed and its coordinates, which is what makes runs reproducible and resumable.
"""

from __future__ import annotations

import enum

import jax


class Purpose(enum.IntEnum):
    """Independent random streams of a run."""

    INIT = 0
    TRAIN = 1
    EVAL = 2
    SAMPLE = 3


def base_key(seed: int, purpose: Purpose) -> jax.Array:
    """The root key of one stream."""
    return jax.random.fold_in(jax.random.key(seed), int(purpose))


def round_key(stream: jax.Array, round_index: jax.Array | int) -> jax.Array:
    """The key of one round of a stream; ``round_index`` may be traced."""
    return jax.random.fold_in(stream, round_index)


def client_key(key_of_round: jax.Array, client_id: jax.Array | int) -> jax.Array:
    """The key of one client within a round, from the client's global id."""
    return jax.random.fold_in(key_of_round, client_id)
