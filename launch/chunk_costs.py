r"""What any client mapping could gain on skewed client sizes, from measured round times.

  python launch/chunk_costs.py --round_clients=64 --batch_size=16 \
      --timings=4:0.591,19:0.451,32:0.604,64:0.963

``--timings`` are ``chunk size:round seconds`` of ``launch/benchmark.py --skewed
--strategies=chunked:N,...`` rows (same clients, sizes and method); or ``--results``
reads them from the benchmark's ``--json_out`` files (the ``chunked`` rows of
``--algorithm``; clients and epochs from the files), checking each row's executed
client-step slots against the sizes recomputed here.

  python launch/chunk_costs.py --results=so64.json,so64_cmdbuf.json --algorithm=flow
 A vmapped chunk of k
clients runs as long as its longest client, so a round of sorted chunks costs

    seconds = fixed x chunk-steps + per_slot x client-step slots

(``core.mapping.chunk_step_counts``: chunk-steps, the sum over chunks of their longest
client's steps; slots, the sum of chunk size x those steps). The two costs are fitted to the rows
by least squares, and the fit then bounds every mapping of these clients on this device:

* padding-free floor: no mapping runs fewer chunk-steps than the longest client's steps
  (they are sequential) or fewer slots than the useful client-steps, so no round is
  shorter than ``fixed x longest + per_slot x useful``, even one that refills a finished
  client's slot with the next client;
* the best partition of the sorted clients into consecutive chunks of any sizes, and the
  best single chunk size (what ``memory_plan.chunk_for_sizes`` picks with this fit);
* what a ``--target_speedup`` over the baseline row needs, with the best single chunk
  size: the per-slot cost at the fitted fixed cost, and the fixed cost at the fitted
  per-slot cost (which step costs an optimization has to reach, before it is measured).

Client sizes are the benchmark's: ``flowjax.data.synthetic.stackoverflow_like_sizes``
with ``--sizes_seed`` (the benchmark's is 0), ``ceil(size / batch)`` steps per epoch.
"""

from __future__ import annotations

import dataclasses
import json

from absl import flags
import numpy as np

from flowjax.data.synthetic import stackoverflow_like_sizes
from flowjax.core.mapping import chunk_step_counts as chunk_counts
from launch import cli
cli.stop_at_once_while_starting(__name__)

_CLIENTS = flags.DEFINE_integer("round_clients", 64,
                                "Clients in the round (the benchmark's --clients).")
_BATCH = flags.DEFINE_integer("batch_size", 16, "Batch size (Stack Overflow: 16).")
_EPOCHS = flags.DEFINE_integer("num_epochs", 1, "Epochs per round (the benchmark's --epochs).")
_SEED = flags.DEFINE_integer("sizes_seed", 0, "Seed of the client sizes (the benchmark's: 0).")
_TIMINGS = flags.DEFINE_list("timings", [], "chunk:seconds of each measured row, e.g. "
                             "4:0.591,19:0.451 (at least two chunk sizes).")
_RESULTS = flags.DEFINE_list("results", [], "launch/benchmark.py --skewed --json_out files to "
                             "read the timings from, instead of --timings.")
_ALGORITHM = flags.DEFINE_string("algorithm", "fedavg", "Whose rows --results reads.")
_BASELINE = flags.DEFINE_integer("baseline_chunk", 0, "Chunk size of the row the speed-ups are "
                                 "relative to (default: the smallest measured).")
_TARGET = flags.DEFINE_float("target_speedup", 2.0, "Speed-up over the baseline row whose "
                              "required step costs are reported (issue 16's: 2).")
cli.define_debug_flag()


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Seconds per chunk-step (``fixed``) and per client-step slot (``per_slot``)."""

    fixed: float
    per_slot: float

    def seconds(self, chunk_steps: float, slots: float) -> float:
        return self.fixed * chunk_steps + self.per_slot * slots


def fit_step_costs(steps: np.ndarray, timings: dict[int, float]) -> StepCosts:
    """Least-squares ``StepCosts`` of rounds of sorted chunks timed at ``timings``."""
    design = np.array([chunk_counts(steps, chunk) for chunk in timings], np.float64)
    (fixed, per_slot), *_ = np.linalg.lstsq(design, np.array(list(timings.values())), rcond=None)
    return StepCosts(float(fixed), float(per_slot))


def padding_free_floor(steps: np.ndarray, costs: StepCosts) -> float:
    """The shortest round any mapping could run under ``costs`` (see the module doc)."""
    return costs.seconds(int(np.max(steps)), int(np.sum(steps)))


def best_partition(steps: np.ndarray, costs: StepCosts) -> tuple[float, list[int]]:
    """The cheapest split of the clients, sorted longest first, into consecutive chunks of
    any sizes: ``(seconds, chunk sizes in order)``."""
    ordered = np.sort(np.asarray(steps))[::-1]
    n = len(ordered)
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    start_of = np.zeros(n + 1, np.int64)
    for end in range(1, n + 1):
        starts = np.arange(end)
        # A chunk [start, end) lasts as long as its first (longest) client.
        totals = best[:end] + ordered[starts] * (costs.fixed + costs.per_slot * (end - starts))
        start_of[end] = int(np.argmin(totals))
        best[end] = totals[start_of[end]]
    sizes, end = [], n
    while end:
        sizes.append(end - int(start_of[end]))
        end = int(start_of[end])
    return float(best[n]), sizes[::-1]


def required_costs(steps: np.ndarray, costs: StepCosts, seconds: float
                   ) -> tuple[float | None, float | None]:
    """The largest ``per_slot`` (at ``costs.fixed``) and the largest ``fixed`` (at
    ``costs.per_slot``) with which some single chunk size runs a round in ``seconds``;
    None where no value does (the other cost alone already takes longer)."""
    counts = np.array([chunk_counts(steps, k) for k in range(1, len(steps) + 1)], np.float64)
    chunk_steps, slots = counts[:, 0], counts[:, 1]
    per_slot = float(np.max((seconds - costs.fixed * chunk_steps) / slots))
    fixed = float(np.max((seconds - costs.per_slot * slots) / chunk_steps))
    return (per_slot if per_slot > 0 else None), (fixed if fixed > 0 else None)


def parse_timings(values: list[str]) -> dict[int, float]:
    timings = {}
    for value in values:
        chunk, sep, seconds = value.partition(":")
        try:
            timings[int(chunk)] = float(seconds)
            valid = sep == ":" and int(chunk) >= 1 and float(seconds) > 0
        except ValueError:
            valid = False
        if not valid:
            raise ValueError(f"--timings: {value!r}; expected chunk:seconds with chunk >= 1 "
                             "and seconds > 0, e.g. 19:0.451")
    if len(timings) < 2:
        raise ValueError(f"--timings: {','.join(values) or 'none'}; expected rows of at least "
                         "two chunk sizes (two costs are fitted)")
    return timings


def timings_from_results(paths: list[str], algorithm: str
                         ) -> tuple[dict[int, tuple[float, int]], int, int]:
    """``({chunk: (round seconds, executed slots)}, clients, epochs)`` of the ``chunked``
    rows of ``algorithm`` in benchmark JSON files of one skewed round."""
    rows, shape = {}, None
    for path in paths:
        try:
            with open(path) as file:
                report = json.load(file)
            skewed, models = report.get("skewed"), report["models"]
            here = (int(report["clients"]), int(report.get("epochs", 1)))
        except (OSError, ValueError, KeyError, AttributeError) as error:
            raise ValueError(f"--results: {path}: {error}; expected a launch/benchmark.py "
                             "--json_out file") from None
        if not skewed:
            raise ValueError(f"--results: {path} is not a --skewed benchmark run")
        if len(models) != 1:
            raise ValueError(f"--results: {path} times {sorted(models)}; expected one model")
        if shape is not None and here != shape:
            raise ValueError(f"--results: {path} has (clients, epochs) {here}, the files "
                             f"before it {shape}; expected the same round")
        shape = here
        for row in next(iter(models.values()))["rows"]:
            kind, _, size = row["mapping"].partition(" ")
            if row["method"] == algorithm and kind == "chunked":
                rows[int(size)] = (float(row["round_s"]), int(row["executed_steps"]))
    if shape is None:
        raise ValueError("--results: no files")
    return rows, shape[0], shape[1]


def check_slots(steps: np.ndarray, executed: dict[int, int]) -> None:
    """Each measured row executed the slots these sizes give (same clients, same sizes)."""
    for chunk, slots in executed.items():
        expected = chunk_counts(steps, chunk)[1]
        if slots != expected:
            raise ValueError(f"chunks of {chunk} executed {slots} client-step slots in the "
                             f"benchmark, {expected} with these sizes; expected the "
                             "benchmark's --batch_size and --sizes_seed")


def report(steps: np.ndarray, timings: dict[int, float], baseline: int,
           target_speedup: float) -> str:
    """The fit, its error per row, and the bounds, as text."""
    costs = fit_step_costs(steps, timings)
    useful = int(np.sum(steps))
    base_s = timings[baseline]
    lines = [f"{len(steps)} clients, {useful} useful client-steps, longest client "
             f"{int(np.max(steps))} steps",
             f"fit: round s = {costs.fixed * 1e3:.3f} ms x chunk-steps + "
             f"{costs.per_slot * 1e3:.4f} ms x client-step slots (fixed = "
             f"{costs.fixed / costs.per_slot:.2f} client slots)",
             "| chunk | chunk-steps | slots | measured s | fitted s | fitted / measured |",
             "|---|---|---|---|---|---|"]
    for chunk, seconds in timings.items():
        chunk_steps, slots = chunk_counts(steps, chunk)
        fitted = costs.seconds(chunk_steps, slots)
        lines.append(f"| {chunk} | {chunk_steps} | {slots} | {seconds:.3f} | {fitted:.3f} | "
                     f"{fitted / seconds:.3f} |")
    uniform = {k: costs.seconds(*chunk_counts(steps, k)) for k in range(1, len(steps) + 1)}
    best_k = min(uniform, key=lambda k: (uniform[k], k))
    partition_s, sizes = best_partition(steps, costs)
    floor = padding_free_floor(steps, costs)
    for name, seconds in ((f"best single chunk size ({best_k})", uniform[best_k]),
                          (f"best consecutive chunks of any sizes ({','.join(map(str, sizes))})",
                           partition_s),
                          ("padding-free floor (any mapping)", floor)):
        lines.append(f"{name}: {seconds:.3f} s, {useful / seconds:.0f} useful client-steps/s, "
                     f"{base_s / seconds:.2f}x the measured chunks of {baseline}")
    per_slot, fixed = required_costs(steps, costs, base_s / target_speedup)
    lines.append(
        f"{target_speedup:g}x the measured chunks of {baseline} ({base_s / target_speedup:.3f} s, "
        "best single chunk size) needs: per_slot <= "
        + ("(none: the fixed cost alone is longer)" if per_slot is None
           else f"{per_slot * 1e3:.4f} ms ({per_slot / costs.per_slot:.2f}x the fit)")
        + " at the fitted fixed cost, or fixed <= "
        + ("(none: the per-slot cost alone is longer)" if fixed is None
           else f"{fixed * 1e3:.3f} ms ({fixed / costs.fixed:.2f}x the fit)")
        + " at the fitted per-slot cost")
    return "\n".join(lines)


def report_for_flags() -> str:
    """The report the flags ask for.

    Raises:
      ValueError: a bad flag or results file (one line).
    """
    clients, epochs, executed = _CLIENTS.value, _EPOCHS.value, {}
    if _RESULTS.value:
        rows, clients, epochs = timings_from_results(_RESULTS.value, _ALGORITHM.value)
        timings = {chunk: seconds for chunk, (seconds, _) in rows.items()}
        executed = {chunk: slots for chunk, (_, slots) in rows.items()}
        if len(timings) < 2:
            raise ValueError(f"--results: {_ALGORITHM.value} has chunked rows of "
                             f"{sorted(timings) or 'no'} chunk sizes; expected at least two")
    else:
        timings = parse_timings(_TIMINGS.value)
    if _TARGET.value <= 0:
        raise ValueError(f"--target_speedup={_TARGET.value}; expected > 0")
    for name, value in (("round_clients", clients), ("batch_size", _BATCH.value),
                        ("num_epochs", epochs)):
        if value < 1:
            raise ValueError(f"--{name}={value}; expected >= 1")
    baseline = _BASELINE.value or min(timings)
    if baseline not in timings:
        raise ValueError(f"--baseline_chunk={baseline}; expected one of the measured chunk "
                         f"sizes {sorted(timings)}")
    if max(timings) > clients:
        raise ValueError(f"--timings: chunk {max(timings)} exceeds --round_clients={clients}")
    # Each epoch is its own loop of the same steps: a round's counts scale by epochs.
    steps = -(-stackoverflow_like_sizes(clients, _SEED.value) // _BATCH.value) * epochs
    check_slots(steps, executed)
    return report(steps, timings, baseline, _TARGET.value)


def main(argv):
    del argv
    try:
        text = report_for_flags()
    except ValueError as error:
        return cli.fail(error)
    print(text)
    return 0


if __name__ == "__main__":
    cli.run(main)
