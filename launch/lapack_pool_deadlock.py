r"""Does a batched LAPACK call still deadlock XLA's CPU runtime? The minimal program.

  python launch/lapack_pool_deadlock.py [--tries=5] [--timeout_s=60] [--batch=8] [--size=128]
      [--arms=batched,sequential]

jaxlib's CPU LAPACK kernels (0.10.2) split a batch of matrices into tasks on XLA's
intra-op thread pool and wait for them, from a thread of that same pool. One jitted
program with two independent batched QRs can run both calls at once; on a pool of two
threads (a 2-core machine) both threads then wait, and no thread is left to run the
tasks: the process hangs, the CPUs idle (native stacks, 2026-12-05: both pool threads in
``jax::ParallelBatchMap``'s ``absl::BlockingCounter::Wait`` under ``lapack_sgeqrf_ffi``).
flowjax met it in the fresh init of the LSTMs' orthogonal kernels under ``vmap``
(``flowjax.algorithms.base.fresh_layers``, which since maps such an init one client at a
time with ``jax.custom_batching.sequential_vmap``: unbatched calls run inline).

This runs ``PROGRAM`` (no flowjax import, to hand upstream as it is) ``--tries`` times in
fresh processes for each arm, ``batched`` (``jnp.linalg.qr`` of a batch) and
``sequential`` (the same QR under ``sequential_vmap``), each killed after
``--timeout_s``, and prints how many finished and how many hung. When a jaxlib makes
``batched`` finish every time on a 2-core machine, the workaround can go.
"""

from __future__ import annotations

import os
import subprocess
import sys

from absl import app, flags

from launch import cli

_TRIES = flags.DEFINE_integer("tries", 5, "Fresh processes per arm.")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 60, "Seconds before a process counts as hung.")
_BATCH = flags.DEFINE_integer("batch", 8, "Matrices per QR call.")
_SIZE = flags.DEFINE_integer("size", 128, "Rows and columns of each matrix.")
ARMS = ("batched", "sequential")
_ARMS = flags.DEFINE_list("arms", list(ARMS), "Which arms to run, in this order.")
cli.define_debug_flag()

# argv: arm, batch, size. Twenty calls of one program with two independent QRs.
PROGRAM = """
import sys
import jax
import jax.numpy as jnp

arm, batch, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
qr = lambda m: jnp.linalg.qr(m)[0]
if arm == "sequential":
    qr = jax.vmap(jax.custom_batching.sequential_vmap(qr))

@jax.jit
def two_qrs(x, y):
    return qr(x).sum() + qr(y).sum()

x = jax.random.normal(jax.random.key(0), (batch, size, size))
y = jax.random.normal(jax.random.key(1), (batch, size, size))
for i in range(20):
    two_qrs(x, y + i).block_until_ready()
print("finished")
"""


def run_arm(arm: str, tries: int, timeout_s: int, batch: int, size: int) -> tuple[int, int]:
    """``(finished, hung)`` of ``tries`` fresh processes running ``PROGRAM`` for ``arm``."""
    finished = hung = 0
    for _ in range(tries):
        try:
            done = subprocess.run([sys.executable, "-c", PROGRAM, arm, str(batch), str(size)],
                                  capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            hung += 1
            continue
        if done.returncode != 0 or "finished" not in done.stdout:
            raise RuntimeError(f"{arm}: the program failed (exit {done.returncode}): "
                               f"{done.stderr.strip().splitlines()[-1:]}")
        finished += 1
    return finished, hung


def main(argv):
    del argv
    for name, value in (("tries", _TRIES.value), ("timeout_s", _TIMEOUT.value),
                        ("batch", _BATCH.value), ("size", _SIZE.value)):
        if value < 1:
            return cli.fail(ValueError(f"--{name}: {value} is not a positive integer; "
                                       "expected >= 1"))
    unknown = [arm for arm in _ARMS.value if arm not in ARMS]
    if unknown or not _ARMS.value:
        return cli.fail(ValueError(f"--arms: {','.join(unknown) or 'none'} is not an arm; "
                                   f"expected some of {', '.join(ARMS)}"))
    import jax
    import jaxlib
    cores = len(os.sched_getaffinity(0))
    print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, {cores} cores, "
          f"{_TRIES.value} tries per arm, {_BATCH.value} x {_SIZE.value} x {_SIZE.value}, "
          f"hung = killed after {_TIMEOUT.value} s\n")
    print("| arm | finished | hung |\n|---|---:|---:|")
    for arm in _ARMS.value:
        finished, hung = run_arm(arm, _TRIES.value, _TIMEOUT.value, _BATCH.value, _SIZE.value)
        print(f"| {arm} | {finished} | {hung} |", flush=True)
    return 0


if __name__ == "__main__":
    app.run(main)
