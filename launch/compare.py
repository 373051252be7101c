r"""Run several methods on the same clients and seed; write one comparison table.

  python launch/compare.py --config=configs/shakespeare.py:quick --methods=all --workdir=runs/cmp
  python launch/compare.py --config=configs/shakespeare.py:quick --methods=ablations --workdir=runs/abl
  python launch/compare.py --config=configs/shakespeare.py:quick --methods=flow,fedavg,ditto ...

Each method runs in ``<workdir>/<method>/`` exactly as ``launch/train.py`` would (same
config except the method, so the same sampled clients, evaluation clients and seed), and a
method whose ``results.json`` exists is not run again, so an interrupted comparison
resumes. Before anything runs, every method's config is validated and compared with the
``config.json`` its folder already holds, with the functions ``launch/reproduce.py`` uses:
a folder holding a run of another config is refused in one line naming the differing
fields (its numbers would otherwise be tabulated under the new flags).
``comparison.md`` and ``comparison.csv`` are generated from the results files:
Acc_g / Acc_p as in the paper's Table 2, % clients with Acc_p > Acc_g as in Table 3, and
the instance breakdown of Figure 3, for the training clients and the held-out clients.
A ``comparison.md`` there that shows methods this run does not is kept; this run's table
then goes to ``comparison-subset.md`` and ``.csv``.
"""

import os

from launch import cli, xla_env  # noqa: E402
cli.stop_at_once_while_starting(__name__)

xla_env.apply()

import time  # noqa: E402
from typing import Any  # noqa: E402

from absl import flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from flowjax import config as run_config  # noqa: E402
from flowjax import run_folder  # noqa: E402
from flowjax.experiment import DivergenceError  # noqa: E402
# The method list, the ablations and their overrides are shared with launch/reproduce.py.
from flowjax.paper.plan import expand, variant_overrides  # noqa: E402
from flowjax.reporting import comparison_csv, methods_outside, results_table  # noqa: E402
from flowjax.runner import (check_workdir, conflicting_fields,  # noqa: E402
                            resolved_config, run_config_to_workdir)
from flowjax.validation import validate_config  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Base run config.", lock_config=False)
_METHODS = flags.DEFINE_list("methods", ["all"], "Methods / variants, or 'all', 'ablations'.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for every method's run and the table.")
cli.define_debug_flag()


def method_configs(base: Any, workdir: str, methods: list[str]) -> dict[str, Any]:
    """Every method's run config, validated and checked against its folder, before any runs.

    Raises:
      ValueError: no method, an unknown one, a bad config value, or a method folder
        holding a run (finished or not) of another config (one line).
    """
    names = expand(methods)
    if not names:
        raise ValueError("--methods is empty; expected method or ablation names, 'all' or "
                         "'ablations', e.g. --methods=flow,fedavg")
    if "" in names:
        raise ValueError(f"--methods={','.join(methods)} holds an empty name; expected "
                         "comma-separated method or ablation names, e.g. --methods=flow,fedavg")
    configs = {}
    for name in names:
        config = base.copy_and_resolve_references()
        try:
            run_config.set_fields(config, variant_overrides(name, model=config.model))
            validate_config(config)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
        run_dir = os.path.join(workdir, name)
        remedy = f"delete {run_dir} to run {name} again"
        differing = conflicting_fields(run_dir, resolved_config(config), remedy)
        if differing:
            raise ValueError(f"{run_dir} holds a run of another config (differs in: "
                             f"{run_folder.named_fields(differing)}); use another --workdir, the "
                             f"flags of that run, or {remedy}")
        configs[name] = config
    return configs


def main(argv):
    del argv
    # Library INFO lines (orbax's per-checkpoint messages) would bury the progress bar and
    # the results table; --verbosity=0 brings them back.
    if not flags.FLAGS['verbosity'].present:
        logging.set_verbosity(logging.WARNING)
    base, workdir = _CONFIG.value, _WORKDIR.value
    start = time.perf_counter()
    try:
        if base is None:
            raise ValueError("--config is required, e.g. --config=configs/shakespeare.py:quick")
        check_workdir(workdir)
        configs = method_configs(base, workdir, _METHODS.value)
        all_results, wall = {}, []
        for name, config in configs.items():
            run_dir = os.path.join(workdir, name)
            remedy = f"delete {run_dir} to run {name} again"
            done = run_folder.path(run_dir, run_folder.RESULTS)
            if run_folder.finished(run_dir):
                print(f"{name}: finished earlier, reusing {done}")
            else:
                try:
                    run_config_to_workdir(config, run_dir)
                except (ValueError, ImportError, DivergenceError) as error:
                    raise ValueError(f"{name}: {error}") from None
            results = run_folder.read_results(run_dir, remedy)
            if not isinstance(results, dict) or not isinstance(results.get("populations"), dict):
                raise ValueError(f"{done} holds no per-population results (no 'populations' "
                                 f"field); {remedy}")
            all_results[name] = results
            timing = run_folder.read_run_info(run_dir, remedy)
            if timing is not None and "wall_time_s" in timing:
                wall.append(timing["wall_time_s"])
    except (ValueError, KeyError, ImportError, OSError) as error:  # ImportError: an extra
        return cli.fail(error)
    table = results_table(all_results)
    # run.json is timing only: a missing one leaves the table right and the sum partial.
    timed = ("the methods" if len(wall) == len(configs)
             else f"{len(wall)} of the {len(configs)} methods (the others lack run.json)")
    header = (f"Generated by `{cli.command_line()}`; "
              f"summed run time of {timed} {sum(wall):.0f} s "
              f"(this invocation {time.perf_counter() - start:.0f} s).\n\n")
    # A comparison of fewer methods keeps the wider one there (comparison-subset.md).
    stem, kept, superseded = run_folder.write_table_keeping_wider(
        os.path.join(workdir, "comparison"), lambda text: methods_outside(text, list(configs)),
        header + table + "\n", comparison_csv(all_results))
    if kept:
        print(f"kept {workdir}/comparison.md: {kept}; this comparison goes to {stem}.md")
    cli.say_superseded(superseded, stem)
    print(table)
    print(f"wrote {stem}.md and {os.path.basename(stem)}.csv")
    return 0


if __name__ == "__main__":
    cli.run(main, resumable=True)
