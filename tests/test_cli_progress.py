"""The CLI's progress in a log (not a terminal): a line per step at most every few seconds, the last always; and
`omnigen bench --json FILE` keeping the rows timed so far."""

from __future__ import annotations

import io
import json

from omnigen.cli.bench import _PartialJson
from omnigen.cli.progress import LogProgress, progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_log_gets_a_line_per_interval_and_the_last_step():
    stream, clock = io.StringIO(), Clock()
    bar = LogProgress(5, "benchmarking masks", stream, interval=5.0, clock=clock)
    bar.update(1, "causal_documents D128 S8192: masks made")  # the first step prints
    clock.now += 2
    bar.update(1, "causal_documents D128 S8192: warmed up")  # 2 s after the last line: quiet
    clock.now += 4
    bar.update(1, "causal_documents D128 S8192: forward timed")  # 6 s: prints
    bar.update(1, "quiet")
    clock.now += 1
    bar.update(1, "causal_documents D128 S32768: masks made")  # the last: always
    assert stream.getvalue().splitlines() == [
        "benchmarking masks: 5 step(s)",
        "benchmarking masks: 1/5 causal_documents D128 S8192: masks made (0 s)",
        "benchmarking masks: 3/5 causal_documents D128 S8192: forward timed (6 s)",
        "benchmarking masks: 5/5 causal_documents D128 S32768: masks made (7 s)",
    ]


def test_progress_writes_lines_where_the_stream_is_not_a_terminal():
    stream = io.StringIO()  # isatty() is False
    with progress(3, "building 1 variant(s)", stream) as bar:
        bar.update(3, "c++ transfusion binding")
    lines = stream.getvalue().splitlines()
    assert lines[0] == "building 1 variant(s): 3 step(s)"
    assert lines[-1].startswith("building 1 variant(s): 3/3 c++ transfusion binding (")


def test_bench_json_keeps_the_rows_so_far(tmp_path):
    path = tmp_path / "masks.json"
    partial = _PartialJson(str(path), {"masks": ["causal_documents"]})
    partial.add({"mask": "causal_documents", "impl": "omnigen", "fwd_ms": 0.53})
    partial.add({"mask": "causal_documents", "impl": "flex", "fwd_ms": 0.91})
    data = json.loads(path.read_text())
    assert data["info"] == {"masks": ["causal_documents"], "partial": True}
    assert [row["impl"] for row in data["rows"]] == ["omnigen", "flex"]


def test_bench_json_to_stdout_or_none_writes_no_partial_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for path in (None, "-"):
        partial = _PartialJson(path, {})
        partial.add({"impl": "omnigen"})
    assert list(tmp_path.iterdir()) == []


def test_a_log_takes_a_longer_total_once_known():
    stream, clock = io.StringIO(), Clock()
    bar = LogProgress(12, "building 4 variant(s)", stream, interval=0.0, clock=clock)
    bar.grow(16)
    bar.update(16, "link transfusion")
    assert stream.getvalue().splitlines()[-1] == "building 4 variant(s): 16/16 link transfusion (0 s)"
    bar.grow(10)  # never shrinks
    assert bar.length == 16
