"""`omnigen bench` and omnigen.bench on the CPU: what can be checked without a GPU (the run itself is in
tests/test_compile_gpu.py and scripts/check-issue12.sh)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

import omnigen
from omnigen import bench
from omnigen.cli import cli

from strategies import layouts, rules

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "rules"
BENCH_RULES = Path(__file__).resolve().parents[1] / "benchmarks" / "rules"


def test_bench_without_a_gpu_says_so_in_one_line_and_exits_2(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(cli, ["bench", "--rules", str(EXAMPLES / "transfusion.yaml")])
    assert result.exit_code == 2
    assert result.output.strip() == "omnigen: error: omnigen bench needs a CUDA GPU to time on, and none is visible here"
    with pytest.raises(bench.NoGPU):
        bench.run(omnigen.Rules.load(EXAMPLES / "transfusion.yaml"))


def test_bench_help_and_bad_options():
    runner = CliRunner()
    assert "FlexAttention" in runner.invoke(cli, ["bench", "--help"]).output
    bad = runner.invoke(cli, ["bench", "--rules", str(EXAMPLES / "transfusion.yaml"), "--peers", "flex,magic"])
    assert bad.exit_code == 2 and "--peers: unknown magic" in bad.output
    bad = runner.invoke(cli, ["bench", "--rules", str(EXAMPLES / "transfusion.yaml"), "--sizes", "8k"])
    assert bad.exit_code == 2 and "--sizes must be whole numbers" in bad.output
    bad = runner.invoke(cli, ["bench", "--rules", str(EXAMPLES / "transfusion.yaml"), "--heads", "16", "--heads-kv", "5"])
    assert bad.exit_code == 2 and "--heads-kv 5 must divide --heads 16" in " ".join(bad.output.split())
    bad = runner.invoke(cli, ["bench", "--mask", "medusa_tree", "--dtype", "fp32"])
    assert bad.exit_code == 2 and "'fp32' is not one of 'bf16', 'fp16'" in bad.output


def test_bench_layouts_file_errors_name_file_and_line(tmp_path):
    path = tmp_path / "layouts.txt"
    path.write_text("text:40 image:256\ntext:40 video:9\n")
    result = CliRunner().invoke(cli, ["bench", "--rules", str(EXAMPLES / "transfusion.yaml"), "--layouts", str(path)])
    assert result.exit_code == 2 and f"{path}:2: modality 'video' is not declared" in " ".join(result.output.split())


def test_workloads_and_steps():
    r = omnigen.Rules.load(EXAMPLES / "transfusion.yaml")
    work = bench.workloads(r, dims=(64, 128), sizes=(1024, 2048), tokens=4096)
    assert [(w.dim, w.seq_len, w.batch) for w in work] == [(64, 1024, 4), (64, 2048, 2), (128, 1024, 4), (128, 2048, 2)]
    assert bench.count_steps(r, (64, 128), (1024, 2048), 4096) == 4 * len(work)
    grouped = bench.workloads(r, dims=(64,), sizes=(1024,), tokens=4096, heads=16, heads_kv=4, dtype="fp16")
    assert [(w.heads, w.heads_kv, w.dtype) for w in grouped] == [(16, 4, "fp16")]
    assert bench.mask_workloads(["medusa_tree"], (64,), (1024,), 4096, 8, 2, "fp16")[0].heads_kv == 2
    with pytest.raises(ValueError, match="must divide"):
        bench.workloads(r, dims=(64,), sizes=(1024,), tokens=4096, heads=16, heads_kv=3)
    with pytest.raises(ValueError, match="choose one of bf16, fp16"):
        bench.mask_workloads(["medusa_tree"], (64,), (1024,), 4096, 8, 0, "fp8")
    user = [omnigen.Layout.parse("text:100 image:256"), omnigen.Layout.parse("image:256 text:90")]
    work = bench.workloads(r, dims=(64,), tokens=1024, layouts=user)
    assert len(work) == 1 and work[0].seq_len == 356 and work[0].batch == 2


def test_the_benchmarks_causal_rules_are_the_plain_causal_mask_on_the_bench_layouts():
    """What issue 30's figures against cuDNN causal time: k <= q over the whole row, whatever documents the bench's
    synthetic layouts hold (a rules file that isolates documents would time a cheaper mask than cuDNN's)."""
    from omnigen.semantics import dense_mask

    r = omnigen.Rules.load(BENCH_RULES / "causal.yaml")
    work = bench.workloads(r, dims=(64,), sizes=(512,), tokens=2048)[0]
    assert work.batch == 4 and any(len(layout.segments) > 1 for layout in work.layouts)
    causal = torch.ones(512, 512, dtype=torch.bool).tril()
    for layout in work.layouts:
        assert torch.equal(dense_mask(r, layout).cpu(), causal)


def test_table_lists_rows_and_what_was_skipped_and_why():
    result = bench.Result(
        rows=[{"rules": "t", "impl": "omnigen", "D": 128, "S": 8192, "B": 4, "fwd_ms": 1.0, "fwd_bwd_ms": 3.0,
               "fwd_tflops": 300.0, "fwd_bwd_tflops": 250.0, "fwd_vs_flex": 1.5, "fwd_bwd_vs_flex": 1.4, "peak_mib": 10}],
        skipped=[{"impl": "sdpa_dense", "D": 128, "S": 8192, "B": 4, "reason": "out of memory for the dense mask"}],
        info={"gpu": "Test GPU", "torch": "2.x", "heads": 16, "tokens": 32768},
    )
    text = bench.table(result)
    assert text.splitlines()[0].startswith("attention, bf16, H=16, B*S=32768, GPU: Test GPU")
    assert "omnigen" in text and "300.0" in text
    assert "skipped sdpa_dense at D=128 S=8192 B=4: out of memory for the dense mask" in text
    assert '"skipped"' in result.to_json()
    assert "settle" not in text.splitlines()[0]  # an old result without settling says nothing of it
    grouped = bench.Result(rows=result.rows, info={**result.info, "heads_kv": 4, "dtype": "fp16"})
    assert bench.table(grouped).splitlines()[0].startswith("attention, fp16, H=16, Hkv=4, B*S=32768")
    result.info["settle_ms"] = 250.0
    assert bench.table(result).splitlines()[0].endswith("torch 2.x, each peer timed after 250 ms of its own load")


@settings(max_examples=40)
@given(st.data())
def test_flex_mask_mod_is_the_rules_mask(data):
    """The FlexAttention peer computes the same mask: its mask_mod, evaluated on every pair, equals dense_mask."""
    rule_set = data.draw(rules())
    batch = omnigen.Layout.batch([data.draw(layouts(rule_set, max_length=12)).pad_end(120)])
    tables = batch.tables(rule_set)
    mask_mod = bench.rules_mask_mod(rule_set, tables)
    S = batch.seq_len
    qi, ki = torch.arange(S)[:, None], torch.arange(S)[None, :]
    got = mask_mod(torch.zeros((), dtype=torch.int64), 0, qi, ki)
    assert torch.equal(got, rule_set.dense_mask(batch)[0])
