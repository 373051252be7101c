"""TFDS datasets read by random access from prepared array_record files, never downloaded.

A run only reads: ``tfds.data_source`` would otherwise start a download (and, without
network, fail deep inside TFDS). A dataset not prepared is one line naming the command
that prepares it.
"""

from __future__ import annotations

from typing import Any, Sequence

from flowjax.core.checks import first_line


def prepared_sources(name: str, splits: Sequence[str], data_dir: str | None) -> dict[str, Any]:
    """``{split: tfds.data_source(name, split)}`` of a prepared dataset.

    Raises:
      ValueError: one line: ``name`` is not prepared in ``data_dir`` (or TFDS's default),
        with the command that prepares it; or it is prepared in a format without random
        access.
    """
    import tensorflow_datasets as tfds  # imported here: only the TFDS datasets need it

    try:
        return {split: tfds.data_source(name, split=split, data_dir=data_dir, download=False)
                for split in splits}
    # KeyError: the folder a preparation that failed (offline, say) leaves behind reads
    # as a dataset with no splits.
    except (RuntimeError, OSError, AssertionError, KeyError) as error:
        builder = tfds.builder(name, data_dir=data_dir, file_format="array_record")
        if builder.is_prepared():  # prepared, but not readable by random access
            raise ValueError(f"{name} in {builder.data_dir}: {first_line(error)}") from None
        raise ValueError(
            f"{name} is not prepared in {builder.data_dir}: expected the TFDS array_record "
            f"files; prepare them once, on a machine with internet: python -c \"import "
            f"tensorflow_datasets as tfds; tfds.builder('{name}', file_format='array_record')"
            f".download_and_prepare()\" (then data_dir, if not TFDS's default)") from None
