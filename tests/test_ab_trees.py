"""scripts/ab_trees.py without a GPU: its reading of bench_backward.py's table, the summary's figures and marks, and
the rounds' order and arguments (the runs replaced by canned tables)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
import ab_trees  # noqa: E402

TABLE = """rules           D      S tile             fwd ms   bwd ms  fwd TF  bwd TF  f+b TF
causal         64   8192 m128n128w12s2     1.281    3.241   429.1   424.1   425.5
transfusion   128  32768 m128n128w12s2     7.228   21.558   620.3   520.0   545.2
transfusion   256   8192 m128n80w12s2      3.629        -   400.0       -       -
"""


def test_the_table_is_read_row_by_row():
    rows = ab_trees.parse_rows("built 3 modules\n" + TABLE)
    assert rows == {("causal", 64, 8192, "m128n128w12s2"): (1.281, 3.241),
                    ("transfusion", 128, 32768, "m128n128w12s2"): (7.228, 21.558),
                    ("transfusion", 256, 8192, "m128n80w12s2"): (3.629, None)}


def test_the_summary_gives_the_mean_change_and_marks_rows_that_do_not_overlap():
    key, other = ("causal", 64, 8192, "t"), ("transfusion", 128, 32768, "t")
    old = [{key: (1.0, 4.0), other: (2.0, 10.0)}, {key: (1.0, 4.2), other: (2.0, 10.4)}]
    new = [{key: (1.0, 3.8), other: (2.0, 10.2)}, {key: (1.0, 3.9), other: (2.0, 10.6)}]
    lines = ab_trees.summary(old, new, 1)
    assert len(lines) == 3
    assert "4.000 / 4.200" in lines[1] and "3.800 / 3.900" in lines[1] and "-6.1%  all below" in lines[1]
    assert "+2.0%" in lines[2] and "all" not in lines[2]  # 10.2 / 10.6 against 10.0 / 10.4: they overlap


def test_rounds_alternate_and_only_the_new_tree_gets_its_options(tmp_path, monkeypatch, capsys):
    for tree in ("old", "new"):
        (tmp_path / tree / "omnigen").mkdir(parents=True)
        (tmp_path / tree / "omnigen" / "__init__.py").write_text("")
    calls = []

    def fake_run(tree, bench_args, cache):
        calls.append((Path(tree).name, bench_args, cache))
        return "built 1 modules\n" if "--build-only" in bench_args else TABLE

    monkeypatch.setattr(ab_trees, "run", fake_run)
    monkeypatch.setattr(sys, "argv", ["ab_trees.py", str(tmp_path / "old"), "--new", str(tmp_path / "new"),
                                      "--rounds", "2", "--new-options", "early_scores=0", "--json",
                                      str(tmp_path / "ab.json"), "--", "--dims", "64", "--rules", "causal"])
    ab_trees.main()
    timed = [(name, args) for name, args, _ in calls if "--build-only" not in args]
    assert [name for name, _ in timed] == ["old", "new", "old", "new"]
    assert timed[0][1] == ["--dims", "64", "--rules", "causal"]
    assert timed[1][1] == ["--dims", "64", "--rules", "causal", "--options", "early_scores=0"]
    assert {cache for _, _, cache in calls} == {"/tmp/ab-trees-old", "/tmp/ab-trees-new"}
    out = capsys.readouterr().out
    assert "backward ms" in out and "+0.0%" in out and (tmp_path / "ab.json").is_file()


def test_a_tree_without_omnigen_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["ab_trees.py", str(tmp_path), "--", "--dims", "64"])
    with pytest.raises(SystemExit):
        ab_trees.main()


def test_paired_mode_times_the_old_trees_modules_in_the_new_trees_process(tmp_path, monkeypatch, capsys):
    for tree in ("old", "new"):
        (tmp_path / tree / "omnigen").mkdir(parents=True)
        (tmp_path / tree / "omnigen" / "__init__.py").write_text("")
    calls = []
    module_line = '{"rules": "causal", "dim": 64, "tile": "m128n128w12s2", "file": "/x.so", "name": "x"}\n'

    def fake_run(tree, bench_args, cache):
        calls.append((Path(tree).name, bench_args, cache))
        if "--build-only" in bench_args:
            return "built 1 modules\n"
        return module_line if "--print-modules" in bench_args else "paired table\n"

    monkeypatch.setattr(ab_trees, "run", fake_run)
    cache = str(tmp_path / "ab")
    monkeypatch.setattr(sys, "argv", ["ab_trees.py", str(tmp_path / "old"), "--new", str(tmp_path / "new"),
                                      "--paired", "8", "--cache", cache, "--new-options", "early_scores=0", "--",
                                      "--dims", "64"])
    ab_trees.main()
    timed = [(name, args, c) for name, args, c in calls if "--build-only" not in args]
    assert [name for name, _, _ in timed] == ["old", "new"]  # the module list, then one timing process
    assert timed[0][1] == ["--dims", "64", "--print-modules"] and timed[0][2] == cache + "-old"
    listed = Path(cache + "-new") / "old-modules.jsonl"
    assert listed.read_text() == module_line
    assert timed[1][1] == ["--dims", "64", "--options", "early_scores=0", "--against", str(listed),
                           "--alternations", "8"]
    assert "paired table" in capsys.readouterr().out


def test_a_paired_change_is_the_median_of_the_batches_ratios():
    import bench_backward

    change, low, high = bench_backward.paired_change([2.0, 2.2, 2.0, 1.8], [1.9, 2.09, 2.0, 1.8])
    assert change == pytest.approx(-0.025)  # ratios -5%, -5%, 0, 0
    assert low <= change <= high and low == pytest.approx(-0.05) and high == pytest.approx(0.0)
