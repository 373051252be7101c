"""Command-line parsing for the launchers: a bad command line fails with one line, exit 2.

ml_collections resolves ``--config.<field>`` overrides while absl parses flags, before
``main`` runs, and reports an unknown field, a missing config file or a bad variant as a
traceback. ``parse_flags`` loads the config file itself first, checks every override
against it, and turns any flag error or stray positional argument into
``error: <one line>`` (``--debug`` keeps the traceback). ``run`` starts a launcher's
``main`` so that Ctrl-C ends it with one line and exit status 130; ``fail`` reports a
launcher's error in one line, exit status 2.

This module imports no JAX: the launchers import it before ``xla_env.apply()``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import shlex
import signal
import sys
import traceback
from typing import Any, Callable, Sequence

from absl import app, flags

_DEBUG_SPELLINGS = ("--debug", "--debug=true", "--debug=True", "--debug=1")
# 128 + SIGINT: what shells report for a command stopped by Ctrl-C, so scripts that run a
# launcher see an interruption, not a failure (2) or a success (0).
INTERRUPTED = 130


def _flag_args(argv: Sequence[str]) -> list[str]:
    """The arguments absl reads as flags (everything before a bare ``--``)."""
    args = list(argv[1:])
    return args[: args.index("--")] if "--" in args else args


def _config_spec(args: Sequence[str]) -> str | None:
    for i, arg in enumerate(args):
        if arg.startswith("-") and arg.lstrip("-").startswith("config="):
            return arg.split("=", 1)[1]
        if arg in ("--config", "-config") and i + 1 < len(args):
            return args[i + 1]
    return None


def _override_names(args: Sequence[str]) -> list[tuple[str, str]]:
    """``(field path, argument)`` of every ``--config.<path>`` and ``--noconfig.<path>``."""
    names = []
    for arg in args:
        bare = arg.lstrip("-")
        for prefix in ("config.", "noconfig."):
            if arg.startswith("-") and bare.startswith(prefix):
                names.append((bare[len(prefix):].split("=", 1)[0], arg))
    return names


_CONFIG_FILE = "a Python file defining get_config(), e.g. --config=configs/shakespeare.py:quick"


def _load_config(spec: str) -> Any:
    path, *variant = spec.split(":", 1)
    module_spec = importlib.util.spec_from_file_location("_launch_config_check", path)
    if module_spec is None:  # not a .py file: no loader (an AttributeError on None)
        raise ValueError(f"expected {_CONFIG_FILE}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, "get_config", None)):
        raise ValueError(f"{path} defines no get_config(); expected {_CONFIG_FILE}")
    return module.get_config(*variant)


def _unknown_field(config: Any, name: str, arg: str) -> str | None:
    node, seen = config, []
    for part in name.split("."):
        where = "config" + "".join(f".{p}" for p in seen)
        if not hasattr(node, "keys"):
            return (f"unknown config field {name!r} ({arg}): {where} is a value, not a group "
                    "of fields")
        if part not in node:
            return (f"unknown config field {name!r} ({arg}); expected one of {where}'s fields "
                    f"{sorted(node.keys())}")
        node, seen = node[part], seen + [part]
    return None


def config_args_error(argv: Sequence[str]) -> str | None:
    """One line saying what is wrong with ``--config`` and its overrides, or None."""
    args = _flag_args(argv)
    spec = _config_spec(args)
    if spec is None:
        return None  # the launcher's main reports a missing --config
    path = spec.split(":", 1)[0]
    if not os.path.isfile(path):
        return f"config file {path!r} (--config={spec}) not found; expected {_CONFIG_FILE}"
    try:
        config = _load_config(spec)
    except Exception as error:  # noqa: BLE001 - a config file may raise anything; report it
        text = " ".join(str(error).split()) or type(error).__name__
        return f"--config={spec}: {text}"
    for name, arg in _override_names(args):
        message = _unknown_field(config, name, arg)
        if message is not None:
            return message
    return None


def _positional_error(remaining: Sequence[str]) -> str | None:
    """The launchers take flags only; a stray word (a typo'd ``-`` or a value split by an
    unquoted space) would otherwise be ignored."""
    if len(remaining) <= 1:
        return None
    return (f"unexpected argument {remaining[1]!r}; expected only flags, --name=value "
            "(quote a value that holds spaces)")


def parse_flags(argv: list[str]) -> list[str]:
    """An ``absl.app.run`` ``flags_parser``: the parsed arguments, or exit 2 with one line.

    Example:
      >>> app.run(main, flags_parser=cli.parse_flags)
    """
    if any(arg in _DEBUG_SPELLINGS for arg in _flag_args(argv)):
        remaining = flags.FLAGS(argv)
        message = _positional_error(remaining)
    else:
        message = config_args_error(argv)
        if message is None:
            try:
                remaining = flags.FLAGS(argv)
                message = _positional_error(remaining)
            except flags.Error as error:
                message = " ".join(str(error).split())
    if message is None:
        return remaining
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def command_line(argv: Sequence[str] | None = None) -> str:
    """``python launch/<script> <flags>`` as typed (``sys.argv`` by default), each argument
    shell-quoted where it needs it, so that a table's header can be pasted back (a workdir
    with a space was split in two)."""
    argv = sys.argv if argv is None else argv
    script = os.path.relpath(os.path.abspath(argv[0]), os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    return " ".join(["python", shlex.quote(script), *map(shlex.quote, argv[1:])])


def say_superseded(superseded: list[str], stem: str) -> None:
    """One line per subset table ``run_folder.write_table_keeping_wider`` removed."""
    for subset in superseded:
        print(f"removed {subset}.md and .csv: {stem}.md covers everything they showed",
              flush=True)


def define_debug_flag() -> None:
    """Defines the launcher's ``--debug`` flag, read by ``debug`` (not by the launcher).

    Once per process: tests import several launchers, and absl refuses a second
    definition of a flag name."""
    if "debug" not in flags.FLAGS:
        flags.DEFINE_bool("debug", False, "Show full tracebacks on errors.")


def debug() -> bool:
    """Whether the launcher's ``--debug`` flag (if it defines one) asks for tracebacks."""
    return "debug" in flags.FLAGS and bool(flags.FLAGS["debug"].value)


def fail(error: BaseException) -> int:
    """Prints ``error: <message on one line>`` to stderr; exit status 2 (``--debug``:
    re-raises, so the traceback shows)."""
    if debug():
        raise error
    print(f"error: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
    return 2


class ArgumentParser(argparse.ArgumentParser):
    """``argparse`` for the launchers that parse with it (the parity, sensitivity and
    measurement scripts): a bad command line is one ``error:`` line, exit 2, as with
    ``parse_flags``, not argparse's usage block."""

    def error(self, message: str):
        print(f"error: {' '.join(message.split())} (--help lists the options)",
              file=sys.stderr, flush=True)
        sys.exit(2)


def integer_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``low``, else a message naming the value."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= {low}")
        return value
    return parse


def check_output_file(flag: str, value: str) -> None:
    """Raises ValueError (one line) unless ``value`` can become a file: checked before a
    measurement, not after its minutes."""
    folder = os.path.dirname(os.path.abspath(value))
    if os.path.isdir(value) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"--{flag}={value}: expected a file path in an existing folder you "
                         "can write")


# 128 + SIGTERM, for a run stopped by the signal a scheduler (or `kill`) sends first.
TERMINATED = 143

RESUMES = ("the same command resumes from the newest checkpoint (with checkpoint_every=0 "
           "a run starts over)")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Python is when it arrives, as Ctrl-C raises
    ``KeyboardInterrupt``: the run stops the same way, files complete."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated


def _distributed() -> Any:
    """``flowjax.distributed`` if a launcher imported it (this module imports no JAX)."""
    return sys.modules.get("flowjax.distributed")


def _leave_now(status: int) -> None:
    """Exits without Python's exit handlers: JAX's would wait in its shutdown barrier for
    the other processes of a multi-host run (for a lost one, until the heartbeat timeout,
    100 s, and then abort with a C++ stack trace). Leaving now is what a kill at this
    point would do, which the checkpoints are written to survive."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _exit_if_a_process_is_lost(error: Exception) -> None:
    """Ends a multi-host run's process at once on ``flowjax.distributed.ProcessLost``: one
    ``error:`` line (``--debug``: the traceback), exit status 2."""
    distributed = _distributed()
    if distributed is None or not isinstance(error, distributed.ProcessLost):
        return
    if debug():
        traceback.print_exc()
    else:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
    _leave_now(2)


def _stop_while_starting(signum, frame) -> None:
    name = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
    print(f"interrupted ({name}) while starting, before anything was written",
          file=sys.stderr, flush=True)
    _leave_now(TERMINATED if signum == signal.SIGTERM else INTERRUPTED)


def stop_at_once_while_starting(module: str) -> None:
    """For a launcher run as a script (``module``: its ``__name__``), called before it
    imports JAX: Ctrl-C or SIGTERM until ``run`` starts its ``main`` (imports, flag
    parsing; nothing written yet) ends the process at once, in one line.

    Raised as ``KeyboardInterrupt`` there, a Ctrl-C could land in the garbage collector's
    callback that JAX registers at import, which swallows it: the launcher went on and ran
    the whole run (exit 0).
    """
    if module == "__main__":
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _stop_while_starting)


def _quiet_interrupt(main: Callable[[list[str]], int | None],
                     resumable: bool) -> Callable[[list[str]], int]:
    @functools.wraps(main)
    def wrapped(argv):
        # From here a signal stops the run where it is, its files complete
        # (``stop_at_once_while_starting`` ends with the start).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _raise_terminated)
        try:
            return main(argv)
        except Exception as error:
            _exit_if_a_process_is_lost(error)
            raise
        except KeyboardInterrupt as interrupt:
            terminated = isinstance(interrupt, Terminated)
            status = TERMINATED if terminated else INTERRUPTED
            # A multi-host run's signal outside the run loop's agreed stops (loading, the
            # first compile, HypCluster's warm-up, writing the results): the others go on
            # until their next collective, which then fails for them (ProcessLost). Under
            # --debug too: a re-raise would leave through JAX's shutdown barrier.
            distributed = _distributed()
            alone = distributed is not None and distributed.stops_alone()
            if debug():
                if not alone:
                    raise
                traceback.print_exc()
                _leave_now(status)
            # Checkpoint writes hold both signals until they are complete
            # (flowjax/checkpoint.py).
            print(f"interrupted ({'SIGTERM' if terminated else 'Ctrl-C'})"
                  + (f"; {RESUMES}" if resumable else ""), file=sys.stderr, flush=True)
            if alone:
                _leave_now(status)
            return status
    return wrapped


def run(main: Callable[[list[str]], int | None], resumable: bool = False) -> None:
    """``absl.app.run(main)`` with ``parse_flags``; Ctrl-C and SIGTERM end it with one line
    (exit 130 and 143); ``resumable``: a launcher that trains run folders, whose line
    says how to resume."""
    app.run(_quiet_interrupt(main, resumable), flags_parser=parse_flags)
