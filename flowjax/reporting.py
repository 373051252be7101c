"""Result files and tables in the paper's layout."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Mapping

from flowjax.evaluation.metrics import GROUPS


def write_text_atomic(path: str, text: str) -> None:
    """Writes to a temporary file in the same folder, then renames it over ``path``.

    A crash mid-write leaves the previous file intact.
    """
    folder = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(handle, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        # mkstemp creates 0600; the result files are for everyone the umask allows.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def write_json_atomic(path: str, payload: Any) -> None:
    """``write_text_atomic`` of ``payload`` as indented JSON."""
    write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=True))


def _pct(value: float) -> str:
    return f"{100 * value:.2f}"


COLUMNS = ("acc_g", "acc_p", "acc_p_soft", "clients_benefiting", "clients_tied",
           "acc_g_weighted", "acc_p_weighted")


def comparison_csv(results: Mapping[str, Mapping[str, Any]]) -> str:
    """One row per (method, population): the table's numbers as fractions, for scripts."""
    header = ["method", "population", "num_clients", *COLUMNS, *GROUPS]
    rows = [",".join(header)]
    for method, result in results.items():
        for population, s in result["populations"].items():
            values = [method, population, str(s["num_clients"])]
            values += [f"{s[c]:.6f}" for c in COLUMNS]
            values += [f"{s['breakdown'][g]:.6f}" for g in GROUPS]
            rows.append(",".join(values))
    return "\n".join(rows) + "\n"


def results_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """A markdown table: accuracies (paper Table 2), % clients benefiting (Table 3) and the
    instance breakdown (Fig. 3), one row per method, for each evaluated population."""
    header = ("| method | population | clients | Acc_g | Acc_p | Acc_p (soft) | "
              "% clients Acc_p > Acc_g | % ties | both correct | global only | "
              "personalized only | neither |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for method, result in results.items():
        for population, s in result["populations"].items():
            lines.append("| " + " | ".join([
                method, population, str(s["num_clients"]), _pct(s["acc_g"]), _pct(s["acc_p"]),
                _pct(s["acc_p_soft"]), _pct(s["clients_benefiting"]), _pct(s["clients_tied"]),
                *[_pct(s["breakdown"][g]) for g in GROUPS]]) + " |")
    return "\n".join(lines)
