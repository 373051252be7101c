r"""Converts a downloaded federated dataset into a flowjax task directory, once.

  python launch/convert.py --dataset=emnist --source=~/tff_data --out=~/data/emnist
  python launch/convert.py --dataset=stackoverflow --source=DIR --out=DIR \
      --format=fedjax_sqlite

``--source`` holds TFF's h5 files (``fed_emnist_train.h5``, ``shakespeare_test.h5``,
``stackoverflow_held_out.h5``, ...) or FedJAX's ``*_<split>.sqlite`` files. The output is
read by the tasks ``emnist_tff``, ``shakespeare_tff`` and ``stackoverflow_tff`` with
option ``store_dir=<out>``.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pathlib  # noqa: E402
from typing import Any  # noqa: E402

from absl import app, flags  # noqa: E402

from flowjax.data import fedjax_sqlite, tff_h5  # noqa: E402

FORMATS = ("tff_h5", "fedjax_sqlite")

_DATASET = flags.DEFINE_enum("dataset", None, list(tff_h5.KINDS), "Dataset to convert.")
_SOURCE = flags.DEFINE_string("source", None, "Directory holding the downloaded files.")
_OUT = flags.DEFINE_string("out", None, "Task directory to write.")
_FORMAT = flags.DEFINE_enum("format", "tff_h5", list(FORMATS), "Format of the source files.")
_ONLY_DIGITS = flags.DEFINE_bool("only_digits", False, "EMNIST: the digits-only files.")
_MAX_SENTENCES = flags.DEFINE_integer(
    "max_sentences", tff_h5.MAX_SENTENCES,
    "Stack Overflow: keep each client's first N train sentences (0 keeps all).")
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", tff_h5.VOCAB_SIZE,
                                   "Stack Overflow: vocabulary words.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing --out directory.")


def convert(dataset: str, source: str | os.PathLike, out: str | os.PathLike,
            fmt: str = "tff_h5", **options: Any) -> pathlib.Path:
    """Converts ``dataset`` files in ``source`` (format ``fmt``) into task directory ``out``.

    ``options``: ``only_digits`` (EMNIST), ``max_sentences``, ``vocab_size``,
    ``held_out_train_fraction`` (Stack Overflow), ``overwrite``, and for
    ``fedjax_sqlite`` a ``feature_map``.
    """
    source, out = os.path.expanduser(str(source)), os.path.expanduser(str(out))
    if dataset != "stackoverflow":
        for name in ("max_sentences", "vocab_size", "held_out_train_fraction"):
            options.pop(name, None)
    if fmt == "tff_h5":
        return tff_h5.convert_tff(dataset, source, out, **options)
    if fmt == "fedjax_sqlite":
        return fedjax_sqlite.convert_fedjax_sqlite(dataset, source, out, **options)
    raise ValueError(f"unknown format {fmt!r}; expected one of {list(FORMATS)}")


def main(argv: list[str]) -> None:
    del argv
    for flag in (_DATASET, _SOURCE, _OUT):
        if flag.value is None:
            raise app.UsageError(f"--{flag.name} is required")
    start = time.perf_counter()
    options: dict[str, Any] = {"overwrite": _OVERWRITE.value,
                               "max_sentences": _MAX_SENTENCES.value or None,
                               "vocab_size": _VOCAB_SIZE.value}
    if _DATASET.value == "emnist":
        options["only_digits"] = _ONLY_DIGITS.value
    try:
        out = convert(_DATASET.value, _SOURCE.value, _OUT.value, _FORMAT.value, **options)
    except (ValueError, OSError) as error:
        print(f"error: {str(error).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {out} in {time.perf_counter() - start:.1f}s; load it with "
          f"load_task('{_DATASET.value}_tff', {{'store_dir': '{out}'}})")


if __name__ == "__main__":
    app.run(main)
