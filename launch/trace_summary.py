r"""Where a profiled round spent its time: a summary of a JAX profiler trace.

  python launch/trace_summary.py --trace_dir=DIR [--hlo=DIR/round.hlo.txt] [--top_ops=15]

``DIR`` is what ``jax.profiler.trace(DIR)`` wrote (``launch/benchmark.py --profile_dir``
writes one per timed row, with the compiled round's HLO beside it). The trace is the
Chrome trace JSON (``*.trace.json.gz``) that the profiler itself writes.

XLA's ops are the trace's events that carry an ``hlo_op`` argument. On a GPU they run on
the ``/device:GPU:N`` processes (kernels, one or more streams); on the CPU backend on the
host's XLA threads, several at a time. For the ops of each such process it reports:

* ``span``: first op start to last op end, and ``busy``: the union of the ops' intervals
  (on a GPU, ``1 - busy / span`` is the share of the round the device sat idle between
  kernels: launch and loop overhead, host work, synchronization);
* the op time by kind (GEMM, convolution, copy, other), classified by kernel or op name;
* the ``top`` ops by summed time, with their count and, given the compiled HLO, the JAX
  operation each came from (its ``op_name`` metadata, which names the layer), and the op
  time summed by layer and primitive (``source_key``: ``transpose(jvp(LSTM))/dot_general``
  is the LSTM's backward matrix products).

An op event that encloses others of its thread (a CPU loop's or call's own event) is
left out: its body's ops are counted. Summed op time can exceed ``busy`` where ops overlap
(CPU threads, GPU streams). Each distinct kernel of an op is a row of its own: kernels
that XLA runs inside a command buffer (a CUDA graph; on a GPU the loop bodies' fusions by
default) all carry the buffer's ``hlo_op`` (``command_buffer_23``), and are traced back
by their own name instead, which is their fusion's HLO name with ``.`` and ``-`` spelled
``_`` (``loop_multiply_fusion_3``). Library kernels (cuBLAS's ``nvjet_*``, cuDNN's) have
names of their own; inside a buffer they keep its name only and are classified by kind.
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib
import re
from typing import Any, Iterable

from absl import flags

from launch import cli
cli.stop_at_once_while_starting(__name__)

_TRACE_DIR = flags.DEFINE_string("trace_dir", None, "What jax.profiler.trace wrote (searched "
                                 "for its newest *.trace.json.gz).")
_HLO = flags.DEFINE_string("hlo", None, "The compiled round's HLO text, for op names.")
_TOP = flags.DEFINE_integer("top_ops", 15, "Ops to list per process.")

# Kernel or op name fragments, lowercase, first match wins: cuDNN's convolution kernels
# are implicit GEMMs ("..._fprop_implicit_gemm_..."), so convolutions are matched first
# ("conv" alone would also match "convert").
KINDS = (("convolution", ("convolution", "convolve", "conv_general", "cudnn", "fprop", "dgrad",
                         "wgrad")),
         # nvjet: cuBLAS's own GEMM kernels on Hopper ("nvjet_tst_128x64_64x8_...").
         ("gemm", ("gemm", "xmma", "cublas", "cutlass", "matmul", "dot", "nvjet")),
         ("copy", ("memcpy", "memset", "copy", "transpose")))

_OP_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?op_name=\"([^\"]*)\"")


def find_trace(trace_dir: str | pathlib.Path) -> pathlib.Path:
    """The newest ``*.trace.json.gz`` the profiler wrote under ``trace_dir``."""
    traces = sorted(pathlib.Path(trace_dir).rglob("*.trace.json.gz"),
                    key=lambda path: path.stat().st_mtime)
    if not traces:
        raise FileNotFoundError(f"--trace_dir={trace_dir}: no *.trace.json.gz under it; "
                                "expected the folder given to jax.profiler.trace")
    return traces[-1]


def load_events(path: str | pathlib.Path) -> list[dict[str, Any]]:
    """The ``traceEvents`` of a Chrome trace JSON file, gzipped or not."""
    path = pathlib.Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        trace = json.load(handle)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> the JAX operation it came from (``op_name`` metadata), each
    instruction also under its kernel's spelling (``kernel_name``)."""
    names = {}
    for line in hlo_text.splitlines():
        match = _OP_NAME.match(line)
        if match:
            names.setdefault(match.group(1), match.group(2))
    for name, op_name in list(names.items()):
        names.setdefault(kernel_name(name), op_name)
    return names


def kernel_name(instruction: str) -> str:
    """How XLA's GPU backend names the kernel of an HLO instruction: ``.`` and ``-`` are
    not valid in a symbol, so ``loop_multiply_fusion.3`` runs as ``loop_multiply_fusion_3``."""
    return re.sub(r"[.\-]", "_", instruction)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, fragments in KINDS:
        if any(fragment in lowered for fragment in fragments):
            return kind
    return "other"


def source_key(op_name: str | None) -> str:
    """The layer and primitive of a JAX ``op_name`` path: its innermost transformed scope
    (``transpose(jvp(LSTM))``, ``jvp(Dense)``; a plain ``named_scope`` where there is none)
    and its last part (``dot_general``), without the loops and calls around them."""
    if not op_name:
        return "(no op_name)"
    *scopes, primitive = op_name.split("/")
    wrappers = ("jit(", "pjit(", "vmap(", "while", "body", "cond", "closed_call", "checkpoint")
    named = [part for part in scopes if not part.startswith(wrappers) and "->" not in part]
    transformed = [part for part in named if "(" in part]
    scope = (transformed or named or [""])[-1]
    return f"{scope}/{primitive}" if scope else primitive


def _interval(event: dict[str, Any]) -> tuple[float, float]:
    start = float(event["ts"])
    return start, start + float(event.get("dur", 0.0))


def leaf_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``events`` without those that enclose another event of their thread: on the CPU
    backend a loop's or call's own event spans its body's ops, which are counted already."""
    by_thread = collections.defaultdict(list)
    for event in events:
        by_thread[(event["pid"], event.get("tid"))].append(event)
    leaves = []
    for group in by_thread.values():
        group = sorted(group, key=lambda e: (_interval(e)[0], -_interval(e)[1]))
        for event, following in zip(group, group[1:] + [None]):
            end = _interval(event)[1]
            # Kept unless the next event of the thread starts and ends inside it.
            if following is None or _interval(following)[0] >= end or _interval(following)[1] > end:
                leaves.append(event)
    return leaves


def busy_time(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def summarize(events: list[dict[str, Any]], hlo_names: dict[str, str] | None = None,
              top: int = 15) -> dict[str, Any]:
    """Per process that ran XLA ops (device processes where there are any): span, busy
    time, time by kind and the ``top`` ops. Times in microseconds, as in the trace."""
    process, thread = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            process[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            thread[(e["pid"], e.get("tid"))] = e["args"]["name"]
    timed = [e for e in events if e.get("ph") == "X"]
    devices = {e["pid"] for e in timed if process.get(e["pid"], "").startswith("/device:")
               and "hlo_op" in e.get("args", {})}
    # A GPU's kernels and copies run on its stream lines (copies carry no hlo_op); a
    # device without lines named so: its events that carry one.
    streams = {(pid, tid) for (pid, tid), line in thread.items()
               if pid in devices and line.startswith("Stream")}
    with_streams = {pid for pid, _ in streams}
    groups = collections.defaultdict(list)
    for e in timed:
        if devices and e["pid"] not in devices:
            continue  # the host's events, where a device ran the ops
        if e["pid"] in with_streams:
            keep = (e["pid"], e.get("tid")) in streams
        else:
            keep = "hlo_op" in e.get("args", {})
        if keep:
            groups[process.get(e["pid"], str(e["pid"]))].append(e)
    return {name: _summarize_process(leaf_events(group), hlo_names or {}, top)
            for name, group in sorted(groups.items())}


def _summarize_process(events: list[dict[str, Any]], hlo_names: dict[str, str],
                       top: int) -> dict[str, Any]:
    intervals = [_interval(e) for e in events]
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    by_op: dict[tuple[str, str], dict[str, Any]] = {}
    by_kind, by_source = collections.Counter(), collections.Counter()
    for event in events:
        kernel = event["name"]
        op = event.get("args", {}).get("hlo_op", kernel)  # copies have none
        duration = float(event.get("dur", 0.0))
        # A kernel named after its own instruction first: inside a command buffer the
        # hlo_op is the buffer's, and names no JAX operation.
        source = hlo_names.get(kernel) or hlo_names.get(op)
        entry = by_op.setdefault((op, kernel), {
            "op": op, "kernel": kernel, "count": 0, "time_us": 0.0, "source": source,
            # The source's primitive only: its scopes would make every backward op a
            # "transpose(jvp(...))", a copy.
            "kind": kind_of(f"{kernel} {op} {(source or '').rsplit('/', 1)[-1]}")})
        entry["count"] += 1
        entry["time_us"] += duration
        by_kind[entry["kind"]] += duration
        by_source[source_key(source)] += duration
    total = sum(by_kind.values())
    ranked = sorted(by_op.values(), key=lambda entry: -entry["time_us"])
    return {"events": len(events), "span_us": span, "busy_us": busy_time(intervals),
            "op_time_us": total, "by_kind_us": dict(by_kind.most_common()),
            "by_source_us": dict(by_source.most_common(top)),
            "distinct_kernels": len(by_op), "top": ranked[:top]}


def format_summary(summaries: dict[str, Any]) -> str:
    """The summary as the lines ``launch/benchmark.py`` and this script print."""
    lines = []
    for name, s in summaries.items():
        idle = 1.0 - s["busy_us"] / s["span_us"] if s["span_us"] else 0.0
        lines.append(f"{name}: {s['events']} op events, {s['distinct_kernels']} distinct "
                     f"(op, kernel) pairs; span {s['span_us'] / 1e3:.2f} ms, busy {s['busy_us'] / 1e3:.2f} ms "
                     f"(idle {idle:.1%}); op time {s['op_time_us'] / 1e3:.2f} ms: "
                     + ", ".join(f"{kind} {time / s['op_time_us']:.1%}"
                                 for kind, time in s["by_kind_us"].items()))
        lines.append("by layer and primitive (the compiled HLO's op_name): " + ", ".join(
            f"{key} {time / s['op_time_us']:.1%}" for key, time in s["by_source_us"].items()))
        lines.append("| op | kernel | kind | count | ms | share | from |")
        lines.append("|---|---|---|---|---|---|---|")
        for entry in s["top"]:
            lines.append(f"| {entry['op']} | {entry['kernel'][:60]} | {entry['kind']} | "
                         f"{entry['count']} | {entry['time_us'] / 1e3:.3f} | "
                         f"{entry['time_us'] / s['op_time_us']:.1%} | "
                         f"{(entry['source'] or '-')[-90:]} |")
    return "\n".join(lines)


def summarize_dir(trace_dir: str | pathlib.Path, hlo_path: str | pathlib.Path | None = None,
                  top: int = 15) -> dict[str, Any]:
    """``summarize`` of the newest trace under ``trace_dir``, named with ``hlo_path``'s
    ``op_name`` metadata where given."""
    names = op_names(pathlib.Path(hlo_path).read_text()) if hlo_path else None
    return summarize(load_events(find_trace(trace_dir)), names, top)


def main(argv: list[str]) -> int:
    del argv
    try:
        if not _TRACE_DIR.value:
            raise ValueError("--trace_dir: expected the folder given to jax.profiler.trace")
        summary = summarize_dir(_TRACE_DIR.value, _HLO.value, _TOP.value)
    except (OSError, ValueError) as error:
        return cli.fail(error)
    print(format_summary(summary))
    return 0


if __name__ == "__main__":
    cli.run(main)
