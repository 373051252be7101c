"""The Stackoverflow next-word LSTM of Reddi et al. (2021), routed per time step.

Token ids (``vocab_size = V``, ``V = 10004`` for the 10,000-word vocabulary):

* ``0``: padding;
* ``1 .. V - 4``: the vocabulary words, most frequent first;
* ``V - 3``: out-of-vocabulary (``10001``);
* ``V - 2``: beginning of sentence (``10002``);
* ``V - 1``: end of sentence (``10003``).

Training fits every label but padding. The accuracy counts the same labels by default;
Reddi et al. (and TFF) also report one that ignores the special tokens:
``exclude_special=True`` leaves oov/bos/eos out of the accuracies (the model's
``metric_weights``; bos never occurs as a label anyway) and trains exactly as without it.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from flowjax.models.base import RoutableModel
from flowjax.models.layers import LSTM, Embed, chain_model, compute_dtype_of
from flowjax.models.layers import dense as dense_layer

SEQUENCE_LENGTH = 20
PAD_ID = 0
# Special ids sit after the words: oov, bos, eos are the last three ids.
NUM_SPECIAL_AFTER_WORDS = 3


def _embed_input(x: jax.Array) -> jax.Array:
    return x


def _glue_apply(j: int, h: jax.Array, train: bool, key: jax.Array) -> jax.Array:
    del j, train, key
    return h


def _label_weights_fn(vocab_size: int, exclude_special: bool) -> Callable[[jax.Array], jax.Array]:
    """Weight 0 on padding, and on oov/bos/eos too when ``exclude_special``."""
    last_counted = vocab_size - 1 - (NUM_SPECIAL_AFTER_WORDS if exclude_special else 0)

    def label_weights(y: jax.Array) -> jax.Array:
        return ((y != PAD_ID) & (y <= last_counted)).astype(jnp.float32)

    return label_weights


def stackoverflow_lstm(vocab_size: int = 10004, embed_dim: int = 96, hidden: int = 670,
                       dense: int = 96, exclude_special: bool = False,
                       custom_grad: bool = True, compute_dtype: str = "float32",
                       lstm_unroll: int = 1) -> RoutableModel:
    """embedding(vocab_size, embed_dim), LSTM(hidden), dense ``dense``, dense vocab_size
    (4,050,748 params with the defaults).

    Args:
      vocab_size: token ids, laid out as in the module docstring; also the number of
        classes.
      embed_dim: embedding width.
      hidden: LSTM width.
      dense: width of the projection between the LSTM and the output layer (linear, as
        in Reddi et al.'s Keras model).
      exclude_special: the accuracies leave out oov/bos/eos labels as well as padding
        (training does not: its losses count every label but padding).
      custom_grad: the LSTM with the hand-written VJP (fast on CPU) or plain autodiff.
      compute_dtype: ``"float32"`` (the default; exactly the float32 model) or
        ``"bfloat16"``: the LSTM's products (its recurrent weight cast once per sequence)
        and the dense layers multiply in bf16 with float32 accumulation; params,
        gradients, optimizer state and the LSTM cell stay float32.
      lstm_unroll: the LSTM's time steps per loop iteration (``layers.lstm``; 20 = no
        loop): values equal to float32 rounding.

    Returns:
      A model taking int32 tokens ``[B, T]`` (``T = 20`` in the dataset) to logits
      ``[B, T, vocab_size]``, routed at ``embedding, lstm, dense1, dense2``; each token
      position is an instance, so routing is per time step and causal.
    """
    if vocab_size <= NUM_SPECIAL_AFTER_WORDS + 1:
        raise ValueError(f"vocab_size={vocab_size} leaves no room for words")
    dtype = compute_dtype_of(compute_dtype)
    modules = (Embed(vocab_size, embed_dim),
               LSTM(hidden, custom_grad=custom_grad, compute_dtype=dtype, unroll=lstm_unroll),
               dense_layer(dense, dtype), dense_layer(vocab_size, dtype))
    return chain_model(
        name="stackoverflow_lstm", layer_names=("embedding", "lstm", "dense1", "dense2"),
        modules=modules, embed_input=_embed_input, glue_apply=_glue_apply,
        example_input=jax.ShapeDtypeStruct((1, SEQUENCE_LENGTH), jnp.int32),
        label_weights=_label_weights_fn(vocab_size, exclude_special=False),
        metric_weights=_label_weights_fn(vocab_size, exclude_special=True) if exclude_special
        else None, instance_ndim=2,
        num_classes=vocab_size, policy_input="tokens", vocab_size=vocab_size,
        head_layers=("dense2",))
