"""The routed (dynamic personalized) forward pass, built from a model's own layers (Eq. 3).

``h_j = q0_j * G_j(h_{j-1}) + (1 - q0_j) * Loc_j(h_{j-1})`` for soft routing, and per
instance exactly one branch for hard routing: ``round(q)``, which at an exact tie
``q0_j = 1/2`` picks global (``hard_tie="global"``, rounding half up) or, as the authors'
``torch.round`` of both entries (round half to even) does, zeroes the layer's output
(``hard_tie="zeroed"``). Hard routing
is computed with ``jnp.where`` over both branches: under jit on any backend both branches
run, which costs compute but keeps the pass one static, vmappable graph.

Recurrent layers (``recurrence``): the paper's Eq. 3 mixes layer outputs and says nothing
of LSTMs, so it reads two ways. ``"separate"`` (the default) takes the whole LSTM layer,
the recurrence over the sequence, as layer ``j``: each branch runs its recurrence on its
own state and the per-step outputs are mixed. ``"mixed_state"`` takes each cell
application as the layer: at every step both cells step from the mixed state ``(h, c)``
and their new states are mixed and fed back (the routed model is then one recurrent
network whose every cell application is routed; the authors' code does this for its
global branch, see their ``models/shakespeare_rnn_dynamic_v4.py``). ``"separate"`` gives
exactly the global (local) model at ``q0 = 1`` (``0``) and runs each branch through the
LSTM's hand-written VJP; ``"mixed_state"`` matches them to float32 rounding (the model's
``routed_recurrence``: ``layers.routed_lstm``, with a hand-written VJP of its own, and the
LSTM layer's compute dtype, unroll and ``custom_grad``).

Both branches read the same input. ``fuse_branches`` runs them as one call of the layer,
vmapped over their stacked weights, wherever the layer's input is larger than its weights
(``shares_input``): an input-side product then runs once for both branches, reading the
input (for an im2col convolution, its patches) once and forming the input's gradient once,
at the cost of copying the (smaller) weights into the stack. The values are the same up to
float32 rounding (another shape of the same products), so it is off by default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flowjax.models.base import Params, RoutableModel, layer_key, mix, select

RECURRENCES = ("mixed_state", "separate")
HARD_TIES = ("global", "zeroed")


def input_outweighs_weights(num_weights: int, num_inputs: int) -> bool:
    """The fusing rule on sizes alone (``launch/roofline.py`` counts its bytes by it)."""
    return num_weights < num_inputs


def shares_input(layer_params: Params, h: jax.Array) -> bool:
    """Whether a layer's input ``h`` holds more values than its weights: then both
    branches in one product (``fuse_branches``) save more input traffic than the stacked
    weights cost."""
    return input_outweighs_weights(sum(leaf.size for leaf in jax.tree.leaves(layer_params)),
                                   h.size)


def branch_outputs(model: RoutableModel, j: int, global_layer: Params, local_layer: Params,
                   h: jax.Array, fuse: bool = False) -> tuple[jax.Array, jax.Array]:
    """Layer ``j``'s global and local outputs on the same input ``h``; with ``fuse`` (and
    ``shares_input``), one call of the layer over the two branches' stacked weights."""
    if fuse and shares_input(global_layer, h):
        stacked = jax.tree.map(lambda g, l: jnp.stack([g, l]), global_layer, local_layer)
        both = jax.vmap(lambda layer: model.layer_apply(j, layer, h))(stacked)
        return both[0], both[1]
    return model.layer_apply(j, global_layer, h), model.layer_apply(j, local_layer, h)


def routed_forward(model: RoutableModel, global_params: Params, local_params: Params,
                   q0: jax.Array, x: jax.Array, *, hard: bool = False, train: bool = False,
                   key: jax.Array | None = None, recurrence: str = "separate",
                   fuse_branches: bool = False, hard_tie: str = "global") -> jax.Array:
    """Logits of the routed model.

    Args:
      model: the routable model.
      global_params, local_params: two param trees of the model's structure.
      q0: probability of the global branch, ``[*instance, L]``.
      x: a batch of inputs.
      hard: route each instance through one branch per layer (``round(q)``).
      train: enables the model's dropout (same keys as the plain model).
      key: dropout key.
      recurrence: ``"mixed_state"`` or ``"separate"`` for LSTM layers (module docstring).
      fuse_branches: both branches of a layer in one call where that reads less
        (``branch_outputs``; module docstring).
      hard_tie: hard routing at ``q0_j = 1/2`` exactly: ``"global"`` or ``"zeroed"``
        (module docstring; ``"mixed_state"`` layers take ``"global"`` only).

    Returns:
      ``[*instance, num_classes]`` logits.
    """
    if recurrence not in RECURRENCES:
        raise ValueError(f"unknown recurrence {recurrence!r}; expected one of {RECURRENCES}")
    if hard_tie not in HARD_TIES:
        raise ValueError(f"unknown hard_tie {hard_tie!r}; expected one of {HARD_TIES}")
    if key is None:
        key = jax.random.key(0)
    h = model.embed_input(x)
    for j, name in enumerate(model.layer_names):
        if recurrence == "mixed_state" and name in model.recurrent_layers:
            if hard and hard_tie != "global":
                raise ValueError(f"hard_tie={hard_tie!r} with recurrence='mixed_state': "
                                 "expected 'global' (its cells mix their state per step)")
            h = model.routed_recurrence(j, global_params[name], local_params[name], h,
                                        q0[..., j], hard)
        else:
            out_global, out_local = branch_outputs(model, j, global_params[name],
                                                   local_params[name], h, fuse_branches)
            if hard:
                h = select(q0[..., j] >= 0.5, out_global, out_local)
                if hard_tie == "zeroed":  # torch.round(1/2) = 0 on both entries
                    h = select(q0[..., j] != 0.5, h, jnp.zeros_like(h))
            else:
                h = mix(q0[..., j], out_global, out_local)
        h = model.glue_apply(j, h, train, layer_key(key, j))
    return h
