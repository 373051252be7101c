"""Process-wide XLA settings, applied by the launchers before JAX is imported.

On XLA's CPU backend, routing matmuls through YNNPACK (and leaving convolutions to
Eigen) was the fastest measured setting (docs/performance in the README). XLA flags are
process-wide and must be set before ``import jax``; set ``FLOWJAX_XLA_TUNING=0`` to keep
the environment untouched, or put your own ``XLA_FLAGS``.

The launchers also keep compiled programs in JAX's persistent compilation cache
(``compilation_cache_dir``; ``launch/benchmark.py`` turns it off, as it times
compiling): the runs of a reproduction grid that differ only in the seed
compile the same programs (the seed is an argument, not a constant), and so does a rerun.
A hit loads the executable XLA built for the identical program (JAX keys it on the
program, the compile options, ``XLA_FLAGS``, the backend and the versions), so no number
changes.
"""

import os
from typing import Mapping

CPU_FLAGS = ("--xla_cpu_experimental_ynn_fusion_type=individual_dot",)
CACHE_ENV = "FLOWJAX_COMPILATION_CACHE"


def compilation_cache_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """The launchers' compilation cache folder, or None when it is turned off.

    ``JAX_COMPILATION_CACHE_DIR`` wins when set (JAX reads it itself);
    ``FLOWJAX_COMPILATION_CACHE=0`` turns the cache off, ``=<dir>`` names the folder;
    by default ``$XDG_CACHE_HOME/flowjax/xla`` (``~/.cache/flowjax/xla``).
    """
    environ = os.environ if environ is None else environ
    if environ.get("JAX_COMPILATION_CACHE_DIR"):
        return environ["JAX_COMPILATION_CACHE_DIR"]
    choice = environ.get(CACHE_ENV, "")
    if choice == "0":
        return None
    if choice:
        return os.path.abspath(os.path.expanduser(choice))
    cache_home = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache_home, "flowjax", "xla")


def apply() -> None:
    # JAX logs at INFO that it found no TPU; under absl that line lands on stderr, in
    # front of the one-line errors users should see.
    import logging
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    # JAX creates the folder at its first write, after the launcher has validated its
    # input. Where the folder is ours, every program is kept, not only those that took a
    # second to compile (JAX's default): a small run's many quick programs together cost
    # as much as its round (measured: a warm 2-round synthetic train.py run took 7 s of
    # wall time with all programs kept, 11 s with the default, 20 s uncached).
    # A folder the user gave JAX keeps the user's JAX settings.
    cache = compilation_cache_dir()
    if cache is not None and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    if os.environ.get("FLOWJAX_XLA_TUNING", "1") == "0":
        return
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in CPU_FLAGS:
        if flag.split("=")[0] not in flags:
            flags = f"{flags} {flag}".strip()
    os.environ["XLA_FLAGS"] = flags
