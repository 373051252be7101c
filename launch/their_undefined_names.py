r"""Which of the authors' released functions read a name their module never defines.

  python launch/their_undefined_names.py --reference_dir=/path/to/Astuary/Flow

For every module of their ``trainers/`` (or the ``--modules`` given), Python's own scoping
(``symtable``, what the compiler decides) lists each function's free names that are
neither bound anywhere at the module's top level (imports, definitions, assignments,
their ``if __name__ == '__main__':`` block's hyperparameters included, since running the
script binds them) nor declared ``global`` and assigned in a function, nor builtins: such
a name raises ``NameError`` whenever the function reaches it. Then each flagged module's
``emnist_train`` (where flagged) is called once, as their client calls it, with a
one-batch stand-in net and loader and the hyperparameters their ``__main__`` sets, to
show the error as released (``--no_call`` skips it; that needs PyTorch,
``pip install -e '.[parity]'``).

Their APFL and Ditto trainers read a global ``cid`` (the per-client file of ``v``) that
nothing defines: README, "Baselines as implemented".
"""

from __future__ import annotations

import builtins
import os
import sys
import symtable

from launch import cli


def _tables(table: symtable.SymbolTable) -> list[symtable.SymbolTable]:
    nested = []
    for child in table.get_children():
        nested += [child, *_tables(child)]
    return nested


def undefined_globals(source: str, filename: str = "<module>") -> dict[str, list[str]]:
    """``{function name: sorted undefined names}`` of ``source``: free names a function
    reads that the module never binds at top level (any branch of it), that no function
    declares ``global`` and assigns, and that are not builtins. Nested functions are named
    by their own name."""
    return _undefined(symtable.symtable(source, filename, "exec"))


def _undefined(top: symtable.SymbolTable) -> dict[str, list[str]]:
    """``undefined_globals`` of a module's symbol table."""
    nested = _tables(top)
    bound = {s.get_name() for s in top.get_symbols()
             if s.is_assigned() or s.is_imported() or s.is_namespace()}
    bound |= {s.get_name() for t in nested for s in t.get_symbols()
              if s.is_declared_global() and s.is_assigned()}
    found: dict[str, list[str]] = {}
    for table in nested:
        if table.get_type() != "function":
            continue
        names = sorted(s.get_name() for s in table.get_symbols()
                       if s.is_global() and s.is_referenced() and s.get_name() not in bound
                       and not hasattr(builtins, s.get_name()))
        if names:
            found[table.get_name()] = names
    return found


def _call_emnist_train(reference_dir: str, module_name: str) -> str:
    """What their ``emnist_train`` of ``module_name`` raises (or "ran") when called with
    a one-batch stand-in net and loader and the hyperparameters of their EMNIST config
    for that method as their ``__main__`` binds them."""
    import torch

    from launch import parity
    module = parity.import_their_trainer(reference_dir, module_name)
    # Their __main__ binds these from configs (lr, epochs, checkpoint_dir, lambda_ or
    # alpha, DEVICE); the values do not matter to a NameError at the function's start.
    module.__dict__.update(lr=0.1, epochs=1, lambda_=0.1, alpha=0.25, DEVICE="cpu",
                           checkpoint_dir=os.path.join(reference_dir, "missing_checkpoints"))
    net = torch.nn.Linear(4, 3)
    batch = [(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))]
    try:
        module.emnist_train(net, batch, batch)
    except NameError as error:
        return f"NameError: {error}"
    except Exception as error:  # noqa: BLE001 - reported, not handled
        return f"{type(error).__name__}: {error}"
    return "ran"


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference_dir", required=True,
                        help="checkout of github.com/Astuary/Flow")
    parser.add_argument("--modules", default="",
                        help="comma-separated paths under it (default: every trainers/*.py)")
    parser.add_argument("--no_call", action="store_true",
                        help="only the static pass (no PyTorch needed)")
    args = parser.parse_args(argv)
    trainers = os.path.join(args.reference_dir, "trainers")
    if not os.path.isdir(trainers):
        parser.error(f"--reference_dir={args.reference_dir!r}: expected a checkout of "
                     "github.com/Astuary/Flow (no trainers/ folder)")
    paths = ([p for p in args.modules.split(",") if p] or
             sorted(os.path.join("trainers", f) for f in os.listdir(trainers)
                    if f.endswith(".py")))
    flagged = 0
    for path in paths:
        with open(os.path.join(args.reference_dir, path)) as file:
            source = file.read()
        top = symtable.symtable(source, path, "exec")
        found = _undefined(top)
        functions = sum(t.get_type() == "function" for t in _tables(top))
        if not found:
            print(f"{path}: every name its {functions} functions and methods read is defined")
            continue
        flagged += 1
        by_name: dict[str, list[str]] = {}
        for function, names in found.items():
            for name in names:
                by_name.setdefault(name, []).append(function)
        for name, functions_reading in by_name.items():
            print(f"{path}: {len(functions_reading)} of its {functions} functions and methods "
                  f"read {name!r}, which nothing defines: {', '.join(functions_reading)}")
        if not args.no_call and "emnist_train" in found:
            module_name = os.path.splitext(path)[0].replace(os.sep, ".")
            print(f"  calling their {module_name}.emnist_train: "
                  f"{_call_emnist_train(args.reference_dir, module_name)}")
    print(f"{flagged} of {len(paths)} modules read a name nothing defines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
