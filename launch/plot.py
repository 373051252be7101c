r"""Draw the learning curves, instance breakdown and routing figures of runs as PNGs.

  python launch/plot.py --workdir=runs/cmp        # a launch/compare.py folder
  python launch/plot.py --workdir=/tmp/run        # one launch/train.py run
  python launch/plot.py --workdir=runs/reproduce  # a launch/reproduce.py grid
  python launch/plot.py --workdir=runs/mini --plot_methods=fedavg,flow --out_dir=/tmp/p

Every folder under ``--workdir`` holding ``results.json`` or ``metrics.jsonl`` is a run;
runs are grouped by dataset, by method (the folder holding the run, or the algorithm of a
run at ``--workdir`` itself) and by seed (``config.json``). Per dataset it writes into
``<workdir>/plots/`` (``--plot_methods=a,b``: ``<workdir>/plots-a+b/``, so a selection
never replaces the figures of every run; ``--out_dir`` sets the folder):

* ``learning_curves_<dataset>.png``: Acc_g and Acc_p per round (mean over seeds, +-std);
* ``breakdown_<dataset>.png``: the instance breakdown of the paper's Figure 3;
* ``routing_q0_<dataset>_<method>.png``: q0 per layer and instance group (routed methods),
  over every evaluated client and seed;
* ``routing_q0_one_client_<dataset>_<method>.png``: the same for the one client the
  paper's Appendix E draws, the one with the largest test-loss gap between its global and
  personalized models (over the seeds).

Unfinished runs (no ``results.json``) are drawn in the learning curves only. Needs
matplotlib (``pip install -e '.[plot]'``).
"""

import functools
import os
import sys

from launch import cli  # noqa: E402

cli.stop_at_once_while_starting(__name__)

from absl import flags  # noqa: E402

from flowjax import run_folder  # noqa: E402
from flowjax.paper import plot_data  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None,
                                "Folder of runs to plot; the PNGs go to <workdir>/plots.")
MAX_DPI = 1200
_DPI = flags.DEFINE_integer("dpi", 120, f"Resolution of the PNGs, at most {MAX_DPI}.")
_PLOT_METHODS = flags.DEFINE_list("plot_methods", [], "Only these methods' runs (the folder "
                                  "names); default: every run under --workdir.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Folder for the PNGs, added to what is "
                               "there (default: <workdir>/plots, or <workdir>/plots-a+b "
                               "for --plot_methods=a,b, where the PNGs of figures no longer "
                               "drawn are removed).")
cli.define_debug_flag()


def default_out_dir(workdir: str, methods: list[str]) -> str:
    """``<workdir>/plots``, or for a selection of methods its own folder beside it: the
    selection's figures would replace the full ones and mix with routing figures of the
    methods left out."""
    name = run_folder.PLOTS + (f"-{'+'.join(methods)}" if methods else "")
    return os.path.join(workdir, name)


def main(argv):
    del argv
    workdir = _WORKDIR.value
    if not os.path.isdir(workdir):
        print(f"error: --workdir={workdir} is not a directory", file=sys.stderr)
        return 2
    out = _OUT_DIR.value or default_out_dir(workdir, _PLOT_METHODS.value)
    # 1200 dpi is beyond any journal's; far more exhausted matplotlib's memory (a traceback).
    if not 1 <= _DPI.value <= MAX_DPI:
        return cli.fail(ValueError(f"--dpi={_DPI.value}: expected an integer in [1, {MAX_DPI}]"))
    if os.path.exists(out) and not os.path.isdir(out):
        return cli.fail(ValueError(f"--out_dir={out} is a file; expected a directory (new, "
                                   "or one to add the PNGs to)"))
    try:
        from flowjax.paper import plot_draw  # matplotlib is an optional extra
    except ImportError as error:
        if cli.debug():
            raise
        print(f"error: launch/plot.py needs matplotlib ({error}); pip install -e '.[plot]'",
              file=sys.stderr)
        return 2
    try:
        runs = plot_data.select_methods(plot_data.load_runs(workdir), _PLOT_METHODS.value)
    except (plot_data.RunFileError, ValueError) as error:
        return cli.fail(error)
    if not runs:
        print(f"error: no runs under --workdir={workdir} (no folder holds results.json or "
              f"metrics.jsonl)", file=sys.stderr)
        return 2
    for note in plot_data.run_notes(runs):
        print(f"note: {note}")
    figures = plot_draw.workdir_figures(runs)
    if not figures:
        print(f"error: nothing to plot under --workdir={workdir}: no run has an evaluation "
              f"yet", file=sys.stderr)
        return 2
    try:
        os.makedirs(out, exist_ok=True)
        # A kill there leaves its temporary file: gone at the next plot of the folder.
        run_folder.remove_write_leftovers(out, tuple(figures))
        for name, figure in figures.items():
            path = os.path.join(out, name)
            # Through a temporary file: Ctrl-C mid-write kept a truncated PNG in its place.
            run_folder.write_atomic(path, functools.partial(figure.savefig, dpi=_DPI.value,
                                                             format="png"))
            print(f"wrote {path}")
        if not _OUT_DIR.value:  # its own folder: what it no longer draws is out of date
            for name in run_folder.remove_figures(out, keep=tuple(figures)):
                print(f"removed {os.path.join(out, name)} (an earlier figure this "
                      f"invocation does not draw)")
    except OSError as error:
        return cli.fail(ValueError(f"--out_dir={out}: cannot write it "
                                   f"({error.strerror or error}); expected a directory you "
                                   "can write"))
    return 0


if __name__ == "__main__":
    flags.mark_flags_as_required(["workdir"])
    cli.run(main)
