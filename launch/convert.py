r"""Converts a downloaded federated dataset into a flowjax task directory, once.

  python launch/convert.py --dataset=emnist --source=~/.keras/datasets --out=~/data/emnist
  python launch/convert.py --dataset=stackoverflow --source=DIR --out=DIR \
      --format=fedjax_sqlite

``--source`` holds one of (``--format=auto``, the default, finds which and says so):

* ``tff_sqlite``: what TFF downloads today, ``emnist_all.sqlite.lzma``,
  ``shakespeare.sqlite.lzma``, ``stackoverflow.sqlite.lzma`` (or the decompressed
  ``.sqlite`` TFF leaves in its cache);
* ``tff_h5``: TFF's pre-2021 files (``fed_emnist_train.h5``, ``shakespeare_test.h5``,
  ``stackoverflow_held_out.h5``, ...);
* ``fedjax_sqlite``: FedJAX's files (``federated_emnist_train.sqlite``,
  ``shakespeare_train.sqlite``, ``stackoverflow_held_out.sqlite``, ...).

The output is read by the tasks ``emnist_tff``, ``shakespeare_tff`` and
``stackoverflow_tff`` with option ``store_dir=<out>``. ``--overwrite`` replaces only a
task directory this tool wrote (its ``task.json`` marker, nothing else inside), never the
source folder, a folder holding it or one inside it.
"""

import json
import os
import pathlib
import sqlite3
import sys
import time
from typing import Any

from absl import flags

from launch import cli
cli.stop_at_once_while_starting(__name__)

from flowjax.core.checks import first_line
from flowjax.data import fedjax_sqlite, source_damage, tff_h5, tff_sqlite

# In the order --format=auto prefers them when several are complete.
FORMATS = ("tff_sqlite", "tff_h5", "fedjax_sqlite")
_TITLES = {"tff_sqlite": "TFF SQLite", "tff_h5": "TFF h5", "fedjax_sqlite": "FedJAX SQLite"}

_DATASET = flags.DEFINE_enum("dataset", None, list(tff_h5.KINDS), "Dataset to convert.")
_SOURCE = flags.DEFINE_string("source", None, "Directory holding the downloaded files.")
_OUT = flags.DEFINE_string("out", None, "Task directory to write.")
_FORMAT = flags.DEFINE_enum("format", "auto", ["auto", *FORMATS],
                            "Format of the source files (auto: found from the file names).")
_ONLY_DIGITS = flags.DEFINE_bool("only_digits", False, "EMNIST: the digits-only split/files.")
_MAX_SENTENCES = flags.DEFINE_integer(
    "max_sentences", tff_h5.MAX_SENTENCES,
    "Stack Overflow: keep each client's first N train sentences (0 keeps all).")
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", tff_h5.VOCAB_SIZE,
                                   "Stack Overflow: vocabulary words.")
_VOCAB_FILE = flags.DEFINE_string(
    "vocab_file", None, "Stack Overflow: TFF's stackoverflow.word_count (its first "
    "--vocab_size words are TFF's vocabulary); default: that file in --source if it is "
    "there, else the train split's most frequent words.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False,
                               "Replace an existing --out written by this tool.")
cli.define_debug_flag()


def expected_files(dataset: str, fmt: str, only_digits: bool = False) -> list[tuple[str, ...]]:
    """The files ``fmt`` needs for ``dataset``: each tuple is one file, any of its names."""
    if fmt == "tff_sqlite":
        stem = tff_sqlite.FILE_STEMS[dataset]
        return [(f"{stem}.sqlite", f"{stem}.sqlite.lzma")]
    if fmt == "tff_h5":
        return [(n,) for n in tff_h5.tff_h5_names(dataset, only_digits).values()]
    if fmt == "fedjax_sqlite":
        return [(n,) for n in fedjax_sqlite.fedjax_file_names(dataset, only_digits).values()]
    raise ValueError(f"unknown format {fmt!r}; expected one of {['auto', *FORMATS]}")


def survey(dataset: str, source: str | os.PathLike,
           only_digits: bool = False) -> dict[str, tuple[list[str], list[str]]]:
    """``{format: (files found, files missing)}`` in ``source`` for ``dataset``."""
    source = pathlib.Path(source)
    result = {}
    for fmt in FORMATS:
        found, missing = [], []
        for names in expected_files(dataset, fmt, only_digits):
            present = [n for n in names if (source / n).is_file()]
            (found if present else missing).append(present[0] if present else " or ".join(names))
        result[fmt] = (found, missing)
    return result


def detect_format(dataset: str, source: str | os.PathLike, fmt: str = "auto",
                  only_digits: bool = False) -> tuple[str, str]:
    """``(format, one line saying what was found)``; one-line ``ValueError`` naming what is
    missing when no format is complete."""
    if not pathlib.Path(source).is_dir():
        raise ValueError(f"--source={source} is not a directory: expected the folder "
                         "holding the downloaded files")
    files = survey(dataset, source, only_digits)
    if fmt != "auto":
        found, missing = files[fmt]
        if missing:
            raise ValueError(f"{_TITLES[fmt]} {dataset} files in {source}: found "
                             f"{found or 'none'}, missing {', '.join(missing)}")
        return fmt, f"found {_TITLES[fmt]} {', '.join(found)} in {source}"
    complete = [f for f in FORMATS if not files[f][1]]
    if complete:
        chosen = complete[0]
        line = f"found {_TITLES[chosen]} {', '.join(files[chosen][0])} in {source}"
        if len(complete) > 1:
            line += (f" (also complete: {', '.join(_TITLES[f] for f in complete[1:])}; "
                     "--format picks another)")
        return chosen, line
    partial = [f for f in FORMATS if files[f][0]]
    if partial:
        fmt = partial[0]
        raise ValueError(f"found {_TITLES[fmt]} {', '.join(files[fmt][0])} in {source} but "
                         f"not {', '.join(files[fmt][1])}")
    wanted = "; ".join(f"{_TITLES[f]}: {', '.join(files[f][1])}" for f in FORMATS)
    raise ValueError(f"no {dataset}{' digits-only' if only_digits else ''} files in {source}: "
                     f"expected {wanted}")


def convert(dataset: str, source: str | os.PathLike, out: str | os.PathLike,
            fmt: str = "auto", **options: Any) -> pathlib.Path:
    """Converts ``dataset`` files in ``source`` (format ``fmt``) into task directory ``out``.

    ``options``: ``only_digits`` (EMNIST), ``max_sentences``, ``vocab_size``,
    ``vocab_file`` (default: ``stackoverflow.word_count`` in ``source`` if there),
    ``held_out_train_fraction`` (Stack Overflow), ``overwrite``, and for
    ``fedjax_sqlite`` a ``feature_map``.
    """
    source, out = os.path.expanduser(str(source)), os.path.expanduser(str(out))
    if dataset != "stackoverflow":
        for name in ("max_sentences", "vocab_size", "vocab_file", "held_out_train_fraction"):
            options.pop(name, None)
    elif options.get("vocab_file") is None:
        listed = os.path.join(source, tff_h5.WORD_COUNT_FILE)
        options["vocab_file"] = listed if os.path.isfile(listed) else None
    fmt, _ = detect_format(dataset, source, fmt, options.get("only_digits", False))
    # Before any file is read: an --out that must not be replaced fails at once.
    tff_h5.check_out_dir(out, options.get("overwrite", False), (source,))
    options["protected"] = (source,)
    if fmt == "tff_h5":
        return tff_h5.convert_tff(dataset, source, out, **options)
    if fmt == "fedjax_sqlite":
        return fedjax_sqlite.convert_fedjax_sqlite(dataset, source, out, **options)
    return tff_sqlite.convert_tff_sqlite(dataset, source, out, **options)


def _fail(text: str) -> None:
    print(f"error: {text}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str]) -> None:
    del argv  # cli.parse_flags refused any positional argument
    for flag in (_DATASET, _SOURCE, _OUT):
        if flag.value is None:
            _fail(f"--{flag.name} is required")
    start = time.perf_counter()
    options: dict[str, Any] = {"overwrite": _OVERWRITE.value,
                               "max_sentences": _MAX_SENTENCES.value or None,
                               "vocab_size": _VOCAB_SIZE.value,
                               "vocab_file": (os.path.expanduser(_VOCAB_FILE.value)
                                              if _VOCAB_FILE.value else None)}
    if _DATASET.value == "emnist":
        options["only_digits"] = _ONLY_DIGITS.value
    source = os.path.expanduser(_SOURCE.value)
    try:
        fmt, found = detect_format(_DATASET.value, source, _FORMAT.value,
                                   _ONLY_DIGITS.value and _DATASET.value == "emnist")
        print(found, flush=True)
        out = convert(_DATASET.value, source, _OUT.value, fmt, **options)
    except (ValueError, OSError, sqlite3.DatabaseError, RuntimeError) as error:
        # sqlite3.DatabaseError / h5py's RuntimeError: a file damaged inside, which
        # opened fine (a truncated one is refused on opening). The sources' reads name
        # the file (flowjax/data/source_damage.py); this is for damage met elsewhere.
        if cli.debug():
            raise
        damaged = (isinstance(error, (sqlite3.DatabaseError, RuntimeError))
                   and not isinstance(error, source_damage.SQLITE_NOT_DAMAGE))
        text = first_line(error)
        _fail(f"a file in --source={source} is damaged ({text}); download it again"
              if damaged else text)
    except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM (cli.run: cli.Terminated)
        if cli.debug():
            raise
        terminated = isinstance(interrupt, cli.Terminated)
        # The conversion writes a temporary folder and moves it into place at the end.
        print(f"interrupted ({'SIGTERM' if terminated else 'Ctrl-C'}); --out={_OUT.value} "
              "was left as it was; the same command converts again", file=sys.stderr,
              flush=True)
        sys.exit(cli.TERMINATED if terminated else cli.INTERRUPTED)
    test_only = json.loads((pathlib.Path(out) / "task.json").read_text()).get("test_only_clients")
    if test_only:
        print(f"test clients left out: {test_only}, with no train rows (a client's test "
              "rows are kept with its train rows; task.json: test_only_clients)", flush=True)
    print(f"wrote {out} in {time.perf_counter() - start:.1f}s; load it with "
          f"load_task('{_DATASET.value}_tff', {{'store_dir': '{out}'}})")


if __name__ == "__main__":
    # cli.run: SIGTERM (a scheduler's, `kill`'s) unwinds like Ctrl-C, so the temporary
    # folders are removed and a replaced store is put back; it used to kill outright.
    cli.run(main)
