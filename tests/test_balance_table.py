"""scripts/balance_table.py (issue 31, balance on paper) on a small case, in-process: the printed Markdown table has one
row per (rules, ranks, method) in order, agrees with the returned rows and the --json file, and the balanced deal's
work max/mean is no worse than the even split's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from script_modules import load_script



@pytest.mark.parametrize("rules_name", ["causal_documents", "transfusion"])
def test_small_table(rules_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = load_script("balance_table")
    out = tmp_path / "rows.json"
    rows = script.main(["--tokens", "16384", "--ranks", "2", "4", "--rules", f"examples/rules/{rules_name}.yaml",
                        "--json", str(out)])
    printed = capsys.readouterr().out

    expected = [(rules_name, ranks, method) for ranks in (2, 4) for method in ("balanced", "even", "zigzag")]
    assert [(r["rules"], r["ranks"], r["method"]) for r in rows] == expected

    table = [line for line in printed.splitlines() if line.startswith("|")]
    assert table[0] == "| " + " | ".join(script.COLUMNS) + " |"
    body = [[cell.strip() for cell in line.strip("|").split("|")] for line in table[2:]]
    assert [(cells[0], int(cells[1]), cells[2]) for cells in body] == expected
    for cells, row in zip(body, rows):
        assert len(cells) == len(script.COLUMNS)
        assert float(cells[4]) == pytest.approx(row["work_max_over_mean"], abs=1e-4)
        assert row["seq_len"] == 16384 and row["chunk"] * row["chunks"] >= 16384
        assert row["received_mib_max"] >= row["received_mib_mean"] >= 0
        # K and V, bf16, 8 heads x 128: 4096 bytes a token
        assert row["received_mib_max"] * 2 ** 20 == row["received_tokens_max"] * 4096
        assert sum(row["work"]) == pytest.approx(sum(rows[0]["work"]))  # the same work, dealt differently

    by = {(r["ranks"], r["method"]): r for r in rows}
    for ranks in (2, 4):
        assert by[ranks, "balanced"]["work_max_over_mean"] <= by[ranks, "even"]["work_max_over_mean"] + 1e-12
        assert by[ranks, "balanced"]["work_max_over_mean"] < 1.01

    written = json.loads(out.read_text())
    assert written["settings"]["tokens"] == 16384
    assert [(r["ranks"], r["method"]) for r in written["rows"]] == [(r["ranks"], r["method"]) for r in rows]


def test_too_many_ranks_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        load_script("balance_table").main(["--tokens", "256", "--ranks", "64", "--rules", "examples/rules/causal_documents.yaml"])
    assert exc.value.code == 2
    assert "too short for 64 ranks" in capsys.readouterr().err
