"""Result files and tables in the paper's layout."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Mapping

from flowjax.evaluation.metrics import GROUPS


def write_json_atomic(path: str, payload: Any) -> None:
    """Writes JSON to a temporary file in the same folder, then renames it over ``path``.

    A crash mid-write leaves the previous file intact.
    """
    folder = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(handle, "w") as out:
            json.dump(payload, out, indent=2, sort_keys=True)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def _pct(value: float) -> str:
    return f"{100 * value:.2f}"


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
