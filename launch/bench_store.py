r"""Builds, opens and samples a Stack Overflow-sized client store, and reports the costs.

  python launch/bench_store.py --num_clients=342477 --dir=/tmp/so_bench

Client sizes are log-normal (median 120 sentences, sigma 1: a long tail) capped at 1,000,
rows are random ``int32 [20]`` token ids; clients are generated one at a time, so the
build never holds more than one client.
"""

import os
import resource
import shutil
import time
from typing import Iterator

import numpy as np
from absl import flags

from flowjax.core.cohort import assemble_cohort, examples_per_client
from flowjax.data.client_store import ClientRecord, ClientStore, StoreError, read_meta, write_store
from launch import cli
cli.stop_at_once_while_starting(__name__)

_NUM_CLIENTS = flags.DEFINE_integer("num_clients", 342_477, "Clients in the store.")
_DIR = flags.DEFINE_string("dir", "/tmp/flowjax_bench_store",
                           "Store directory: new, or a store this benchmark wrote (replaced).")
_COHORT = flags.DEFINE_integer("cohort", 10, "Clients sampled into the cohort.")
_KEEP = flags.DEFINE_bool("keep", False, "Keep the store on disk afterwards.")

SEQ, VOCAB, MEDIAN, SIGMA, CAP = 20, 10_004, 120, 1.0, 1_000
SOURCE = {"dataset": "synthetic_stackoverflow"}
cli.define_debug_flag()


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def synthetic_clients(num_clients: int, seed: int = 0) -> Iterator[ClientRecord]:
    """Stack Overflow-shaped clients, generated one at a time."""
    rng = np.random.default_rng(seed)
    for i in range(num_clients):
        n = int(min(max(round(rng.lognormal(np.log(MEDIAN), SIGMA)), 1), CAP))
        tokens = rng.integers(1, VOCAB, (n + 1, SEQ + 1), dtype=np.int32)
        yield f"{i:08d}", {"train": {"x": tokens[1:, :-1], "y": tokens[1:, 1:]},
                           "test": {"x": tokens[:1, :-1], "y": tokens[:1, 1:]}}


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def check_replaceable(path: str) -> None:
    """Refuses a ``--dir`` that exists and is not a store this benchmark wrote: the
    benchmark replaces the store and deletes it afterwards.

    Raises:
      ValueError: ``path`` is a file, or a non-empty folder that is not such a store.
    """
    if not os.path.exists(path) or (os.path.isdir(path) and not os.listdir(path)):
        return
    try:
        ours = os.path.isdir(path) and read_meta(path).get("source") == SOURCE
    except StoreError:
        ours = False
    if not ours:
        raise ValueError(f"--dir={path} exists and is not a store bench_store.py wrote; "
                         "expected a new or empty directory (the benchmark replaces and "
                         "deletes it), nothing was touched")


def main(argv: list[str]) -> int:
    del argv
    path = _DIR.value
    try:
        if _NUM_CLIENTS.value < 1 or not 1 <= _COHORT.value <= _NUM_CLIENTS.value:
            raise ValueError(f"--num_clients={_NUM_CLIENTS.value} --cohort={_COHORT.value}: "
                             "expected 1 <= cohort <= num_clients")
        check_replaceable(path)
    except ValueError as error:
        return cli.fail(error)
    spec = {"x": ((SEQ,), np.int32), "y": ((SEQ,), np.int32)}
    start = time.perf_counter()
    write_store(path, synthetic_clients(_NUM_CLIENTS.value), spec, overwrite=True,
                source=SOURCE)
    build_s, build_rss = time.perf_counter() - start, _peak_rss_mib()

    start = time.perf_counter()
    store = ClientStore(path)
    open_s = time.perf_counter() - start

    start = time.perf_counter()
    sizes = store.num_examples("train")
    padded = examples_per_client(sizes, batch_size=16, cap=CAP)
    chosen = np.random.default_rng(1).choice(len(store), _COHORT.value, replace=False)
    cohort = assemble_cohort(store, "train", chosen, num_clients=_COHORT.value,
                             padded_examples=padded, batch_size=16, max_examples=CAP)
    cohort_s = time.perf_counter() - start

    print(f"clients: {len(store):,}  train rows: {store.num_rows('train'):,}  "
          f"median/mean/max size: {np.median(sizes):.0f}/{sizes.mean():.1f}/{sizes.max()}")
    print(f"build: {build_s:.1f}s (peak RSS {build_rss:.0f} MiB)")
    print(f"open: {open_s * 1000:.1f}ms")
    print(f"cohort of {_COHORT.value} (sizes + sample + assemble, padded to {padded}): "
          f"{cohort_s * 1000:.1f}ms, {int(cohort.num_examples.sum()):,} examples")
    print(f"store on disk: {_dir_bytes(path) / 2**30:.2f} GiB")
    print(f"peak RSS: {_peak_rss_mib():.0f} MiB")
    if not _KEEP.value:
        shutil.rmtree(path)
    return 0


if __name__ == "__main__":
    cli.run(main)
