"""The routed (dynamic personalized) forward pass, built from a model's own layers (Eq. 3).

``h_j = q0_j * G_j(h_{j-1}) + (1 - q0_j) * Loc_j(h_{j-1})`` for soft routing, and per
instance exactly one branch (``q0_j >= 1/2`` picks global) for hard routing. Hard routing
is computed with ``jnp.where`` over both branches: under jit on any backend both branches
run, which costs compute but keeps the pass one static, vmappable graph.

Recurrent layers (``recurrence``): an LSTM layer is a cell applied at every time step, so
Eq. 3 applied per step mixes the cells' new states ``(h, c)`` and feeds the mixed state
back into both cells at the next step (``"mixed_state"``: the routed model is then one
recurrent network whose every cell application is routed, as Eq. 3 routes every layer
application; the authors' code does this for its global branch, see their
``models/shakespeare_rnn_dynamic_v4.py``). ``"separate"`` (the default, for now) runs each branch's
recurrence on its own state over the whole sequence and mixes only the per-step outputs:
it gives exactly the global (local) model at ``q0 = 1`` (``0``) and keeps the LSTMs'
hand-written VJP; ``"mixed_state"`` matches them to float32 rounding (``routed_lstm``).
"""

from __future__ import annotations

import jax

from flowjax.models.base import Params, RoutableModel, layer_key, mix, select
from flowjax.models.layers import lstm_weights, routed_lstm

RECURRENCES = ("mixed_state", "separate")


def routed_forward(model: RoutableModel, global_params: Params, local_params: Params,
                   q0: jax.Array, x: jax.Array, *, hard: bool = False, train: bool = False,
                   key: jax.Array | None = None, recurrence: str = "separate") -> jax.Array:
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

    Returns:
      ``[*instance, num_classes]`` logits.
    """
    if recurrence not in RECURRENCES:
        raise ValueError(f"unknown recurrence {recurrence!r}; expected one of {RECURRENCES}")
    if key is None:
        key = jax.random.key(0)
    h = model.embed_input(x)
    for j, name in enumerate(model.layer_names):
        cell_global = lstm_weights(global_params[name])
        if recurrence == "mixed_state" and cell_global is not None:
            h = routed_lstm(h, cell_global, lstm_weights(local_params[name]), q0[..., j],
                            hard=hard)
        else:
            out_global = model.layer_apply(j, global_params[name], h)
            out_local = model.layer_apply(j, local_params[name], h)
            if hard:
                h = select(q0[..., j] >= 0.5, out_global, out_local)
            else:
                h = mix(q0[..., j], out_global, out_local)
        h = model.glue_apply(j, h, train, layer_key(key, j))
    return h
