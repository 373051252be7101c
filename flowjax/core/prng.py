"""PRNG keys derived only from (seed, purpose, round, client id).

No key is ever carried as hidden state: any key of a run can be recomputed from the
seed and its coordinates, which is what makes runs reproducible and resumable.
"""

from __future__ import annotations

import enum

import jax
import numpy as np

# Seeds are 64-bit: ``jax.random.key`` keeps only the low 32 bits of a Python int when
# x64 is off (seed 2**32 would be seed 0), so larger seeds fill the key's high word.
SEED_LIMIT = 2 ** 64
_LOW_WORD = 2 ** 32


class Purpose(enum.IntEnum):
    """Independent random streams of a run."""

    INIT = 0
    TRAIN = 1
    EVAL = 2
    SAMPLE = 3
    KMEANS_INIT = 4  # HypCluster's k-means init (its clients' training, the first pick)


def host_rng(seed: int, *words: int) -> np.random.Generator:
    """NumPy's generator of the host-side stream ``(seed, *words)`` (client sampling, the
    evaluated clients), as ``np.random.default_rng([seed, *words])`` for seeds below
    ``2**32``, so their streams stand.

    NumPy splits a larger int into 32-bit words and drops trailing zero words, so
    ``[3 * 2**32 + 7, 3, 0]`` would be ``[7, 3, 3]``: seed ``3 * 2**32 + 7``'s round 0
    would sample seed 7's round 3. A larger seed's words are therefore followed by its
    own words and a nonzero last word, a sequence no smaller seed's stream has.
    """
    seed_key(seed)  # the same range check
    if seed < _LOW_WORD:
        return np.random.default_rng([seed, *words])
    return np.random.default_rng([seed & (_LOW_WORD - 1), seed >> 32, *words, _LOW_WORD - 1])


def seed_key(seed: int) -> jax.Array:
    """The run's root key: distinct for every seed in ``[0, 2**64)``.

    A seed below ``2**32`` gives ``jax.random.key(seed)`` (threefry's key data
    ``[0, seed]``), so every number of such runs is unchanged; a larger seed's key data
    is ``[seed >> 32, seed & 0xFFFFFFFF]``, which no smaller seed has.

    Raises:
      ValueError: ``seed`` is not an integer in ``[0, 2**64)``.
    """
    seed = int(seed)
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed={seed}: expected an integer in [0, 2**64)")
    if seed < _LOW_WORD:
        return jax.random.key(seed)
    words = np.array([seed >> 32, seed & (_LOW_WORD - 1)], np.uint32)
    return jax.random.wrap_key_data(words, impl="threefry2x32")


def base_key(seed: int, purpose: Purpose) -> jax.Array:
    """The root key of one stream."""
    return jax.random.fold_in(seed_key(seed), int(purpose))


def seed_words(seed: int) -> np.ndarray:
    """The root key's data (``uint32[2]`` for threefry) as a host array.

    Compiled programs take these words as an argument instead of closing over the seed:
    then one executable serves every seed (the compilation cache's key is the program),
    and ``stream_key(seed_words(s), p)`` is the same key as ``base_key(s, p)``.
    """
    return np.asarray(jax.random.key_data(seed_key(seed)))


def stream_key(words: jax.Array, purpose: Purpose) -> jax.Array:
    """``base_key`` from ``seed_words``; ``words`` may be traced."""
    return jax.random.fold_in(jax.random.wrap_key_data(words), int(purpose))


def round_key(stream: jax.Array, round_index: jax.Array | int) -> jax.Array:
    """The key of one round of a stream; ``round_index`` may be traced."""
    return jax.random.fold_in(stream, round_index)


def client_key(key_of_round: jax.Array, client_id: jax.Array | int) -> jax.Array:
    """The key of one client within a round, from the client's global id."""
    return jax.random.fold_in(key_of_round, client_id)
