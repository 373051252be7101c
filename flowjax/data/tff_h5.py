"""Converts TFF's federated h5 files (EMNIST, Shakespeare, Stack Overflow) into client stores.

TFF's layout: a top group ``examples``, one subgroup per client id, one dataset per
feature (EMNIST ``pixels`` ``float32 [n, 28, 28]`` with 1.0 = background and ``label``;
Shakespeare ``snippets``; Stack Overflow ``tokens``, space-joined, plus metadata we do
not use). Files are read client by client with h5py, never whole. Clients are stored in the
source's order (h5: the group's, sorted by name; TFF SQLite: its sorted client ids;
FedJAX: ``ORDER BY rowid``).

A converted dataset is a *task directory*::

    task.json        {"format": "flowjax-federated-task", "version": 1, "dataset": ...,
                      "populations": ["train"] or ["train", "held_out"], "options": ...}
                     (also the marker ``--overwrite`` looks for before deleting anything)
    train/           ClientStore of the training clients (splits "train" and "test")
    held_out/        ClientStore of never-training clients (Stack Overflow only)
    vocab.json       Stack Overflow only: the word list, see below

Examples (the stored ``x``/``y``):

* EMNIST: ``x`` = pixels ``float32 [28, 28]`` as stored (TFF's convention, 1.0 =
  background; FedJAX's ``1 - pixels`` is a batch-time step of its models, not applied),
  ``y`` = label ``int32``. Clients' train rows come from the train split and test rows
  from the test split. Conversion refuses labels that are not integers in
  ``[0, 62)`` (``[0, 10)`` digits only) and pixels that are not finite values in ``[0, 1]``.
* Shakespeare: every snippet through :func:`flowjax.data.shakespeare.snippet_to_sequences`
  (``int32 [80]`` each), exactly as the embedded dataset.
* Stack Overflow: word ids, TFF's next-word layout (``tff.simulation.baselines``):
  ``0`` pad, ``1..V`` the vocabulary (the first ``V = 10,000`` words of TFF's
  ``stackoverflow.word_count`` when given, TFF's own list; else the train split's most
  frequent words, by descending occurrences then ascending bytes), ``V + 1`` out-of-vocabulary,
  ``V + 2`` beginning of sentence, ``V + 3`` end of sentence (``V + 4 = 10,004`` ids).
  A sentence becomes ``[bos] + ids[:20]`` followed by ``eos`` only when it had fewer than
  20 words, padded with 0 to 21; ``x`` is its first 20 ids, ``y`` its last 20.
  Train clients keep their first 1,000 train sentences; their test rows come from
  ``stackoverflow_test.h5``. The held-out users (``stackoverflow_held_out.h5``) form the
  ``held_out`` population, each user's sentences split in order: the first 80% train.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import pathlib
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import numpy as np

from flowjax.core import durable
from flowjax.core.checks import first_line, is_digits, new_folder_problem
from flowjax.data import shakespeare, source_damage
from flowjax.data.client_store import ClientRecord, Spec, write_store
from flowjax.data.text import text_bytes, text_rows

TASK_FORMAT = "flowjax-federated-task"
TASK_VERSION = 1
KINDS = ("emnist", "shakespeare", "stackoverflow")

VOCAB_SIZE = 10_000
SO_SEQUENCE_LENGTH = 20
MAX_SENTENCES = 1_000
HELD_OUT_TRAIN_FRACTION = 0.8

RawClient = Mapping[str, np.ndarray]


class ClientSource(Protocol):
    """One split of a federated source file, read client by client."""

    name: str

    def client_ids(self) -> Iterator[str]:
        """Every client id, in the file's (sorted) order."""

    def __contains__(self, client_id: str) -> bool: ...

    def read(self, client_id: str) -> RawClient:
        """The client's features under TFF's names (``pixels``, ``snippets``, ...)."""


class H5Source:
    """One TFF h5 file; keeps the file open and reads one client group at a time."""

    def __init__(self, path: str | os.PathLike, features: Sequence[str]):
        import h5py
        self.name = str(path)
        try:
            self._file = h5py.File(path, "r")
        except OSError as error:  # h5py's message names no file
            raise ValueError(f"{path}: cannot be read as HDF5 ({first_line(error)}); expected "
                             "TFF's h5 file (damaged or incompletely downloaded? download it "
                             "again)") from None
        # Every lookup below is of a name the file's listing holds, so h5py's KeyError
        # there is damage (a broken B-tree or heap), as are its OSError and RuntimeError.
        self._intact = functools.partial(source_damage.reading, self.name, OSError,
                                         RuntimeError, KeyError)
        try:
            with self._intact():
                examples = self._file["examples"] if "examples" in self._file else None
        except ValueError:
            self._file.close()
            raise
        if not isinstance(examples, h5py.Group):
            self._file.close()
            found = "no" if examples is None else f"a {type(examples).__name__}, not a group, as"
            raise ValueError(f"{path}: {found} top-level 'examples'; expected a group of "
                             "client groups (not a TFF h5 file)")
        self._examples = examples
        self._features = tuple(features)
        self._group_type, self._dataset_type = h5py.Group, h5py.Dataset

    def client_ids(self) -> Iterator[str]:
        # Sorted, as TFF's HDF5ClientData sorts them: a file written with creation-order
        # tracking lists its groups in that order. h5py lists the names without touching
        # the data.
        with self._intact():
            ids = sorted(self._examples.keys())
        yield from ids

    def __contains__(self, client_id: str) -> bool:
        with self._intact():
            return client_id in self._examples

    def read(self, client_id: str) -> RawClient:
        try:
            with self._intact():
                group = self._examples[client_id]
        except ValueError:  # a name h5py cannot open is damage only if the file lists it
            if client_id not in self:
                raise KeyError(f"{self.name}: no client {client_id!r}") from None
            raise
        with self._intact():
            if not isinstance(group, self._group_type):
                raise ValueError(f"{self.name}: examples/{client_id} is a "
                                 f"{type(group).__name__}, not a group: expected one group per "
                                 "client holding its features")
            names = sorted(group)
            missing = [f for f in self._features if f not in names]
            if missing:
                raise ValueError(f"{self.name}: client {client_id!r} lacks {missing} "
                                 f"(has {names})")
            values = {}
            for feature in self._features:
                item = group[feature]
                if not isinstance(item, self._dataset_type):
                    raise ValueError(f"{self.name}: client {client_id!r} feature {feature!r} is a "
                                     f"{type(item).__name__}: expected a dataset")
                with source_damage.reading(f"{self.name}: client {client_id!r} "
                                           f"feature {feature!r}", OSError, RuntimeError):
                    values[feature] = item[()]  # a damaged chunk
        return values

    def close(self) -> None:
        self._file.close()


@contextlib.contextmanager
def opened(open_source: Callable[[Any], Any], paths: Mapping[str, Any]
           ) -> Iterator[dict[str, Any]]:
    """``{split: open_source(path)}``, each closed on leaving, and those already open
    closed should a later one fail to open."""
    with contextlib.ExitStack() as stack:
        sources = {}
        for split, path in paths.items():
            sources[split] = open_source(path)
            stack.callback(sources[split].close)
        yield sources


# ----------------------------------------------------------------- per-dataset encoders

EMNIST_CLASSES = 62
EMNIST_DIGITS = 10


def _first(values: np.ndarray, bad: np.ndarray) -> str:
    # str() of the numpy scalar: float32 3.7 prints as 3.7, not 3.700000047683716
    return str(values.reshape(-1)[int(np.flatnonzero(bad.reshape(-1))[0])])


def emnist_examples(raw: RawClient, num_classes: int = EMNIST_CLASSES) -> dict[str, np.ndarray]:
    """EMNIST pixels and labels as ``x float32 [n, 28, 28]``, ``y int32 [n]``.

    Raises:
      ValueError: a label that is not an integer in ``[0, num_classes)``, a pixel that
        is not a finite value in ``[0, 1]`` (TFF's convention), images that are not
        ``[n, 28, 28]`` (or ``[n, 784]``) or not one per label, named in one line.
    """
    pixels, labels = np.asarray(raw["pixels"]), np.asarray(raw["label"]).reshape(-1)
    if labels.dtype.kind not in "iuf" or pixels.dtype.kind not in "iuf":
        raise ValueError(f"labels are {labels.dtype} and pixels {pixels.dtype}: expected numbers")
    if labels.dtype.kind == "f":
        bad = ~np.isfinite(labels) | (labels != np.round(labels))
        if bad.any():
            raise ValueError(f"label {_first(labels, bad)}: expected integer class labels")
    bad = (labels < 0) | (labels >= num_classes)
    if bad.any():
        raise ValueError(f"label {_first(labels, bad)}: expected labels in [0, {num_classes})")
    if pixels.shape[1:] not in ((28, 28), (784,)):
        raise ValueError(f"pixels of shape {pixels.shape}: expected [n, 28, 28] images "
                         "(TFF's EMNIST) or [n, 784]")
    if len(pixels) != len(labels):
        raise ValueError(f"{len(pixels)} images but {len(labels)} labels")
    x = pixels.astype(np.float32).reshape(-1, 28, 28)
    bad = ~np.isfinite(x) | (x < 0) | (x > 1)
    if bad.any():
        raise ValueError(f"pixel {_first(x, bad)} ({pixels.dtype} source): expected finite "
                         "values in [0, 1] (TFF's EMNIST, 1.0 = background)")
    y = labels.astype(np.int32)
    return {"x": x, "y": y}


def shakespeare_examples(raw: RawClient) -> dict[str, np.ndarray]:
    """Every snippet cut into ``int32 [80]`` next-character pairs."""
    pairs = [shakespeare.snippet_to_sequences(s) for s in text_rows(raw["snippets"], "snippets")]
    empty = np.zeros((0, shakespeare.SEQUENCE_LENGTH), np.int32)
    return {"x": np.concatenate([x for x, _ in pairs]) if pairs else empty,
            "y": np.concatenate([y for _, y in pairs]) if pairs else empty}


class WordIds:
    """Stack Overflow word -> id, TFF's layout (see the module docstring)."""

    def __init__(self, words: Sequence[str]):
        self.words = tuple(words)
        self._ids = {w.encode("utf-8"): i + 1 for i, w in enumerate(self.words)}
        self.pad, self.oov = 0, len(self.words) + 1
        self.bos, self.eos = len(self.words) + 2, len(self.words) + 3
        self.size = len(self.words) + 4

    def sentence(self, text: bytes | str, length: int = SO_SEQUENCE_LENGTH) -> np.ndarray:
        """``int32 [length + 1]``: bos, the first ``length`` word ids, eos if room, pads."""
        data = text_bytes(text, "sentence")
        # TFF splits on single spaces (tf.strings.split(sep=' ')): an empty word between
        # two spaces, or of an empty sentence, is out of vocabulary.
        ids = [self._ids.get(w, self.oov) for w in data.split(b" ")][:length]
        if len(ids) < length:
            ids.append(self.eos)
        row = np.zeros(length + 1, np.int32)
        row[0] = self.bos
        row[1:len(ids) + 1] = ids
        return row

    def examples(self, raw: RawClient) -> dict[str, np.ndarray]:
        """A client's ``tokens`` sentences as ``x``/``y`` ``int32 [n, 20]``."""
        rows = [self.sentence(s) for s in text_rows(raw["tokens"], "tokens")]
        tokens = (np.stack(rows) if rows
                  else np.zeros((0, SO_SEQUENCE_LENGTH + 1), np.int32))
        return {"x": tokens[:, :-1].copy(), "y": tokens[:, 1:].copy()}


def count_words(source: ClientSource) -> collections.Counter:
    """Word occurrences over every sentence of ``source``, split as ``WordIds`` splits
    (the empty word is not counted)."""
    counts: collections.Counter = collections.Counter()
    for client_id in source.client_ids():
        tokens = source.read(client_id)["tokens"]  # its errors name the file
        try:
            sentences = [text_bytes(s, "sentence") for s in text_rows(tokens, "tokens")]
        except ValueError as error:
            raise ValueError(f"{source.name}: client {client_id!r}: {error}") from None
        for sentence in sentences:
            counts.update(w for w in sentence.split(b" ") if w)
    return counts


# TFF's published vocabulary (``tff.simulation.datasets.stackoverflow.load_word_counts``,
# which FedJAX's ``default_vocab`` and Reddi et al.'s ``create_vocab`` read too): one
# ``word count`` line per word, most frequent first; the vocabulary is its first V words.
WORD_COUNT_FILE = "stackoverflow.word_count"


def read_word_counts(path: str | os.PathLike, size: int = VOCAB_SIZE) -> list[str]:
    """The first ``size`` words of TFF's ``stackoverflow.word_count`` file, in file order.

    Raises:
      ValueError: the file is unreadable, a line is not ``word count``, or it holds fewer
        than ``size`` words (one line).
    """
    words: list[str] = []
    try:
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                fields = line.split()
                if len(fields) != 2 or not is_digits(fields[1]):
                    raise ValueError(f"{path}:{number}: {line.strip()[:60]!r} is not "
                                     "'word count'; expected TFF's stackoverflow.word_count")
                words.append(fields[0])
                if len(words) == size:
                    return words
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: cannot read it ({error}); expected TFF's "
                         "stackoverflow.word_count") from None
    raise ValueError(f"{path} holds {len(words)} words; expected at least --vocab_size={size}")


def top_words(counts: Mapping[bytes, int], size: int = VOCAB_SIZE) -> list[str]:
    """The ``size`` most frequent words, by descending count then ascending bytes.

    Raises:
      ValueError: fewer than ``size`` distinct words (a smaller vocabulary than asked for,
        which the run's model would not match), or a chosen word is not UTF-8 (vocab.json
        holds text), naming it.
    """
    if len(counts) < size:
        raise ValueError(f"its train split holds {len(counts)} distinct words; expected at "
                         f"least --vocab_size={size} (pass --vocab_size={len(counts)} or "
                         "fewer, or TFF's stackoverflow.word_count as --vocab_file)")
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:size]
    words = []
    for word, _ in ranked:
        try:
            words.append(word.decode("utf-8"))
        except UnicodeDecodeError:
            raise ValueError(f"the vocabulary word {word[:40]!r} is not UTF-8: expected UTF-8 "
                             "sentences (TFF's Stack Overflow), or pass --vocab_file") from None
    return words


# ----------------------------------------------------------------------- conversion

_SPECS: dict[str, Spec] = {
    "emnist": {"x": ((28, 28), np.float32), "y": ((), np.int32)},
    "shakespeare": {"x": ((shakespeare.SEQUENCE_LENGTH,), np.int32),
                    "y": ((shakespeare.SEQUENCE_LENGTH,), np.int32)},
    "stackoverflow": {"x": ((SO_SEQUENCE_LENGTH,), np.int32),
                      "y": ((SO_SEQUENCE_LENGTH,), np.int32)},
}
# TFF's feature names per dataset.
RAW_FEATURES: dict[str, tuple[str, ...]] = {
    "emnist": ("pixels", "label"), "shakespeare": ("snippets",), "stackoverflow": ("tokens",)}


def _cap(examples: dict[str, np.ndarray], cap: int | None) -> dict[str, np.ndarray]:
    return examples if cap is None else {n: a[:cap] for n, a in examples.items()}


def _encoded(source: ClientSource, client_id: str,
             encode: Callable[[RawClient], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One client's examples; a bad value is a one-line error naming file and client."""
    try:
        return encode(source.read(client_id))
    except (ValueError, KeyError) as e:
        text = first_line(e)
        if text.startswith(source.name):
            raise ValueError(text) from None
        raise ValueError(f"{source.name}: client {client_id!r}: {text}") from None


def _paired_clients(train: ClientSource, test: ClientSource,
                    encode: Callable[[RawClient], dict[str, np.ndarray]],
                    train_cap: int | None, dropped: dict[str, int]) -> Iterator[ClientRecord]:
    """Every client of ``train`` with its test rows from ``test`` (none when absent).

    Counts into ``dropped`` the test clients with no train rows (they cannot be kept: a
    client's test rows belong to its train rows).
    """
    paired = 0
    for client_id in train.client_ids():
        record = {"train": _cap(_encoded(train, client_id, encode), train_cap)}
        if client_id in test:
            record["test"] = _encoded(test, client_id, encode)
            paired += 1
        yield client_id, record
    dropped["test_only_clients"] = sum(1 for _ in test.client_ids()) - paired


def _check_shared_clients(train: ClientSource, test: ClientSource) -> None:
    """Refuses a test split that shares no client with its train split (another download,
    or ids written differently): every client would be left without test rows. Reads ids
    only, and stops at the first shared one."""
    if not any(client_id in test for client_id in train.client_ids()):
        raise ValueError(f"{test.name}: none of its {sum(1 for _ in test.client_ids())} "
                         f"clients is a client of {train.name}: expected the test split of the "
                         "same clients (are both files from one download?)")


def _split_clients(source: ClientSource, encode: Callable[[RawClient], dict[str, np.ndarray]],
                   train_fraction: float, train_cap: int | None) -> Iterator[ClientRecord]:
    """Every client of ``source``, its examples split in order into train and test."""
    for client_id in source.client_ids():
        examples = _encoded(source, client_id, encode)
        n = len(examples["y"])
        cut = min(max(int(train_fraction * n), 1), n - 1) if n >= 2 else n
        yield client_id, {"train": _cap({k: a[:cut] for k, a in examples.items()}, train_cap),
                          "test": {k: a[cut:] for k, a in examples.items()}}


# What a task directory holds (task.json is also the marker of one); a folder with
# anything else in it is never deleted by --overwrite.
_TASK_ENTRIES = frozenset({"task.json", "vocab.json", "train", "held_out"})


def _is_task_dir(path: pathlib.Path) -> str | None:
    """None if ``path`` is a task directory this project wrote and holds nothing else,
    else why not."""
    try:
        task = json.loads((path / "task.json").read_text())
    except (OSError, ValueError):
        return f"no {TASK_FORMAT} task.json marker"
    if not isinstance(task, dict) or task.get("format") != TASK_FORMAT:
        return f"its task.json is not a {TASK_FORMAT} marker"
    for entry in sorted(path.iterdir()):
        if entry.name not in _TASK_ENTRIES:
            return f"it holds {entry.name!r}, which convert.py does not write"
        if entry.is_dir():
            stray = [e.name for e in sorted(entry.iterdir())
                     if e.name != "meta.json" and e.suffix != ".npy"]
            if stray:
                return f"it holds {entry.name}/{stray[0]}, which convert.py does not write"
    return None


def check_out_dir(out_dir: str | os.PathLike, overwrite: bool,
                  protected: Sequence[str | os.PathLike] = ()) -> None:
    """Raises unless writing ``out_dir`` can lose nothing but an older conversion.

    An existing ``out_dir`` is replaced only with ``overwrite``, only when it is a task
    directory this project wrote (:func:`_is_task_dir`), and never when it is one of
    ``protected`` (the source folder), contains one or lies inside one.
    """
    out_dir = pathlib.Path(out_dir)
    if not out_dir.exists() and not out_dir.is_symlink():
        problem = new_folder_problem(str(out_dir))
        if problem:  # else only its temporary folder's Errno would say so
            where = f" {problem}" if problem.kind == "under_file" else f": {problem}"
            raise ValueError(f"--out={out_dir}{where}; expected a new folder in one you can "
                             "write")
        return
    if not overwrite:
        raise FileExistsError(f"{out_dir} already exists (use --overwrite to replace it)")
    out = out_dir.resolve()
    for folder in protected:
        source = pathlib.Path(folder).resolve()
        if out == source or out in source.parents or source in out.parents:
            relation = ("is" if out == source else "contains" if out in source.parents
                        else "lies inside")
            raise ValueError(f"--out={out_dir} {relation} the source folder {folder}: refusing "
                             "to replace it; choose another --out")
    if out_dir.is_symlink() or not out_dir.is_dir():
        raise ValueError(f"--out={out_dir} is not a folder convert.py wrote: refusing to "
                         "replace it; choose another --out")
    why = _is_task_dir(out_dir)
    if why is not None:
        raise ValueError(f"--out={out_dir} is not a task directory convert.py wrote ({why}): "
                         "refusing to delete it; choose another --out")


def _write_task_dir(out_dir: pathlib.Path, build: Callable[[pathlib.Path], dict[str, Any]],
                    overwrite: bool, protected: Sequence[str | os.PathLike] = ()) -> pathlib.Path:
    """Runs ``build(tmp_dir) -> task.json fields`` and moves the result to ``out_dir``."""
    check_out_dir(out_dir, overwrite, protected)
    # Ctrl-C included: the old one is put back (durable.replace_folder).
    with durable.replacing_folder(out_dir) as tmp:
        fields = build(tmp)
        task = {"format": TASK_FORMAT, "version": TASK_VERSION, **fields}
        (tmp / "task.json").write_text(json.dumps(task, indent=1, sort_keys=True))
        if out_dir.exists():
            check_out_dir(out_dir, overwrite, protected)  # unchanged while we converted
    return out_dir


def convert_sources(kind: str, sources: Mapping[str, ClientSource], out_dir: str | os.PathLike,
                    *, max_sentences: int | None = MAX_SENTENCES, vocab_size: int = VOCAB_SIZE,
                    vocab_file: str | os.PathLike | None = None,
                    held_out_train_fraction: float = HELD_OUT_TRAIN_FRACTION,
                    overwrite: bool = False, origin: str = "", num_classes: int | None = None,
                    protected: Sequence[str | os.PathLike] = ()) -> pathlib.Path:
    """Converts opened split sources (``train``, ``test``, ``held_out``) to a task directory.

    Args:
      kind: ``emnist``, ``shakespeare`` or ``stackoverflow``.
      sources: ``{split: ClientSource}``; ``held_out`` is read for Stack Overflow only.
      out_dir: the task directory to create.
      max_sentences: Stack Overflow: keep each client's first ``max_sentences`` train
        sentences (None keeps all).
      vocab_size: Stack Overflow: number of vocabulary words.
      vocab_file: Stack Overflow: TFF's ``stackoverflow.word_count``, whose first
        ``vocab_size`` words are the vocabulary TFF, FedJAX and Reddi et al. use; None
        counts the train split's word occurrences instead (not TFF's list: its counts are
        users per word, and its order of ties is the file's).
      held_out_train_fraction: Stack Overflow: share of a held-out user's sentences
        (the first ones) used for personalization.
      overwrite: replace an existing ``out_dir`` (only a task directory this project
        wrote: see :func:`check_out_dir`).
      origin: provenance recorded in the stores' metadata.
      num_classes: EMNIST: labels must lie in ``[0, num_classes)`` (default 62).
      protected: folders ``out_dir`` must not be, contain or lie in (the source).

    Raises:
      ValueError: one line: a split with 0 clients, a bad value (see
        :func:`emnist_examples`), an ``out_dir`` that may not be replaced.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown dataset {kind!r}; expected one of {list(KINDS)}")
    if max_sentences is not None and max_sentences < 1:
        raise ValueError(f"max_sentences must be >= 1 or None, got {max_sentences}")
    if kind == "stackoverflow" and vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1 (the number of vocabulary words), got "
                         f"{vocab_size}")
    if kind == "stackoverflow" and not 0 < held_out_train_fraction < 1:  # NaN fails too
        raise ValueError(f"held_out_train_fraction must be in (0, 1) (the share of a held-out "
                         f"user's sentences used for personalization), got "
                         f"{held_out_train_fraction}")
    spec = _SPECS[kind]
    check_out_dir(out_dir, overwrite, protected)
    needed = ("train", "test", "held_out") if kind == "stackoverflow" else ("train", "test")
    for split in needed:
        if next(iter(sources[split].client_ids()), None) is None:
            raise ValueError(f"{sources[split].name}: 0 clients in its {split} split: expected "
                             "at least one client (is it the right file, completely downloaded?)")
    _check_shared_clients(sources["train"], sources["test"])
    classes = EMNIST_CLASSES if num_classes is None else num_classes
    vocabulary = (f"first words of {os.path.basename(vocab_file)}" if vocab_file is not None
                  else "train word occurrences")
    options = {"max_sentences": max_sentences, "vocab_size": vocab_size,
               "held_out_train_fraction": held_out_train_fraction,
               "vocabulary": vocabulary} if kind == "stackoverflow" else {}
    # Read before anything is written: a bad word-count file fails at once.
    listed = (read_word_counts(vocab_file, vocab_size)
              if kind == "stackoverflow" and vocab_file is not None else None)

    def build(tmp: pathlib.Path) -> dict[str, Any]:
        dropped: dict[str, int] = {}
        source_meta = {"dataset": kind, "origin": origin, **options}
        if kind == "stackoverflow":
            words = listed
            if words is None:
                counts = count_words(sources["train"])  # its errors name file and client
                try:
                    words = top_words(counts, vocab_size)
                except ValueError as error:
                    raise ValueError(f"{sources['train'].name}: {error}") from None
            vocab = WordIds(words)
            (tmp / "vocab.json").write_text(json.dumps(
                {"words": words, "pad": vocab.pad, "oov": vocab.oov, "bos": vocab.bos,
                 "eos": vocab.eos, "size": vocab.size, "source": vocabulary}))
            encode, cap = vocab.examples, max_sentences
        else:
            encode = (functools.partial(emnist_examples, num_classes=classes)
                      if kind == "emnist" else shakespeare_examples)
            cap = None
        write_store(tmp / "train", _paired_clients(sources["train"], sources["test"], encode,
                                                   cap, dropped), spec, source=source_meta)
        populations = ["train"]
        if kind == "stackoverflow":
            write_store(tmp / "held_out", _split_clients(sources["held_out"], encode,
                                                         held_out_train_fraction, cap),
                        spec, source=source_meta)
            populations.append("held_out")
        return {"dataset": kind, "populations": populations, "options": options,
                "origin": origin, **dropped}

    return _write_task_dir(pathlib.Path(out_dir), build, overwrite, protected)


def tff_h5_names(kind: str, only_digits: bool = False) -> dict[str, str]:
    """``{split: file name}`` of TFF's h5 files of ``kind``."""
    if kind == "emnist":
        stem = "fed_emnist_digitsonly" if only_digits else "fed_emnist"
        names = {s: f"{stem}_{s}.h5" for s in ("train", "test")}
    elif kind == "shakespeare":
        names = {s: f"shakespeare_{s}.h5" for s in ("train", "test")}
    elif kind == "stackoverflow":
        names = {s: f"stackoverflow_{s}.h5" for s in ("train", "test", "held_out")}
    else:
        raise ValueError(f"unknown dataset {kind!r}; expected one of {list(KINDS)}")
    return names


def tff_h5_files(kind: str, source_dir: str | os.PathLike,
                 only_digits: bool = False) -> dict[str, pathlib.Path]:
    """The TFF file of each split of ``kind`` in ``source_dir``."""
    source_dir = pathlib.Path(source_dir)
    paths = {s: source_dir / n for s, n in tff_h5_names(kind, only_digits).items()}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"missing TFF h5 files: {', '.join(missing)}")
    return paths


def convert_tff(kind: str, source_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                only_digits: bool = False, **options: Any) -> pathlib.Path:
    """Converts TFF's h5 files of ``kind`` in ``source_dir`` into a task directory.

    Args:
      kind: ``emnist``, ``shakespeare`` or ``stackoverflow``.
      source_dir: directory holding TFF's files (e.g. ``fed_emnist_train.h5``).
      out_dir: the task directory to create.
      only_digits: EMNIST: read the ``fed_emnist_digitsonly_*`` files.
      **options: passed to :func:`convert_sources`.
    """
    paths = tff_h5_files(kind, source_dir, only_digits)
    with opened(lambda path: H5Source(path, RAW_FEATURES[kind]), paths) as sources:
        return convert_sources(kind, sources, out_dir, origin=f"tff_h5:{source_dir}",
                               num_classes=EMNIST_DIGITS if only_digits else None, **options)
