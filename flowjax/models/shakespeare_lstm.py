"""The Shakespeare next-character LSTM: embedding, two LSTMs, dense; routed per time step."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flowjax.models.base import RoutableModel
from flowjax.models.layers import LSTM, Embed, chain_model, compute_dtype_of
from flowjax.models.layers import dense as dense_layer

SEQUENCE_LENGTH = 80
PAD_ID = 0


def _embed_input(x: jax.Array) -> jax.Array:
    return x


def _glue_apply(j: int, h: jax.Array, train: bool, key: jax.Array) -> jax.Array:
    del j, train, key
    return h


def _label_weights(y: jax.Array) -> jax.Array:
    return (y != PAD_ID).astype(jnp.float32)


def shakespeare_lstm(vocab_size: int = 90, embed_dim: int = 8, hidden: int = 256,
                     custom_grad: bool = True, compute_dtype: str = "float32",
                     lstm_unroll: int = 1) -> RoutableModel:
    """embedding(vocab_size, embed_dim), LSTM(hidden), LSTM(hidden), dense vocab_size.

    Args:
      vocab_size: token ids, ``PAD_ID`` (0) included; also the number of classes.
      embed_dim: embedding width.
      hidden: LSTM width.
      custom_grad: LSTMs with the hand-written VJP (fast on CPU) or plain autodiff.
      compute_dtype: ``"float32"`` (the default; exactly the float32 model) or
        ``"bfloat16"``: the LSTM's products (its recurrent weight cast once per sequence)
        and the dense layers multiply in bf16 with float32 accumulation; params,
        gradients, optimizer state and the LSTM cell stay float32.
      lstm_unroll: the LSTMs' time steps per loop iteration (``layers.lstm``; 80 = no
        loop): values equal to float32 rounding. All 80 compiled 35x longer and ran 6.8x
        slower on a 2-core CPU (docs/benchmarks/cpu-2core.md).

    Returns:
      A model taking int32 tokens ``[B, T]`` (``T = 80`` in the dataset) to logits
      ``[B, T, vocab_size]``; each token position is an instance, so routing is per time
      step and causal. Padding labels get weight 0.
    """
    dtype = compute_dtype_of(compute_dtype)
    lstm = lambda: LSTM(hidden, custom_grad=custom_grad, compute_dtype=dtype,  # noqa: E731
                        unroll=lstm_unroll)
    modules = (Embed(vocab_size, embed_dim), lstm(), lstm(), dense_layer(vocab_size, dtype))
    return chain_model(
        name="shakespeare_lstm", layer_names=("embedding", "lstm1", "lstm2", "dense"),
        modules=modules, embed_input=_embed_input, glue_apply=_glue_apply,
        example_input=jax.ShapeDtypeStruct((1, SEQUENCE_LENGTH), jnp.int32),
        label_weights=_label_weights, instance_ndim=2, num_classes=vocab_size,
        policy_input="tokens", vocab_size=vocab_size, head_layers=("dense",))
