"""Process-wide XLA settings, applied by the launchers before JAX is imported.

On XLA's CPU backend, routing matmuls through YNNPACK (and leaving convolutions to
Eigen) was the fastest measured setting (docs/performance in the README). XLA flags are
process-wide and must be set before ``import jax``; set ``FLOWJAX_XLA_TUNING=0`` to keep
the environment untouched, or put your own ``XLA_FLAGS``.
"""

import os

CPU_FLAGS = ("--xla_cpu_experimental_ynn_fusion_type=individual_dot",)


def apply() -> None:
    if os.environ.get("FLOWJAX_XLA_TUNING", "1") == "0":
        return
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in CPU_FLAGS:
        if flag.split("=")[0] not in flags:
            flags = f"{flags} {flag}".strip()
    os.environ["XLA_FLAGS"] = flags
