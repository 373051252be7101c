"""Character preprocessing shared by every Shakespeare source.

Matches TensorFlow Federated's Shakespeare next-character task
(``tff.simulation.baselines.shakespeare``): snippets are split into *bytes*
(``tf.strings.bytes_split``), looked up in TFF's 86-character vocabulary with one
out-of-vocabulary bucket, shifted by one so that 0 is padding, wrapped in
beginning/end-of-snippet tokens, padded to a multiple of ``SEQUENCE_LENGTH + 1`` and
cut into shifted input/target pairs. Models trained here therefore see exactly the
ids a TFF model would see for the same snippet.
"""

from __future__ import annotations

import numpy as np

from flowjax.data.text import text_bytes

# TFF's vocabulary, re-used from its "Federated Learning for Text Generation" tutorial.
# The order matters: a character's id is its position here plus one.
CHAR_VOCAB = ('dhlptx@DHLPTX $(,048cgkoswCGKOSW[_#\'/37;?bfjnrvzBFJNRVZ"&*.26:\n'
              'aeimquyAEIMQUY]!%)-159\r')
SEQUENCE_LENGTH = 80  # McMahan et al., AISTATS 2017.

PAD = 0
OOV = len(CHAR_VOCAB) + 1
BOS = len(CHAR_VOCAB) + 2
EOS = len(CHAR_VOCAB) + 3
VOCAB_SIZE = len(CHAR_VOCAB) + 4

# Byte -> id table: TFF tokenizes bytes, so a non-ASCII character becomes one OOV id
# per UTF-8 byte, and so does it here.
_BYTE_TO_ID = np.full(256, OOV, np.int32)
_BYTE_TO_ID[np.frombuffer(CHAR_VOCAB.encode("ascii"), np.uint8)] = np.arange(
    1, len(CHAR_VOCAB) + 1, dtype=np.int32)

_ID_TO_TEXT = ("", *CHAR_VOCAB, "<oov>", "<bos>", "<eos>")


def encode(text: str | bytes) -> np.ndarray:
    """Maps a snippet to character ids ``1..86`` (``OOV`` otherwise), ``int32 [len]``.

    ``str`` is encoded as UTF-8 first, so ``str`` and ``bytes`` snippets (TFF's h5
    files store bytes) give identical ids.

    Raises:
      ValueError: ``text`` is not text (a number), in one line.
    """
    data = text_bytes(text, "snippet")
    return _BYTE_TO_ID[np.frombuffer(data, np.uint8)]


def decode(ids: np.ndarray | list[int]) -> str:
    """Renders ids as text for debugging: padding is dropped, specials shown as tags."""
    flat = np.asarray(ids, np.int64).reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= VOCAB_SIZE):
        raise ValueError(f"ids must lie in [0, {VOCAB_SIZE}), got range "
                         f"[{flat.min()}, {flat.max()}]")
    return "".join(_ID_TO_TEXT[i] for i in flat)


def snippet_to_sequences(text: str | bytes,
                         seq_len: int = SEQUENCE_LENGTH) -> tuple[np.ndarray, np.ndarray]:
    """Turns one snippet into next-character examples, TFF style.

    Args:
      text: one snippet (a speaking turn).
      seq_len: length of each input/target sequence.

    Returns:
      ``(x, y)``, both ``int32 [num_sequences, seq_len]``, where ``y`` is ``x``
      shifted left by one within each chunk of ``seq_len + 1`` tokens. The token
      stream is ``BOS, chars..., EOS`` padded with ``PAD`` to a whole chunk.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len}")
    chars = encode(text)
    chunk = seq_len + 1
    num_chunks = -(-(len(chars) + 2) // chunk)
    tokens = np.zeros(num_chunks * chunk, np.int32)
    tokens[0] = BOS
    tokens[1:len(chars) + 1] = chars
    tokens[len(chars) + 1] = EOS
    chunks = tokens.reshape(num_chunks, chunk)
    return chunks[:, :-1].copy(), chunks[:, 1:].copy()
