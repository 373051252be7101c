"""Epochs of minibatch steps over a subset of one client's examples, with fixed shapes.

Each epoch draws a fresh order of the subset's members from the epoch's key; members
come first and the rest of the batches are padding. The steps run in a ``while_loop``
whose trip count is the client's own number of non-empty batches, so padded steps are
never executed: the shapes stay fixed (no recompilation for any client size), while the
work follows each client's size. Under ``vmap`` a batched ``while_loop`` runs until its
longest client is done, so the engine groups clients of similar length into chunks
(``core.mapping``). The uniform draws are made per example index, so extra padding
examples appended to a client leave the order of its real examples, and thus every
result, bit-identical.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

Carry = Any
Batch = tuple[jax.Array, jax.Array, jax.Array]  # x [B, ...], y [B, ...], weights [B]
StepFn = Callable[[Carry, Batch, jax.Array], tuple[Carry, jax.Array]]


def packed_batches(sort_key: jax.Array, member: jax.Array, batch_size: int,
                   max_members: int) -> tuple[jax.Array, jax.Array]:
    """The members of ``member`` in increasing ``sort_key`` order (ties: index order),
    packed into batches: ``(indices [S, B], mask [S, B])``, non-empty batches first.

    ``S = ceil(max_members / B)`` where ``max_members`` (static) bounds ``member.sum()``.
    """
    num_steps = max(1, math.ceil(max_members / batch_size))
    slots = num_steps * batch_size
    order = jnp.argsort(jnp.where(member, sort_key, jnp.inf), stable=True)
    count = jnp.sum(member)
    if slots > order.shape[0]:
        order = jnp.pad(order, (0, slots - order.shape[0]))
    indices = order[:slots].reshape(num_steps, batch_size)
    mask = (jnp.arange(slots) < count).reshape(num_steps, batch_size)
    return indices, mask


def epoch_batches(key: jax.Array, member: jax.Array, batch_size: int,
                  max_members: int) -> tuple[jax.Array, jax.Array]:
    """A shuffled epoch of the members of ``member`` as ``(indices [S, B], mask [S, B])``
    (``packed_batches`` in the order of one uniform draw per example)."""
    # One draw per example index (not one draw of shape [N]) so the order of the real
    # examples does not depend on how much padding follows them. Example i's draw uses
    # fold_in(key, i), the key ``run_epochs`` gives step i: its bits are made of the key
    # data of fold_in(step key, 0) (threefry: the XOR of its two words, under JAX's
    # default jax_threefry_partitionable; the first word without it), a key the steps use
    # only as a key (dropout of layer 0, Flow's policy key), never for bits, so nothing is
    # drawn twice. Separate tags would be cleaner but would change every result.
    # float32 spelled out: the default under JAX_ENABLE_X64 (a float64 parity run)
    # would draw other numbers, so another order.
    draws = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key, i),
                                                  dtype=jnp.float32))(
        jnp.arange(member.shape[0]))
    return packed_batches(draws, member, batch_size, max_members)


def run_epochs(step_fn: StepFn, carry: Carry, x: jax.Array, y: jax.Array, member: jax.Array, *,
               num_epochs: int, batch_size: int, key: jax.Array,
               max_members: int | None = None,
               batches_fn: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]] | None = None,
               steps_per_loop: int = 1, first_epoch: int = 0) -> tuple[Carry, jax.Array]:
    """Runs ``num_epochs`` shuffled epochs of ``step_fn`` over the member examples.

    ``run_epochs_each``'s run; returns its final carry and the ``[loss_sum, weight_sum]``
    summed over all epochs.
    """
    carry, stats = run_epochs_each(step_fn, carry, x, y, member, num_epochs=num_epochs,
                                   batch_size=batch_size, key=key, max_members=max_members,
                                   batches_fn=batches_fn, steps_per_loop=steps_per_loop,
                                   first_epoch=first_epoch)
    return carry, jnp.sum(stats, axis=0)


def run_epochs_each(step_fn: StepFn, carry: Carry, x: jax.Array, y: jax.Array,
                    member: jax.Array, *, num_epochs: int, batch_size: int, key: jax.Array,
                    max_members: int | None = None,
                    batches_fn: Callable[[jax.Array, jax.Array],
                                         tuple[jax.Array, jax.Array]] | None = None,
                    steps_per_loop: int = 1, first_epoch: int = 0) -> tuple[Carry, jax.Array]:
    """Runs ``num_epochs`` shuffled epochs of ``step_fn`` over the member examples, keeping
    each epoch's statistics apart.

    Args:
      step_fn: ``step_fn(carry, (x, y, weights), key) -> (carry, loss_sum_and_count)``
        where the second output is a float array ``[2]`` (summed loss, summed weight).
      carry: what the steps update (params, optimizer states).
      x, y: the client's examples, ``[N, ...]``.
      member: bool ``[N]``; which examples this phase trains on.
      max_members: static upper bound of ``member.sum()`` (default ``N``).
      batches_fn: optional ``batches_fn(epoch_key, epoch_index) -> (indices [S, B], mask
        [S, B])`` replacing ``epoch_batches`` (non-empty batches first), for a caller that
        builds its own epochs (e.g. Flow's reference halves); ``member`` is then unused.
      steps_per_loop: steps per iteration of the step loop: while that many remain, an
        inner loop of exactly that many steps runs (a trip count XLA knows), then a loop
        of single steps runs the rest. Fewer iterations of a data-dependent loop mean
        fewer loop conditions for a GPU's host to read and wait for (under ``vmap`` a
        group of clients runs each loop as long as its longest member, at most
        ``steps_per_loop - 1`` more steps than one loop). The same steps and keys; values
        equal to float32 rounding (XLA may fuse the nested body differently).
      first_epoch: the index of the first epoch (each epoch's key is ``fold_in(key,
        index)``): a run split into two calls, the second from ``first_epoch`` = the
        first's ``num_epochs`` with its carry, runs the one call's epochs.

    Returns:
      The final carry and ``[num_epochs, 2]``: each epoch's ``[loss_sum, weight_sum]``
      summed over its executed steps.
    """
    max_members = x.shape[0] if max_members is None else max_members
    if steps_per_loop < 1:
        raise ValueError(f"steps_per_loop={steps_per_loop}: expected an integer >= 1")

    def epoch(carry, epoch_index):
        epoch_key = jax.random.fold_in(key, epoch_index)
        if batches_fn is None:
            indices, mask = epoch_batches(epoch_key, member, batch_size, max_members)
        else:
            indices, mask = batches_fn(epoch_key, epoch_index)
        num_steps = jnp.sum(jnp.any(mask, axis=1))  # non-empty batches come first

        def step(state):
            step_index, carry, stats = state
            batch_mask = mask[step_index]
            batch = (x[indices[step_index]], y[indices[step_index]],
                     batch_mask.astype(jnp.float32))
            step_key = jax.random.fold_in(epoch_key, step_index)
            carry, step_stats = step_fn(carry, batch, step_key)
            return step_index + 1, carry, stats + step_stats.astype(stats.dtype)

        def steps(state):
            # An inner loop with a fixed trip count, not steps_per_loop copies of the
            # step: it compiles as one step does, and a GPU runs a loop of known trip
            # count without reading its condition back to the host (XLA's WhileThunk).
            return jax.lax.fori_loop(0, steps_per_loop, lambda _, s: step(s), state)

        state = (jnp.zeros((), jnp.int32), carry, jnp.zeros((2,), jnp.float32))
        if steps_per_loop > 1:  # unguarded: no per-step select over the whole carry
            state = jax.lax.while_loop(lambda s: s[0] + steps_per_loop <= num_steps, steps,
                                       state)
        _, carry, stats = jax.lax.while_loop(lambda s: s[0] < num_steps, step, state)
        return carry, stats

    # arange(start, stop): with first_epoch = 0 the very program of arange(num_epochs).
    epochs = jnp.arange(first_epoch, first_epoch + num_epochs)
    return jax.lax.scan(epoch, carry, epochs)
