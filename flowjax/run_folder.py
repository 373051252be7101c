"""The run folder (``--workdir``): the only module that knows its file names, writes them
atomically and reads them back.

A run folder holds:

* ``config.json``: the resolved config, written before the first round;
* ``metrics.jsonl``: one JSON record per line, a ``train`` record per round and an
  ``eval`` record per evaluated population (``flowjax.engine.callbacks.MetricsFile``);
* ``results.json``: the final evaluation, written last, so its presence marks a finished
  run (same seed, same bytes);
* ``run.json``: wall time, compilations and warnings (never compared: time varies);
* ``checkpoints/``: orbax checkpoints by round (``flowjax.checkpoint``);
* ``tensorboard/``: event files, with ``config.tensorboard`` (``flowjax.tensorboard_log``);
* ``plots/``: what ``launch/plot.py`` draws;
* ``.flowjax-lock``: while a run uses the folder, its lock (``RunLock``).

Example:
  >>> write_json_atomic(path(workdir, RESULTS), {"acc_g": 0.5})
  >>> read_results(workdir, remedy="rerun it")["acc_g"]
  0.5
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from typing import Any, BinaryIO, Callable

from flowjax.core import durable, file_modes
from flowjax.core.checks import is_digits

CONFIG = "config.json"
METRICS = "metrics.jsonl"
RESULTS = "results.json"
RUN_INFO = "run.json"
CHECKPOINTS = "checkpoints"
# Rows of client states kept on disk (client_states="disk"; core/client_state_disk.py).
CLIENT_STATES = "client_states"
TENSORBOARD = "tensorboard"
PLOTS = "plots"
# The files a run writes (``--overwrite`` removes them with the two folders below).
RUN_FILES = (CONFIG, METRICS, RESULTS, RUN_INFO)  # in the order a run writes them
RUN_FOLDERS = (CHECKPOINTS, CLIENT_STATES, TENSORBOARD)
# Subfolders that are never runs themselves when runs are searched for under a folder.
NOT_RUNS = (CHECKPOINTS, CLIENT_STATES, PLOTS, TENSORBOARD)


def path(workdir: str, name: str) -> str:
    """Where ``name`` (one of this module's names) lies in ``workdir``."""
    return os.path.join(workdir, name)


# ---------------------------------------------------------------------------- writing
def write_text_atomic(file: str, text: str) -> None:
    """``write_atomic`` of ``text``."""
    write_atomic(file, lambda out: out.write(text.encode()))


def write_atomic(file: str, write: Callable[[BinaryIO], Any]) -> None:
    """``write(out)`` to a temporary file in the same folder, then a rename over ``file``.

    A crash or Ctrl-C mid-write leaves the previous file intact; the folder is synced
    after the rename, without which a power loss may keep the old entry (or none) on disk.
    A kill mid-write leaves the temporary file, named after ``file`` so that the next
    writer under the folder's lock can tell it for a leftover (``remove_write_leftovers``).
    """
    folder = os.path.dirname(os.path.abspath(file))
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=_temporary_prefix(file))
    try:
        with os.fdopen(handle, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        file_modes.as_if_created(temporary)  # mkstemp's 0600 would hide the results
        os.replace(temporary, file)
    except BaseException:
        os.unlink(temporary)
        raise
    durable.fsync_path(folder)


def _temporary_prefix(file: str) -> str:
    return f".{os.path.basename(file)}.tmp-"


# Before 2026-12 the temporary files were all named .tmp-<mkstemp's 8 characters>.
_OLD_TEMPORARY = re.compile(r"\.tmp-[a-z0-9_]{8}")


def remove_write_leftovers(folder: str, names: tuple[str, ...]) -> list[str]:
    """Removes the temporary files that a kill in ``write_text_atomic`` of one of
    ``names`` left in ``folder`` (and the older, unnamed kind); the names it removed.

    Only for a caller that holds the folder's lock: another writer's temporary file is
    indistinguishable from a leftover.
    """
    prefixes = tuple(_temporary_prefix(name) for name in names)
    try:
        entries = os.listdir(folder)
    except FileNotFoundError:
        return []
    removed = []
    for entry in sorted(entries):
        file = os.path.join(folder, entry)
        if ((entry.startswith(prefixes) or _OLD_TEMPORARY.fullmatch(entry))
                and os.path.isfile(file) and not os.path.islink(file)):
            os.remove(file)
            removed.append(entry)
    return removed


def write_json_atomic(file: str, payload: Any) -> None:
    """``write_text_atomic`` of ``payload`` as indented JSON."""
    write_text_atomic(file, json.dumps(payload, indent=2, sort_keys=True))


def metrics_line(record: dict[str, Any]) -> str:
    """One ``metrics.jsonl`` line."""
    return json.dumps(record) + "\n"


def write_metrics(workdir: str, records: list[dict[str, Any]]) -> None:
    """Replaces ``metrics.jsonl`` by exactly ``records`` (atomically)."""
    write_text_atomic(path(workdir, METRICS), "".join(metrics_line(r) for r in records))


def remove_run(workdir: str) -> None:
    """Removes a previous run's files and folders from ``workdir`` (``--overwrite``), and
    the PNGs of its figures in ``plot_folders``.

    ``config.json`` goes last: it says whose the other files are, and a folder holding
    them without it is refused even with ``--overwrite``, so a kill mid-removal must leave
    it behind for the same command to finish the job.
    """
    for name in RUN_FOLDERS:
        shutil.rmtree(path(workdir, name), ignore_errors=True)
    for folder in plot_folders(workdir):  # the replaced run's figures, not what else is there
        remove_figures(folder, keep=())
    for name in RUN_FILES[::-1]:
        if os.path.exists(path(workdir, name)):
            os.remove(path(workdir, name))


def plot_folders(workdir: str) -> list[str]:
    """``launch/plot.py``'s default folders in ``workdir``: ``plots/`` and, for a
    selection of methods, ``plots-<a>+<b>/``."""
    try:
        names = sorted(os.listdir(workdir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [path(workdir, name) for name in names
            if (name == PLOTS or name.startswith(PLOTS + "-"))
            and os.path.isdir(path(workdir, name)) and not os.path.islink(path(workdir, name))]


def remove_figures(folder: str, keep: tuple[str, ...]) -> list[str]:
    """Removes the PNG files of ``folder`` but ``keep`` (the only files ``launch/plot.py``
    writes; anything else there is someone else's), then the folder if that emptied it;
    the names removed."""
    removed = []
    for name in sorted(os.listdir(folder)):
        file = os.path.join(folder, name)
        if name.endswith(".png") and name not in keep and os.path.isfile(file):
            os.remove(file)
            removed.append(name)
    if removed and not os.listdir(folder):
        os.rmdir(folder)
    return removed


# ---------------------------------------------------------------------------- tables of runs
# A table of part of a grid goes here when the grid's table already shows more.
SUBSET_SUFFIX = "-subset"


def table_stem(stem: str, outside: Callable[[str], list[str]]) -> tuple[str, str]:
    """Where to write the table ``<stem>.md`` and ``.csv`` without replacing a wider one.

    A run of part of a grid (one dataset, a few methods, one seed) would otherwise replace
    the table of the whole grid with a table of that part. ``outside(csv_text)`` names
    what an earlier table's CSV shows that the new table does not cover (ValueError: not
    such a table's CSV).

    Returns:
      ``(stem, "")`` when there is no earlier table or it shows nothing outside; else the
      first of ``stem-subset``, ``stem-subset-2``, ... that loses nothing either (the
      table of another part stays too), and why ``<stem>.md`` is kept.
    """
    kept = _hides(stem, outside)
    if not kept:
        return stem, ""
    number = 1
    while True:
        candidate = stem + SUBSET_SUFFIX + (f"-{number}" if number > 1 else "")
        if not _hides(candidate, outside):
            return candidate, kept
        number += 1


def write_table_keeping_wider(stem: str, outside: Callable[[str], list[str]],
                              markdown: str, csv_text: str) -> tuple[str, str, list[str]]:
    """``table_stem`` then ``write_table``, holding the folder's table lock throughout:
    two launchers finishing parts of one grid at once would otherwise both judge the
    folder before either wrote, and the later write could replace the wider table.

    A table written at ``stem`` itself supersedes the ``stem-subset*`` tables of earlier
    parts whose CSV shows nothing it does not cover: they are removed (left, they showed
    a part's older numbers beside the whole grid's).

    Returns:
      ``table_stem``'s ``(stem written, why <stem>.md was kept or "")``, and the stems of
      the subset tables removed.
    """
    folder = os.path.dirname(os.path.abspath(stem))
    with RunLock(folder, name=TABLE_LOCK, wait=True):
        written, kept = table_stem(stem, outside)
        remove_write_leftovers(folder, tuple(
            os.path.basename(name) + suffix for name in dict.fromkeys((stem, written))
            for suffix in (".md", ".csv")))
        write_table(written, markdown, csv_text)
        superseded = [] if kept else _covered_subsets(stem, outside)
        for subset in superseded:
            # The .md first: a kill between the two leaves a CSV, which table_stem reads
            # as a table (and judges again), never an .md without its CSV.
            for suffix in (".md", ".csv"):
                try:
                    os.remove(subset + suffix)
                except FileNotFoundError:
                    pass
    return written, kept, superseded


def _covered_subsets(stem: str, outside: Callable[[str], list[str]]) -> list[str]:
    """The ``stem-subset*`` tables whose CSV the table at ``stem`` covers whole."""
    folder, base = os.path.split(os.path.abspath(stem))
    pattern = re.compile(re.escape(base + SUBSET_SUFFIX) + r"(-[0-9]+)?\.csv")
    found = sorted(name[:-len(".csv")] for name in os.listdir(folder) if pattern.fullmatch(name))
    return [os.path.join(os.path.dirname(stem), name) for name in found
            if not _hides(os.path.join(folder, name), outside)]


def write_table(stem: str, markdown: str, csv_text: str) -> None:
    """``<stem>.csv`` then ``<stem>.md``: ``table_stem`` judges what the ``.md`` shows from
    the ``.csv``, so a kill between the two must not leave a new ``.md`` by an old ``.csv``."""
    write_text_atomic(stem + ".csv", csv_text)
    write_text_atomic(stem + ".md", markdown)


def _hides(stem: str, outside: Callable[[str], list[str]]) -> str:
    """Why writing the table ``stem`` would lose what the one there shows ("": nothing)."""
    md, csv_file = stem + ".md", stem + ".csv"
    if not os.path.exists(md) and not os.path.exists(csv_file):
        return ""
    try:
        with open(csv_file) as handle:
            shown = outside(handle.read())
    except FileNotFoundError:
        return f"{csv_file} is missing, so what {md} shows is unknown"
    except (OSError, UnicodeDecodeError, ValueError) as error:
        return f"{csv_file} cannot be read ({error})"
    if not shown:
        return ""
    return f"it shows {len(shown)} result(s) that this table does not cover, e.g. {shown[0]}"


# ---------------------------------------------------------------------------- one run at a time
LOCK = ".flowjax-lock"
# Held while a table of runs is judged and written (``write_table_keeping_wider``).
TABLE_LOCK = ".flowjax-table-lock"


class RunLock:
    """An exclusive lock on a run folder for as long as a run uses it (``flock`` on
    ``<workdir>/.flowjax-lock``, which holds the owner's pid): a second process given the
    same workdir, such as the same command started twice, two grids sharing cells or
    ``launch/parallel_rows.sh`` with a repeated row, is refused in one line instead of
    truncating the first one's ``metrics.jsonl`` and racing its checkpoints. The file is
    removed on release; the kernel drops the lock of a process that dies.

    ``runner.run_config_to_workdir`` holds it from its config checks to its results; a
    tool that writes a run folder by other means takes it the same way:
    ``with RunLock(workdir): write_metrics(workdir, records)``.

    Another ``name`` locks something else of the folder (``TABLE_LOCK``); with ``wait``
    a second process waits for the lock instead of being refused.
    """

    def __init__(self, workdir: str, name: str = LOCK, wait: bool = False):
        self.file = path(workdir, name)
        self._wait = wait
        self._fd: int | None = None
        self._made: list[str] = []  # folders acquire() created, deepest first

    def acquire(self) -> None:
        """Raises ValueError (one line) when another process holds the lock, or the
        folder cannot be written."""
        import fcntl
        workdir = os.path.dirname(self.file)
        folder = os.path.abspath(workdir)
        while not os.path.exists(folder):
            self._made.append(folder)
            folder = os.path.dirname(folder)
        try:
            os.makedirs(workdir, exist_ok=True)
            while self._fd is None:
                fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | (0 if self._wait else fcntl.LOCK_NB))
                except BlockingIOError:
                    owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                    os.close(fd)
                    raise ValueError(f"--workdir={workdir} is in use by another process "
                                     f"(pid {owner}, {self.file}); expected one run per "
                                     f"workdir at a time: wait for it, or use another "
                                     f"--workdir") from None
                try:
                    same = os.fstat(fd).st_ino == os.stat(self.file).st_ino
                except FileNotFoundError:
                    same = False
                if not same:  # its holder removed it as we opened it: lock the new file
                    os.close(fd)
                    continue
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                self._fd = fd
        except OSError as error:
            raise ValueError(f"--workdir={workdir}: cannot write it "
                             f"({error.strerror or error}); expected a directory you can "
                             f"write") from None

    def release(self) -> None:
        """Removes the file, then drops the lock (in this order: a process that opened
        the file meanwhile sees it gone and opens the next one), then the folders
        ``acquire`` created if a refused run left them empty."""
        if self._fd is not None:
            try:
                os.unlink(self.file)
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = None
        for folder in self._made:
            try:
                os.rmdir(folder)
            except OSError:  # not empty: the run wrote into it
                break
        self._made = []

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


# ---------------------------------------------------------------------------- reading
def read_json(file: str, remedy: str) -> Any:
    """A run file's JSON (None when absent).

    Raises:
      ValueError: the file is not JSON, truncated say (one line ending in ``remedy``).
    """
    if not os.path.exists(file):
        return None
    with open(file) as handle:
        try:
            return json.load(handle)
        except json.JSONDecodeError:
            raise ValueError(f"{file} is not valid JSON (truncated?); {remedy}") from None


# Settings that decide only when and where files are written, never a number or a record
# of results.json or metrics.jsonl (the run loop keeps records in round order): a run may
# be resumed or reused with other values (client_states: from memory to disk; a run that
# kept its rows on disk says to resume it with "disk").
OUTPUT_ONLY_FIELDS = ("checkpoint_every", "client_states", "log_every", "tensorboard")


def _result_config(stored: dict[str, Any]) -> dict[str, Any]:
    """A stored config without the other methods' settings (a run reads only
    ``methods.<algorithm>``: ``method_config``) and without ``OUTPUT_ONLY_FIELDS``."""
    kept = {key: value for key, value in stored.items() if key not in OUTPUT_ONLY_FIELDS}
    methods, algorithm = kept.get("methods"), kept.get("algorithm")
    if isinstance(methods, dict) and algorithm in methods:
        kept["methods"] = {algorithm: methods[algorithm]}
    return kept


def differing_run_fields(stored: dict[str, Any], requested: dict[str, Any]) -> list[str]:
    """``differing_fields`` of the parts of two run configs that decide a run's numbers,
    for telling whether a run folder may be resumed or reused: the other methods'
    settings are left out, so a sweep over one method's field reuses the other methods'
    finished runs, and so are ``OUTPUT_ONLY_FIELDS``.

    A run stored under ``on_divergence="stop"`` may be resumed or reused under
    ``"skip_clients"``: until a divergence both write the same records and checkpoints,
    and "stop" raises at the diverged round's record, before its checkpoint. Not the other
    way: a "skip_clients" run may have gone on past a divergence
    (``runner.conflicting_fields`` allows it while ``went_past_a_divergence`` is False).
    """
    differing = differing_fields(_result_config(stored), _result_config(requested))
    if (stored.get("on_divergence", "stop") == "stop"
            and requested.get("on_divergence") == "skip_clients"):
        differing = [field for field in differing if field != "on_divergence"]
    return differing


def differing_fields(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths where two stored configs differ; an absent field reads as None, so a
    field added with a None default leaves the configs stored before it equal."""
    fields = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            fields += differing_fields(a, b, f"{prefix}{key}.")
        elif a != b:
            fields.append(f"{prefix}{key}")
    return fields


def named_fields(differing: list[str]) -> str:
    """The first differing fields for a message, saying why ``method_revision`` and
    ``model_revision`` matter."""
    named = ", ".join(differing[:6]) + (", ..." if len(differing) > 6 else "")
    changed = [what for field, what in (("method_revision", "method"), ("model_revision", "model"))
               if field in differing]
    if changed:
        named += (f" (the {' and the '.join(changed)}'s code has changed its results since "
                  f"that run)")
    return named


def read_config(workdir: str, remedy: str) -> dict[str, Any] | None:
    """The ``config.json`` a run left in ``workdir`` (None if there is none)."""
    return read_json(path(workdir, CONFIG), remedy)


def read_results(workdir: str, remedy: str) -> dict[str, Any] | None:
    """``results.json`` of ``workdir`` (None while the run has not finished)."""
    return read_json(path(workdir, RESULTS), remedy)


def read_run_info(workdir: str, remedy: str) -> dict[str, Any] | None:
    """``run.json`` of ``workdir`` (None if absent)."""
    return read_json(path(workdir, RUN_INFO), remedy)


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl``, in order ([] when it does not exist).

    A last line that does not parse is skipped: a run being written (or killed mid-line)
    ends that way, and the resumed run writes it again.

    Raises:
      ValueError: a line before the last is not JSON (``<file>:<line>: <error>``).
    """
    file = path(workdir, METRICS)
    if not os.path.exists(file):
        return []
    with open(file) as handle:
        lines = [line for line in handle.read().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if number == len(lines):
                break
            raise ValueError(f"{file}:{number}: {error}") from None
    return records


def finished(workdir: str) -> bool:
    """Whether ``workdir`` holds a finished run (``results.json``)."""
    return os.path.exists(path(workdir, RESULTS))


# Fields every flowjax config.json has held, in every schema: a config.json without them
# is another program's (a model folder's, say), which a run must neither replace nor delete.
CONFIG_MARKERS = ("algorithm", "num_rounds")


def is_run_config(stored: Any) -> bool:
    """Whether a parsed ``config.json`` is a flowjax run's (``CONFIG_MARKERS``; a config
    of the schema before ``config.sgd`` may hold ``per_method`` in place of
    ``num_rounds``)."""
    return (isinstance(stored, dict) and CONFIG_MARKERS[0] in stored
            and any(key in stored for key in (*CONFIG_MARKERS[1:], "per_method")))


def checkpoint_rounds(workdir: str) -> list[int]:
    """The rounds of ``workdir``'s complete checkpoints, oldest first (orbax names a
    finished checkpoint's folder by its round; one being written has a temporary name)."""
    folder = path(workdir, CHECKPOINTS)
    if not os.path.isdir(folder):
        return []
    return sorted(int(name) for name in os.listdir(folder)
                  if is_digits(name) and os.path.isdir(os.path.join(folder, name)))


def has_config(workdir: str) -> bool:
    """Whether ``workdir`` holds a ``config.json``."""
    return os.path.exists(path(workdir, CONFIG))


def is_run(folder: str) -> bool:
    """Whether ``folder`` holds a run's results or metrics (finished or not)."""
    return finished(folder) or os.path.exists(path(folder, METRICS))


def run_files_present(workdir: str) -> list[str]:
    """The names of ``RUN_FILES`` and non-empty ``RUN_FOLDERS`` in ``workdir``: what
    ``remove_run`` would delete."""
    files = [name for name in RUN_FILES if os.path.isfile(path(workdir, name))]
    folders = [f"{name}/" for name in RUN_FOLDERS
               if os.path.isdir(path(workdir, name)) and os.listdir(path(workdir, name))]
    return files + folders


def record_diverged(record: dict[str, Any]) -> bool:
    """Whether a ``metrics.jsonl`` record shows what ``on_divergence='stop'`` stops at: a
    dropped client, a non-finite prediction, a non-finite server step or a non-finite
    training loss (``engine.callbacks.DivergenceGuard``; a test holds the two equal)."""
    loss = record.get("loss")
    return bool(record.get("clients_skipped") or record.get("clients_nonfinite")
                or record.get("server_nonfinite")
                or (record.get("kind") == "train" and loss is not None
                    and not math.isfinite(loss)))


def went_past_a_divergence(workdir: str) -> bool:
    """Whether ``workdir``'s run went on past a divergence, as only
    ``on_divergence='skip_clients'`` does: a record of a round it will not replay (up to
    its newest checkpoint; all of a finished run's) is one ``record_diverged``."""
    last = None if finished(workdir) else (checkpoint_rounds(workdir) or [0])[-1]
    return any(record_diverged(record) for record in read_metrics(workdir)
               if last is None or record.get("round", 0) <= last)


def resumable_differences(workdir: str, stored: dict[str, Any],
                          requested: dict[str, Any]) -> list[str]:
    """``differing_run_fields`` of a run in ``workdir``, less ``on_divergence`` where it
    was stored as "skip_clients", is asked as "stop" and never went past a divergence
    (the same run: an attempt under "skip_clients" writes its config at its start)."""
    differing = differing_run_fields(stored, requested)
    if (differing == ["on_divergence"] and requested.get("on_divergence", "stop") == "stop"
            and not went_past_a_divergence(workdir)):
        return []
    return differing


def has_client_state_files(workdir: str) -> bool:
    """Whether ``workdir`` keeps client-state rows on disk (``client_states/``)."""
    folder = path(workdir, CLIENT_STATES)
    return os.path.isdir(folder) and bool(os.listdir(folder))


def run_started(workdir: str) -> bool:
    """Whether ``workdir``'s run got past its start: a result, a training line in
    ``metrics.jsonl`` or anything under ``checkpoints/``. A ``config.json`` alone is a
    run that failed before its first round: replacing it loses nothing."""
    metrics = path(workdir, METRICS)
    checkpoints = path(workdir, CHECKPOINTS)
    return (finished(workdir)
            or (os.path.exists(metrics) and os.path.getsize(metrics) > 0)
            or (os.path.isdir(checkpoints) and bool(os.listdir(checkpoints))))
