r"""Run one paper table's dataset x method x seed grid; write it beside the paper's figures.

  python launch/reproduce.py --table=table2 --workdir=runs/paper
  python launch/reproduce.py --table=table3 --workdir=runs/paper        # Table 2's runs
  python launch/reproduce.py --table=soft_hard --workdir=runs/paper     # Flow's runs
  python launch/reproduce.py --table=regularization --datasets=shakespeare --scale=mini \
      --seeds=0,44,56 --workdir=runs/mini
  python launch/reproduce.py --table=table2 --datasets=emnist \
      --override=emnist:data.store_dir=data/emnist --workdir=runs/paper
  python launch/reproduce.py --table=table2 --workdir=runs/paper --dry_run   # the plan
  python launch/reproduce.py --table=table2 --workdir=runs/paper --aggregate_only

A cell's config includes the ``--override`` flags it ran with: another table reuses it only
when given the same flags.

Tables: table2 (Acc_g, Acc_p), table3 (% clients with Acc_p > Acc_g, ties separate), and
the ablations regularization, pi_pc_flow, fixed_policy, soft_hard, order, split_ratio,
gain_source (the authors' code, each of its departures alone, on Fashion-MNIST), and
client_snapshot (FedAvgFT, APFL, Ditto, FedRep, LG-FedAvg, HypCluster and Flow scored as
the authors' evaluation scores them, the paper's Acc_g and % improved beside those
quantities, and its HypCluster Acc_p beside their Acc_p model) (``flowjax/paper/plan.py``
holds their layouts). Each run ("cell") goes to
``<workdir>/<dataset>/<variant>/seed_<seed>/`` exactly as ``launch/train.py`` would write
it; cells are shared between tables (Table 3 and soft_hard read Table 2's runs). A cell
with ``results.json`` is finished and never run again; any other cell is run, resuming
from its newest checkpoint. Then ``<workdir>/<table>.md`` and ``<table>.csv`` give, per
evaluated population, each method's mean ± sample std over the seeds with the paper's
figure beside it (``flowjax/paper/aggregate.py``, ``flowjax/paper/tables.py``). A table
there that shows results outside the grid (a run of more datasets, methods or seeds made
it) is kept, and this grid's goes to ``<table>-subset.md`` and ``.csv``.

``--scale=paper`` runs each dataset's paper config (``configs/<dataset>.py:paper``;
CIFAR: ``configs/cifar.py:cifar10_0.1`` etc.), ``--scale=mini`` the CPU-sized configs of the
datasets that have one (``configs/shakespeare.py:mini``, ``configs/fashion_mnist.py:mini_0.1``
and ``mini_0.6``). ``--override=[dataset:]field=value`` sets a config field
(dotted path; value as a Python literal, else a string) for every cell, or for one
dataset's cells; the cell's method, ablation and seed are applied after it. Fields a
column's name states (the dataset, its Dirichlet alpha) cannot be overridden; a table whose
overrides change anything but where the data lies, how clients are mapped, what is written
and the partition's seed names those fields and no longer says it reproduces the paper.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from launch import cli, xla_env  # noqa: E402
cli.stop_at_once_while_starting(__name__)

xla_env.apply()

import ast  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import importlib.util  # noqa: E402
import time  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any, Callable, Sequence  # noqa: E402

from absl import flags, logging  # noqa: E402

from flowjax import config as run_config  # noqa: E402
from flowjax import run_folder  # noqa: E402
from flowjax.core.checks import first_line  # noqa: E402
from flowjax.experiment import DivergenceError  # noqa: E402
from flowjax.paper.aggregate import cell_flags, load_results, summed_wall_time  # noqa: E402
from flowjax.paper.plan import (DATASETS, TABLES, Cell, TableSpec, parse_seeds,  # noqa: E402
                                plan_cells, resolve_datasets, resolve_methods,
                                resolve_table, variant_overrides)
from flowjax.paper.tables import (shown_outside, table_csv, table_entries,  # noqa: E402
                                  table_markdown)
from flowjax.runner import (check_workdir, conflicting_fields,  # noqa: E402
                            resolved_config, run_config_to_workdir)
from flowjax.validation import validate_config  # noqa: E402

_TABLE = flags.DEFINE_string("table", None, f"Paper table: {', '.join(TABLES)}.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Root of the cells and the tables.")
_SEEDS = flags.DEFINE_list("seeds", ["0", "44", "56"], "Seeds (the paper's: 0, 44, 56).")
_DATASETS = flags.DEFINE_list("datasets", [], "Datasets (default: the table's paper datasets "
                              f"that define --scale); of {', '.join(DATASETS)}.")
_SCALE = flags.DEFINE_string("scale", "paper", "paper, or mini (the CPU-sized grids of "
                             "shakespeare and fashion_mnist_0.1 / 0.6).")
_METHODS = flags.DEFINE_list("methods", [], "The table's rows to run (default: all).")
_OVERRIDE = flags.DEFINE_multi_string("override", [], "[dataset:]field=value, repeatable.")
_AGGREGATE_ONLY = flags.DEFINE_bool("aggregate_only", False,
                                    "Train nothing; rebuild the tables from finished cells.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the cells and their state; run nothing.")
cli.define_debug_flag()

ConfigLoader = Callable[[str, str], Any]
Runner = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class Override:
    """``--override=[dataset:]path=value``; ``dataset`` None applies to every dataset."""

    dataset: str | None
    path: str
    value: Any
    text: str


@dataclasses.dataclass(frozen=True)
class Request:
    """A checked command line."""

    table: TableSpec
    workdir: str
    datasets: list[str]
    methods: list[str]
    explicit_methods: bool
    seeds: list[int]
    scale: str
    overrides: list[Override]

    @property
    def cells(self) -> list[Cell]:
        return plan_cells(self.table, self.datasets, self.methods, self.seeds,
                          self.explicit_methods)

    @property
    def skipped(self) -> set[tuple[str, str]]:
        """``(variant, dataset)`` pairs the paper did not run and this grid leaves out."""
        if self.explicit_methods:
            return set()
        return {(v, d) for v in self.methods for d in self.datasets
                if (v, d) in self.table.paper_skips}


def parse_override(text: str) -> Override:
    """``[dataset:]field.path=value`` with value as a Python literal, else a string."""
    target, sep, raw = text.partition("=")
    dataset, colon, path = target.rpartition(":")
    if not sep or not path.strip():
        raise ValueError(f"bad --override={text!r}; expected [dataset:]field=value, e.g. "
                         "--override=emnist:data.store_dir=data/emnist")
    if colon and dataset not in DATASETS:
        raise ValueError(f"--override={text!r} names unknown dataset {dataset!r}; expected "
                         f"one of {', '.join(DATASETS)}")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw  # a bare word or path: the string itself
    return Override(dataset if colon else None, path.strip(), value, text)


def apply_override(config: Any, override: Override) -> None:
    """Sets an existing field; an unknown field or a value of the wrong type is an error."""
    try:
        run_config.set_fields(config, {override.path: override.value})
    except ValueError as error:
        raise ValueError(f"--override={override.text!r}: {error}") from None


# Fields each cell sets itself (``cell_config``), and the flag that chooses them.
_CELL_FIELDS = {"seed": "--seeds", "algorithm": "--methods"}
# Fields a column's name states (``--datasets``: ``fashion_mnist_0.1`` is Fashion-MNIST
# split by a Dirichlet of alpha 0.1): an override of them would publish one dataset's or
# alpha's numbers under another's header.
_COLUMN_FIELDS = ("dataset", "data.name", "data.prefix", "data.partition", "data.alpha")
# Fields an override may change while the cells still run the paper's setup: where the
# data lies, how clients are mapped onto the machine, what is written and when, and the
# partition's seed (the paper states none). Any other changed field is a departure the
# table states (``setup_departures``).
_SETUP_NEUTRAL = ("data.store_dir", "data.data_dir", "data.seed", "mapping", "conv_impl",
                  "eval.chunk", "lstm_unroll", "on_divergence", *run_folder.OUTPUT_ONLY_FIELDS)


def build_request(table: str, workdir: str | None, seeds: Sequence[str],
                  datasets: Sequence[str], scale: str, methods: Sequence[str],
                  overrides: Sequence[str]) -> Request:
    """The command line, checked; ValueError with one line naming the bad value."""
    spec = resolve_table(table)
    if not workdir:
        raise ValueError("--workdir is required (the root of the cells and the tables)")
    parsed = [parse_override(text) for text in overrides]
    for override in parsed:
        # A cell's variant and seed are set last (cell_config): an override of them would
        # be silently undone.
        if override.path in _CELL_FIELDS:
            raise ValueError(f"--override={override.text!r}: {override.path} is set by each "
                             f"cell; expected {_CELL_FIELDS[override.path]} instead")
        if override.path in _COLUMN_FIELDS:
            raise ValueError(f"--override={override.text!r}: {override.path} is what a "
                             "column's name states; expected another column (--datasets), "
                             "or launch/compare.py or launch/train.py for other data")
    return Request(spec, workdir, resolve_datasets(spec, datasets, scale),
                   resolve_methods(spec, methods), bool(methods), parse_seeds(seeds), scale,
                   parsed)


@functools.lru_cache(maxsize=None)
def _config_module(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_reproduce_{os.path.basename(path)[:-3]}",
                                                  path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_dataset_config(dataset: str, scale: str) -> Any:
    """A fresh ``get_config(variant)`` of ``dataset``'s config file at ``scale``."""
    spec = DATASETS[dataset]
    module = _config_module(os.path.join(ROOT, spec.config_file))
    return module.get_config(spec.variants[scale])


def cell_config(cell: Cell, request: Request, load: ConfigLoader = load_dataset_config) -> Any:
    """The cell's run config: dataset config, then overrides, then variant and seed.

    The variant and seed come last because they define the cell (its folder).
    """
    config = load(cell.dataset, request.scale)
    for override in request.overrides:
        if override.dataset in (None, cell.dataset):
            apply_override(config, override)
    run_config.set_fields(config, variant_overrides(cell.variant, model=config.model))
    config.seed = cell.seed
    return config


def cell_state(path: str) -> str:
    """``finished`` (results.json), ``interrupted`` (started, unfinished) or ``new``."""
    if run_folder.finished(path):
        return "finished"
    return "interrupted" if run_folder.has_config(path) else "new"


def setup_departures(request: Request, load: ConfigLoader = load_dataset_config
                     ) -> dict[str, list[str]]:
    """Per dataset, the fields in which ``--override`` changes what its cells compute
    (every cell's run config against the same cell's without overrides; the fields of
    ``_SETUP_NEUTRAL`` left out); datasets without any are absent."""
    bare = dataclasses.replace(request, overrides=[])
    changed: dict[str, set[str]] = {}
    seen = set()
    for cell in request.cells:
        if (cell.dataset, cell.variant) in seen:
            continue  # overrides come before the seed: every seed changes the same fields
        seen.add((cell.dataset, cell.variant))
        fields = run_folder.differing_run_fields(resolved_config(cell_config(cell, bare, load)),
                                                 resolved_config(cell_config(cell, request,
                                                                             load)))
        changed.setdefault(cell.dataset, set()).update(
            field for field in fields
            if not any(field == n or field.startswith(n + ".") for n in _SETUP_NEUTRAL))
    return {dataset: sorted(fields) for dataset, fields in changed.items() if fields}


def checked_cell(cell: Cell, request: Request,
                 load: ConfigLoader = load_dataset_config) -> tuple[Any, list[str]]:
    """The cell's validated config, and the fields in which a run started in its folder
    differs from it (empty: none, or the same config).

    Raises:
      ValueError: a bad override or config value (one line naming the cell).
    """
    try:
        config = cell_config(cell, request, load)
        validate_config(config)
    except ValueError as error:
        raise ValueError(f"{cell.dataset}/{cell.variant}/seed_{cell.seed}: {error}") from None
    return config, conflicting_fields(cell.path(request.workdir), resolved_config(config),
                                      "delete the cell folder to rerun it")


def check_cells(request: Request, load: ConfigLoader = load_dataset_config) -> dict[Cell, Any]:
    """Every cell's config, validated, before anything runs or is tabulated.

    Raises:
      ValueError: a bad override or config value, or a started cell holding another config
        (it would be refused mid-grid, or a finished one silently reused or tabulated).
    """
    configs = {}
    for cell in request.cells:
        config, differing = checked_cell(cell, request, load)
        if differing:
            raise ValueError(f"{cell.path(request.workdir)} holds a run of another config "
                             f"(differs in: {run_folder.named_fields(differing)}); use another "
                             "--workdir or the same --scale and --override as before")
        configs[cell] = config
    return configs


def data_problems(request: Request, configs: dict[Cell, Any]) -> dict[str, str]:
    """Why a dataset's data cannot be loaded, per dataset that has an unfinished cell (a
    dataset whose data loads is absent). Each is loaded once, with its first unfinished
    cell's config, so a grid never trains for hours and then stops at a missing file."""
    problems, checked = {}, set()
    for cell, config in configs.items():
        if cell.dataset in checked or cell_state(cell.path(request.workdir)) == "finished":
            continue
        checked.add(cell.dataset)
        try:
            run_config.build_task(config)
        except (ValueError, OSError, ImportError) as error:
            problems[cell.dataset] = first_line(error)
    return problems


def check_data(request: Request, configs: dict[Cell, Any]) -> None:
    """Raises ValueError (one line) when a dataset with an unfinished cell cannot load."""
    problems = data_problems(request, configs)
    if problems:
        dataset, problem = next(iter(problems.items()))
        others = f" (and {len(problems) - 1} other dataset(s))" if len(problems) > 1 else ""
        raise ValueError(f"--datasets={dataset}: its data cannot be loaded, so no cell ran"
                         f"{others}: {problem} (here a data option is set with "
                         f"--override={dataset}:data.<option>=VALUE)")


def run_cells(request: Request, configs: dict[Cell, Any], run: Runner = run_config_to_workdir,
              progress: bool = True) -> list[Cell]:
    """Runs every unfinished cell (resuming started ones); returns the cells that diverged."""
    failed = []
    for index, (cell, config) in enumerate(configs.items(), start=1):
        path = cell.path(request.workdir)
        state = cell_state(path)
        where = f"[{index}/{len(configs)}] {cell.dataset}/{cell.variant}/seed_{cell.seed}"
        if state == "finished":
            print(f"{where}: finished earlier, reusing {path}/results.json", flush=True)
            continue
        print(f"{where}: {'resuming' if state == 'interrupted' else 'running'} in {path}",
              flush=True)
        try:
            run(config, path, progress=progress)
        except DivergenceError as error:
            # One diverged seed should not cost the rest of the grid; the table leaves it
            # out and says so (aggregate.cell_flags).
            print(f"error: {where}: {error}", file=sys.stderr, flush=True)
            failed.append(cell)
    return failed


def write_tables(request: Request, command: str, started: float,
                 load: ConfigLoader = load_dataset_config) -> tuple[str, str]:
    """Writes ``<workdir>/<table>.md`` and ``.csv`` from the finished cells; the markdown
    and the path written without extension.

    Where the table there shows results outside this grid (it came from a run of more
    datasets, methods or seeds), it is kept and this grid's goes to
    ``<table>-subset.md``: running part of a grid never hides the rest.
    """
    cells = request.cells
    results = load_results(request.workdir, cells)
    wall, timed = summed_wall_time(request.workdir, cells)
    header = (f"Generated by `{command}`; summed wall time of {timed} of {len(cells)} cells "
              f"{wall:.0f} s (this invocation {time.perf_counter() - started:.0f} s), "
              f"--scale={request.scale}.")
    entries = table_entries(request.table, results, request.datasets, request.seeds,
                            request.methods, request.skipped,
                            cell_flags(request.workdir, cells))
    markdown = table_markdown(request.table, entries, request.datasets, request.seeds, header,
                              scale=request.scale, departures=setup_departures(request, load))
    os.makedirs(request.workdir, exist_ok=True)
    stem, kept, superseded = run_folder.write_table_keeping_wider(
        os.path.join(request.workdir, request.table.name),
        lambda text: shown_outside(text, request.datasets, request.methods, request.seeds,
                                   request.skipped),
        markdown, table_csv(entries))
    if kept:
        print(f"kept {request.workdir}/{request.table.name}.md: {kept}; this grid's table "
              f"goes to {stem}.md (--aggregate_only with the wider grid's flags rebuilds "
              f"the whole table)", flush=True)
    cli.say_superseded(superseded, stem)
    return markdown, stem


def describe_plan(request: Request, load: ConfigLoader = load_dataset_config) -> str:
    """One line per cell: state, folder and config (``--dry_run``). A cell whose folder
    holds a run of another config shows as ``conflict``, naming the fields; a dataset
    whose data an unfinished cell could not load gets a line saying why.

    Raises:
      ValueError: a bad override or config value, as the run would (one line).
    """
    overrides = " ".join(f"--override={o.text}" for o in request.overrides)
    lines = [f"{request.table.name}: {len(request.cells)} cells (datasets "
             f"{','.join(request.datasets)} x variants {','.join(request.methods)} x seeds "
             f"{','.join(map(str, request.seeds))}; runs shared between rows once)"
             + (f", with {overrides}" if overrides else "")]
    for variant, dataset in sorted(request.skipped, key=lambda pair: pair[::-1]):
        lines.append(f"  not run (as in the paper): {variant} on {dataset}")
    configs = {}
    for cell in request.cells:
        path = cell.path(request.workdir)
        configs[cell], differing = checked_cell(cell, request, load)
        state = "conflict" if differing else cell_state(path)
        notes = ([f"holds another config, differs in: {run_folder.named_fields(differing)}"]
                 if differing else [])
        code = _ran_code(path)
        if code:
            notes.append(f"ran code {code}")
        lines.append(f"  {state:11s} {path}  "
                     f"({DATASETS[cell.dataset].config_spec(request.scale)}, "
                     f"{variant_overrides(cell.variant, model=configs[cell].model)}, "
                     f"seed={cell.seed}"
                     f"{''.join('; ' + note for note in notes)})")
    problems = data_problems(request, configs)
    for dataset in dict.fromkeys(cell.dataset for cell in request.cells):
        if dataset in problems:
            lines.append(f"  data of {dataset}: cannot be loaded: {problems[dataset]}")
    return "\n".join(lines)


def _ran_code(path: str) -> str:
    """The commit a finished cell's ``run.json`` records (short; ``+`` if the checkout
    had uncommitted changes), or ``""``: a config match alone does not tell a cell run
    by older code."""
    info = run_folder.read_run_info(path, "delete the cell folder to rerun it") or {}
    code = info.get("code") or {}
    commit = code.get("commit")
    return f"{commit[:7]}{'+' if code.get('dirty') else ''}" if commit else ""


def execute(request: Request, command: str, *, aggregate_only: bool = False,
            dry_run: bool = False, load: ConfigLoader = load_dataset_config,
            run: Runner = run_config_to_workdir, progress: bool = True) -> int:
    """Plans, runs and tabulates ``request``; the exit status.

    Raises:
      ValueError: a bad config, override or incompatible cell (one line), before any run.
    """
    started = time.perf_counter()
    # A plan only reads: a grid on a read-only share may be looked at.
    check_workdir(request.workdir, writable=not dry_run)
    if dry_run:
        print(describe_plan(request, load))
        return 0
    # Also before tabulating only: the table's header names this command, so a cell run
    # with other flags must not be counted as its result.
    configs = check_cells(request, load)
    if not aggregate_only:
        check_data(request, configs)
    failed = [] if aggregate_only else run_cells(request, configs, run, progress)
    markdown, stem = write_tables(request, command, started, load)
    print(markdown)
    print(f"wrote {stem}.md and .csv")
    if failed:
        print(f"error: {len(failed)} cell(s) diverged and are missing from the table",
              file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str]) -> int:
    del argv
    # Orbax's per-checkpoint INFO lines would bury the progress bars; --verbosity=0 shows them.
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    command = cli.command_line()
    try:
        if _TABLE.value is None:
            raise ValueError(f"--table is required; expected one of {', '.join(TABLES)}")
        request = build_request(_TABLE.value, _WORKDIR.value, _SEEDS.value, _DATASETS.value,
                                _SCALE.value, _METHODS.value, _OVERRIDE.value)
        return execute(request, command, aggregate_only=_AGGREGATE_ONLY.value,
                       dry_run=_DRY_RUN.value)
    except (ValueError, KeyError, ImportError, OSError) as error:
        # As launch/train.py: a bad value, a missing data file or package is one line.
        return cli.fail(error)


if __name__ == "__main__":
    cli.run(main, resumable=True)
