"""The routing policy with early exits (paper Eq. 2).

A chain of dense "base" layers over the instance; after base layer ``j`` an exit head
(dropout, relu, dense 2) gives the two-way distribution ``q^(j) = [q0, q1]`` for routed
layer ``j`` (``q0`` = global, ``q1`` = local). There is one base layer per routed layer.

What the policy sees:
* images (``policy_input="flat"``): the flattened example, one decision per example;
* tokens (``policy_input="tokens"``): one decision per position ``t`` from the policy's own
  embedding of token ``t`` concatenated with the mean embedding of tokens ``0..t``. The
  features are causal: a position's route never depends on later tokens, which are the
  labels of earlier positions in next-token prediction. (The authors' code feeds the
  LSTMs' hidden states instead; ours keeps the policy independent of the model so the
  routed forward pass stays one pass per branch.)

``last="dense"`` is the authors' EMNIST/CIFAR policy (``EMNISTPolicyNet``): the last routed
layer has no exit head; its route logits are the last base layer's own output (width 2),
e.g. 784 -> 350 -> 150 -> 50 -> 2 with exits after the first three.

The policy is drawn in its model's ``init_style``: Flax's dense init, or with
``model_init="torch"`` PyTorch's ``nn.Linear`` init, as the authors' policy networks.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from flowjax.models.base import RoutableModel
from flowjax.models.torch_init import drawn_in_style

LAST_KINDS = ("exit", "dense")


class RoutingPolicy(nn.Module):
    """Early-exit routing policy.

    Attributes:
      hidden: width of each base layer; its length is the number of routed layers.
      input_kind: ``"flat"`` or ``"tokens"``.
      vocab_size: token vocabulary (``tokens`` only).
      embed_dim: the policy's own token embedding width (``tokens`` only).
      dropout_rate: exit-head dropout (paper's code: 0.3), active in training only.
      last: ``"exit"`` (every routed layer has an exit head) or ``"dense"`` (the last base
        layer, of width 2, gives the last routed layer's logits directly).
    """

    hidden: Sequence[int]
    input_kind: str = "flat"
    vocab_size: int = 0
    embed_dim: int = 8
    dropout_rate: float = 0.3
    last: str = "exit"

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Route logits ``[*instance, L, 2]``."""
        if self.input_kind == "tokens":
            tokens = nn.Embed(self.vocab_size, self.embed_dim, name="embed")(x)
            positions = jnp.arange(1, x.shape[-1] + 1, dtype=tokens.dtype)[:, None]
            prefix_mean = jnp.cumsum(tokens, axis=-2) / positions
            h = jnp.concatenate([tokens, prefix_mean], axis=-1)
        elif self.input_kind == "flat":
            h = x.reshape((x.shape[0], -1)).astype(jnp.float32)
        else:
            raise ValueError(f"unknown policy input {self.input_kind!r}; expected 'flat' or 'tokens'")
        if self.last not in LAST_KINDS:
            raise ValueError(f"unknown policy last {self.last!r}; expected one of {LAST_KINDS}")
        exits = []
        for j, width in enumerate(self.hidden):
            h = nn.Dense(width, name=f"base{j}")(h)
            if self.last == "dense" and j == len(self.hidden) - 1:
                exits.append(h)
                break
            exit_in = nn.Dropout(self.dropout_rate, deterministic=not train)(h)
            exits.append(nn.Dense(2, name=f"exit{j}")(nn.relu(exit_in)))
            h = nn.relu(h)
        return jnp.stack(exits, axis=-2)


@dataclasses.dataclass(frozen=True)
class Policy:
    """A routing policy bound to a model: init and apply as pure functions."""

    module: RoutingPolicy
    example_x: jax.Array  # one example batch's shape, for init
    init_style: str = "flax"  # the model's (``RoutableModel.init_style``)

    def init(self, key: jax.Array):
        params = self.module.init(key, self.example_x, train=False)["params"]
        return drawn_in_style(self.init_style, params, key)

    def log_probs(self, params, x: jax.Array, *, train: bool = False,
                  key: jax.Array | None = None) -> jax.Array:
        """``log q`` of shape ``[*instance, L, 2]`` (index 0 = global)."""
        rngs = {"dropout": key} if train else {}
        logits = self.module.apply({"params": params}, x, train=train, rngs=rngs)
        return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def build_policy(model: RoutableModel, example_x: jax.Array, hidden: Sequence[int], *,
                 dropout_rate: float = 0.3, embed_dim: int = 8, last: str = "exit") -> Policy:
    """The policy for ``model``; ``hidden`` needs one width per routed layer."""
    if len(hidden) != model.num_layers:
        raise ValueError(f"policy hidden widths {tuple(hidden)} must have one entry per routed "
                         f"layer of {model.name} ({model.num_layers}: {model.layer_names})")
    if last == "dense" and hidden[-1] != 2:
        raise ValueError(f"policy last='dense' needs a last width of 2 (the route logits), "
                         f"got hidden={tuple(hidden)}")
    module = RoutingPolicy(hidden=tuple(hidden), input_kind=model.policy_input,
                           vocab_size=model.vocab_size, embed_dim=embed_dim,
                           dropout_rate=dropout_rate, last=last)
    return Policy(module, example_x, model.init_style)
