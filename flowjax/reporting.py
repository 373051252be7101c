"""Result tables in the paper's layout (the run folder's files: ``flowjax.run_folder``)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from flowjax.algorithms import lacks_model
from flowjax.evaluation.metrics import GROUPS

ABSENT = "—"  # the paper's "-": a number of a model the method does not have


def _pct(value: float) -> str:
    return f"{100 * value:.2f}"


COLUMNS = ("acc_g", "acc_p", "acc_p_soft", "clients_benefiting", "clients_tied",
           "acc_g_weighted", "acc_p_weighted")


def _breakdown(summary: Mapping[str, Any], average: str) -> list[float | None]:
    """The four groups' fractions under one average: ``client_mean`` (pairs with acc_g,
    acc_p) or ``weighted`` (instances pooled, pairs with acc_*_weighted); None for a
    results file written before the client mean existed."""
    if average == "client_mean":
        values = summary.get("breakdown_client_mean")
    else:
        values = summary["breakdown"]
    return [values[g] if values else None for g in GROUPS]


def comparison_csv(results: Mapping[str, Mapping[str, Any]]) -> str:
    """One row per (method, population): the table's numbers as fractions, for scripts.

    ``acc_*`` and ``<group>_client_mean`` are means over clients of per-client fractions;
    ``acc_*_weighted`` and ``<group>_weighted`` pool the instances of all clients.
    """
    header = ["method", "population", "num_clients", *COLUMNS,
              *[f"{g}_client_mean" for g in GROUPS], *[f"{g}_weighted" for g in GROUPS]]
    rows = [",".join(header)]
    for method, result in results.items():
        for population, s in result["populations"].items():
            values = [method, population, str(s["num_clients"])]
            values += [f"{s[c]:.6f}" for c in COLUMNS]
            values += ["" if v is None else f"{v:.6f}"
                       for v in _breakdown(s, "client_mean") + _breakdown(s, "weighted")]
            rows.append(",".join(values))
    return "\n".join(rows) + "\n"


def results_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """A markdown table: accuracies (paper Table 2), % clients benefiting (Table 3) and the
    instance breakdown (Fig. 3), one row per method, for each evaluated population.

    Every percentage in a row is a mean over clients of per-client figures, so
    ``both correct + global only = Acc_g`` and ``both correct + personalized only =
    Acc_p`` (up to the rounding of the printed digits); the instance-pooled figures are
    in ``comparison_csv``.

    As in the paper's tables, a method without personal models (FedAvg) shows "—" for
    Acc_p, and one without a trained global model (Local) for Acc_g; the columns that
    compare the two models (% benefiting, % ties, the breakdown) show "—" for both.
    ``comparison_csv`` keeps every computed number.
    """
    header = ("| method | population | clients | Acc_g (client mean) | Acc_p (client mean) | "
              "Acc_p soft (client mean) | % clients Acc_p > Acc_g | % ties | "
              "both correct (client mean) | global only (client mean) | "
              "personalized only (client mean) | neither (client mean) |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    fields = ("acc_g", "acc_p", "acc_p_soft", "clients_benefiting", "clients_tied", *GROUPS)
    for method, result in results.items():
        algorithm = result.get("algorithm", method)
        for population, s in result["populations"].items():
            values = [s[f] for f in fields[:5]] + _breakdown(s, "client_mean")
            lines.append("| " + " | ".join([
                method, population, str(s["num_clients"]),
                *[ABSENT if lacks_model(algorithm, f) else "n/a" if v is None else _pct(v)
                  for f, v in zip(fields, values)]]) + " |")
    return "\n".join(lines)


def methods_outside(csv_text: str, methods: Sequence[str]) -> list[str]:
    """The methods that the ``comparison_csv`` text shows besides ``methods``: what a
    comparison of ``methods`` would lose by replacing it.

    Raises:
      ValueError: ``csv_text`` is not a ``comparison_csv``.
    """
    lines = csv_text.splitlines()
    if not lines or not lines[0].startswith("method,population,num_clients,"):
        raise ValueError("its header is not method,population,num_clients,...")
    shown = dict.fromkeys(line.split(",", 1)[0] for line in lines[1:] if line)
    return [method for method in shown if method not in methods]
