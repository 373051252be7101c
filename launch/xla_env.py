"""Process-wide XLA settings, applied by the launchers before JAX is imported.

On XLA's CPU backend, routing matmuls through YNNPACK (and leaving convolutions to
Eigen) was the fastest measured setting (docs/performance in the README). XLA flags are
process-wide and must be set before ``import jax``; set ``FLOWJAX_XLA_TUNING=0`` to keep
the environment untouched, or put your own ``XLA_FLAGS``.
"""

import os

CPU_FLAGS = ("--xla_cpu_experimental_ynn_fusion_type=individual_dot",)


def apply() -> None:
    # JAX logs at INFO that it found no TPU; under absl that line lands on stderr, in
    # front of the one-line errors users should see.
    import logging
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    if os.environ.get("FLOWJAX_XLA_TUNING", "1") == "0":
        return
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in CPU_FLAGS:
        if flag.split("=")[0] not in flags:
            flags = f"{flags} {flag}".strip()
    os.environ["XLA_FLAGS"] = flags
